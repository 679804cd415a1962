"""Floor 4, where ranks live: `local` (a pool of local processes kept between calls, one-shot
processes, torchrun's processes) and `cluster` (ipyparallel engines as ranks, from Jupyter,
on one host or many). Each keeps `contract.Ranks`, what a session needs of its ranks.
"""

from pplab.base.lazy import submodules_on_first_use

__getattr__ = submodules_on_first_use(__name__)  # pplab.drivers.<module> after a bare `import pplab`
