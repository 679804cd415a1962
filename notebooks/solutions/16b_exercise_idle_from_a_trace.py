# EXERCISE: a rank's idle share of the step, from the events
def idle_share(timeline, rank):
    step_start = min(event.start for event in timeline.events)  # over every rank
    step_end = max(event.end for event in timeline.events)
    computing = sorted((e.start, e.end) for e in timeline.events if e.rank == rank and e.is_compute)
    busy, covered_until = 0.0, step_start
    for start, end in computing:  # the time covered, overlaps counted once
        if end > covered_until:
            busy += end - max(start, covered_until)
            covered_until = end
    return 1 - busy / (step_end - step_start)
