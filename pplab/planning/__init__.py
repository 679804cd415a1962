"""Floor 2, what is computed before (or after) a run, from schedules and costs: the cost model
and `simulator`, `prediction` (step time, bubble and memory from measured costs), `search` (the
fastest schedule and balance, with `list_scheduling` and the zero-bubble paper's heuristic,
`zero_bubble_heuristic`), `bubble` (where a measured step's bubble went), `straggler` (which
rank computes too long, a verdict a busy machine does not flip), `streams` (messages as NCCL and gloo
run them) and `doctor` (what torch's runtime will run for a schedule, on a transport)."""

from pplab.base.lazy import submodules_on_first_use

__getattr__ = submodules_on_first_use(__name__)  # pplab.planning.<module> after a bare `import pplab`
