# EXERCISE: a schedule for 2 ranks, 4 microbatches, at most 2 in flight on a rank
my_schedule = [
    "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3",  # rank 0
    "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3",  # rank 1
]
