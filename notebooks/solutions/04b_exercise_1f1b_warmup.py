# EXERCISE: the forwards `rank` runs before 1F1B's steady phase
def warmup_forwards(rank, n_ranks, n_microbatches):
    return min(n_ranks - 1 - rank, n_microbatches)
