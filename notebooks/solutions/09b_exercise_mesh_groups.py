# EXERCISE: a rank's pipeline, FSDP group and TP group
def mesh_groups(rank, pp, dp, tp):
    stride = {"pp": dp * tp, "dp": tp, "tp": 1}  # row-major over (pp, dp, tp): tp varies fastest
    size = {"pp": pp, "dp": dp, "tp": tp}
    groups = {}
    for dim in ("pp", "dp", "tp"):
        mine = (rank // stride[dim]) % size[dim]   # this rank's coordinate along dim
        first = rank - mine * stride[dim]          # the same rank with that coordinate at 0
        groups[dim] = [first + i * stride[dim] for i in range(size[dim])]
    return groups
