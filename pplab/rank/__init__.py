"""Floor 3, what runs on a rank: one rank's executor and torch's schedules over the same stages,
the mesh (TP, activation checkpointing, FSDP2), checks against one device, profiling,
checkpoints and the training step. The same code under torchrun, on lab engines and in a
pool's processes; none of it imports Jupyter or the drivers.
"""

from pplab.base.lazy import submodules_on_first_use

__getattr__ = submodules_on_first_use(__name__)  # pplab.rank.<module> after a bare `import pplab`
