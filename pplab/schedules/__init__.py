"""Floor 1, pipeline schedules as plain data: actions, schedules, one dependency rule, a validator and
the theory.

A schedule says, for every rank, the ordered list of actions that rank runs:
compute (``F``, ``B``, or the zero-bubble ``I`` and ``W``) and the sends and
receives between ranks. Everything here is pure Python (torch is imported only
inside `from_torch`). The modules, each building on the ones before:

* `actions` — `Kind`, `Action` and the text form (``2F0``, ``1SEND_F3``); where a
  message goes and which pass frees a forward's activations;
* `schedule` — the immutable `Schedule`, `ScheduleError`, `DeadlockError`; stage placement;
* `names` — `schedule_name`: the canonical name of a schedule from any spelling of it
  ("ZBVZeroBubble", "interleaved_1f1b"); `SCHEDULE_NAMES` (pplab builds these) and
  `ALL_SCHEDULE_NAMES` (with torch's others);
* `dependencies` — the one rule of what an action needs, shared by the
  validator, the simulator and the runtime;
* `communication` — `add_communication`: the sends and receives a compute order implies;
* `builders` — `build` and the classic schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1);
* `validation` — `validate`: dependencies in order, messages matched, no deadlock;
  `check_runnable`: real ranks need a send and a receive wherever data crosses ranks;
* `textbook` — `theory`: the textbook bubble and peak in-flight activations;
* `torch_plans` — `TORCH_SCHEDULES` (torch's schedules by canonical name: torch's class
  name and stages per rank) and `from_torch`: torch.distributed.pipelining's plans as schedules;
* `torch_csv` — any schedule as the CSV torch's runtime and torchtitan run, compute-only or with
  its sends and receives (`Schedule.to_torch_csv`, `Schedule.from_torch_csv`); `check_torch_runs`,
  and `lowered_by_torch`: what torch's runtime will execute for a compute order.

The integer form `validate` and `simulate` loop over (`compiled`) reads the same rules,
once per (kind, stage).
"""

# The public surface is `__all__`. A few more names are imported here for pplab's own modules
# (message_peer, Need, peak_inflight_at, ...): importable as before, not advertised.
from pplab.schedules.actions import (
    COMM_KINDS,
    COMPUTE_KINDS,
    RELEASE_KINDS,
    SEND_KINDS,
    Action,
    Kind,
    message_boundary,
    message_peer,
    message_receiver,
    message_sender,
    releases_activations,
)
from pplab.schedules.builders import build
from pplab.schedules.communication import add_communication, from_text
from pplab.schedules.dependencies import Dependencies, Need
from pplab.schedules.names import ALL_SCHEDULE_NAMES, SCHEDULE_NAMES, schedule_name
from pplab.schedules.schedule import (
    DeadlockError,
    Schedule,
    ScheduleError,
    from_lists,
    loop_placement,
    v_placement,
)
from pplab.schedules.textbook import Theory, peak_inflight_at, theory
from pplab.schedules.torch_csv import check_torch_runs, lowered_by_torch, read_torch_csv, write_torch_csv
from pplab.schedules.torch_plans import TORCH_SCHEDULES, TorchPlan, from_torch, torch_plan
from pplab.schedules.validation import check_runnable, validate

__all__ = ["Action", "Schedule", "ScheduleError", "DeadlockError", "build", "from_text", "from_torch",
           "theory", "validate", "schedule_name", "check_torch_runs", "lowered_by_torch"]
