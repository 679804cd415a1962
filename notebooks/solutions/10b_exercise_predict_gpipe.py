# EXERCISE: a GPipe step's time from its stages' costs
def gpipe_step_time(forward, backward, n_microbatches, latency):
    hops = 2 * (len(forward) - 1) * latency  # the forwards cross p - 1 hops, the backwards again
    going = sum(forward) + (n_microbatches - 1) * max(forward)  # every stage once, then the slowest paces
    coming = sum(backward) + (n_microbatches - 1) * max(backward)
    return going + coming + hops
