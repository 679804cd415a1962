"""`calibrate(ranks)`: a lab's own costs, measured on its ranks in a few seconds (`lab.calibrate()`).

The probe is the tiny model in 1F1B over all the ranks, twice the ranks' count of microbatches, at
two widths (64, many small calls; 256, larger matrix products: a compute's fixed part and its part
that grows with the work need both, and a rank's threads help the one and hinder the other), a few
steps each, and the same stages profiled on one device in this process. What the steps show against
the profile is a `pplab.planning.calibration.Calibration`, kept on the lab (`lab.calibration`) and
used by `pplab.predict(schedule, profile, lab=lab)`. Floor 4.
"""

from __future__ import annotations

import time

from pplab.planning import prediction
from pplab.planning.calibration import Calibration, calibration_from_runs

PROBES = ((64, 176, 8), (256, 704, 2))  # hidden size, MLP size, sequences per microbatch
SEQ_LEN = 64
STEPS = 5  # per size, the first of them a warm-up


def calibrate(ranks, steps: int = STEPS) -> Calibration:
    """Run the probe on `ranks` (a lab, a pool, torchrun's ranks) and read its costs."""
    from pplab.data import batches
    from pplab.models.llama import LlamaConfig
    from pplab.rank.profiler import profile
    from pplab.rank.rank_pipeline import PipelineSpec
    from pplab.session.pipeline import Pipeline

    if steps < 2:
        raise ValueError(f"steps={steps}: give 2 or more (the first of them is a warm-up)")
    started = time.perf_counter()
    n_ranks = ranks.world_size
    n_microbatches = 2 * n_ranks
    device = "cuda" if str(getattr(ranks, "device", "cpu")).startswith("cuda") else "cpu"
    runs = []
    for hidden, mlp, size in PROBES:
        config = LlamaConfig.tiny(hidden_size=hidden, intermediate_size=mlp)
        spec = PipelineSpec.create(config, "1f1b", n_ranks, n_microbatches, op_timeout=ranks.op_timeout)
        profiled = profile(config, size, SEQ_LEN, n_ranks, device=device, show=False)
        batch = next(batches(size * n_microbatches, SEQ_LEN))
        pipe = Pipeline(ranks, spec)  # the plain pipeline: a notebook's would draw its steps
        try:
            timelines = [pipe.step(batch).timeline for _ in range(steps)][1:]
        finally:
            pipe.close()
        runs += [(timeline, profiled) for timeline in timelines]
    probe = (f"tiny model, 1f1b, {n_microbatches} microbatches, "
             + " and ".join(f"{hidden} wide at {size}" for hidden, _, size in PROBES)
             + f" x {SEQ_LEN} tokens, {steps - 1} steps each")
    made = calibration_from_runs(runs, spec.schedule, device=device, probe=probe,
                                 seconds=time.perf_counter() - started)
    prediction.last_calibration = made  # what a prediction without a lab cites
    return made
