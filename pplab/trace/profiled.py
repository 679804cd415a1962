"""Runs recorded with torch.profiler, read back as a pplab Timeline.

`torch.profiler` exports one Chrome/Kineto JSON per rank (`export_chrome_trace`, or the
`tensorboard_trace_handler` torchtitan uses: one folder per profiled step, a file per rank). Such a
trace holds spans: the operators a rank ran, and the `record_function` labels around them. Three
kinds of label name a pipeline's actions:

* `PP:<stage><kind><microbatch>`: torch's multi-stage schedules (`_PipelineScheduleRuntime`:
  Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) wrap every action
  in one (`PP:1F3`, `PP:0RECV_B2`), and so do both of pplab's runtimes (`Action.profiler_label`);
* `Forward i` / `Backward i`: torch's GPipe, around the receive, the compute and the send;
* nothing at all: torch 2.13's `Schedule1F1B`. Its trace is refused, saying so: its actions
  could only be guessed from the operators' order.

A compute action is its label's span less the receives it began with and the sends it ended
with. Sends and receives are the process group's operators (`c10d::send`, `c10d::recv_`, with
gloo's `gloo:send`/`gloo:recv` or NCCL's `record_param_comms` after them): each becomes a SEND or
RECV event of the action it serves, so that a rank waiting for a message shows as waiting on
the wire, as in pplab's own timelines. A trace with GPU activity (`gpu_user_annotation` spans of
the same labels) is read on the device's time instead, since there the CPU only launches: an
action is the span of the kernels launched while its label was open (by any thread: autograd
launches a backward from its own), collectives are NCCL's kernels. NCCL's point-to-point kernel
(`SendRecv`) does not say which way it goes, so on the device a wait for a message shows as idle
time. Checked against a real trace of an H200 (bench/results/gpu_step_trace.json.gz).

Clocks: Kineto writes every timestamp as microseconds after `baseTimeNanoseconds`, the host's
wall clock, so ranks on one host share a clock. Across hosts (different `host_name`) the ranks
are put on one clock by a collective they all took part in (pplab's steps start with one):
each rank's clock is shifted so that the collective ends at the same instant, and how far the
other collectives then disagree is reported as the alignment error.
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from pplab.trace.timeline import Event, Timeline

__all__ = ["ImportedRun", "from_profiler", "read_profiler_traces", "TraceImportError"]

PP_LABEL = re.compile(r"^PP:(\d+)(F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B)(\d+)$")
GPIPE_LABEL = re.compile(r"^(Forward|Backward) (\d+)$")
OVERLAP_LABEL = re.compile(r"^PP:\((.+)\)OVERLAP_F_B$")  # DualPipeV's forward and backward under one label
AUTOGRAD_PREFIX = "autograd::engine::evaluate_function"
STEP_LABEL = re.compile(r"^ProfilerStep#(\d+)$")
SENDS = {"c10d::send", "gloo:send", "nccl:send"}
RECEIVES = {"c10d::recv_", "c10d::recv_any_source_", "gloo:recv", "nccl:recv"}
COLLECTIVES = {  # operator -> the Timeline's kind (None: a collective that moves no data)
    "c10d::allreduce_": "ALL_REDUCE", "c10d::allgather_": "ALL_GATHER",
    "c10d::_allgather_base_": "ALL_GATHER",
    "c10d::allgather_into_tensor_coalesced_": "ALL_GATHER", "c10d::reduce_scatter_": "REDUCE_SCATTER",
    "c10d::_reduce_scatter_base_": "REDUCE_SCATTER",
    "c10d::reduce_scatter_tensor_coalesced_": "REDUCE_SCATTER",
    "c10d::barrier": None, "c10d::broadcast_": None, "gloo:all_reduce": "ALL_REDUCE", "gloo:barrier": None,
    "nccl:all_reduce": "ALL_REDUCE", "nccl:all_gather": "ALL_GATHER", "nccl:reduce_scatter": "REDUCE_SCATTER",
}
_BACKEND_SPAN = re.compile(r"^(gloo|nccl):")  # the backend's own span, after the c10d operator's
_COMPUTE_KINDS = {"F", "B", "I", "W"}
_LAUNCHES = {"cuda_runtime", "cuda_driver"}  # the host's calls that queue device work (a correlation id)
_DEVICE_WORK = {"kernel", "gpu_memcpy", "gpu_memset"}  # the device's work, with its launch's correlation id


class TraceImportError(ValueError):
    """A trace that cannot be read as a pipeline step: names the file and what was expected."""


@dataclass(frozen=True)
class Span:
    """One complete ("X") span of a trace, in microseconds on its rank's clock."""

    name: str
    start: float
    end: float
    device: bool = False  # a GPU span (kernel or gpu_user_annotation)


@dataclass
class RankTrace:
    """One rank's file: who wrote it, on which host, and its spans sorted by start."""

    path: str
    rank: int
    world_size: int | None
    host: str
    base_us: float  # baseTimeNanoseconds / 1000: add it to a span's time for the host's wall clock
    spans: list[Span]

    def __post_init__(self):
        self._starts = [span.start for span in self.spans]

    def within(self, start: float, end: float, names=None) -> list[Span]:
        """The spans that lie inside [start, end] (all, or those whose name is in `names`)."""
        first = bisect.bisect_left(self._starts, start)
        found = []
        for span in self.spans[first:]:
            if span.start > end:
                break
            if span.end <= end and (names is None or span.name in names):
                found.append(span)
        return found


@dataclass
class ImportedRun:
    """What `read_profiler_traces` found: the step as a Timeline, and how it was read.

    `other_steps` are the traces' other steps: `explain(run.timeline, schedule, run.outside,
    steps=run.other_steps)` weighs them in the straggler's verdict."""

    timeline: Timeline
    files: list[str]
    step: int  # which of the traces' steps (0 = the first they hold)
    steps_in_trace: int
    labels: str  # "PP labels", "torch GPipe labels" or "device labels" (joined by "and" if mixed)
    one_host: bool
    alignment_error: float | None  # seconds; 0 on one host (one clock), None where nothing could tell
    outside: list[float | None]  # per rank, seconds of the ProfilerStep outside the pipeline's actions
    notes: list[str] = field(default_factory=list)
    # the traces' other steps, in order: more evidence
    other_steps: list[Timeline] = field(default_factory=list)

    def summary(self) -> str:
        """A few lines: files, step, labels, clocks."""
        clock = ("one host: one clock" if self.one_host else
                 f"ranks aligned on a collective, error {self.alignment_error * 1e6:.0f} us"
                 if self.alignment_error is not None else "hosts' clocks as recorded (no common collective)")
        return "\n".join([f"{len(self.files)} rank traces, step {self.step + 1} of {self.steps_in_trace}, "
                          f"{self.labels}; {clock}", *self.notes, self.timeline.summary()])


def from_profiler(paths, *, step: int = -1) -> Timeline:
    """The Timeline of one step of a run recorded with torch.profiler (`paths`: files, or a folder).

    `step` picks one of the steps the traces hold (-1: the last). See `read_profiler_traces`
    for how the run was read (labels, clocks, alignment error)."""
    return read_profiler_traces(paths, step=step).timeline


def read_profiler_traces(paths, *, step: int = -1) -> ImportedRun:
    """Read one step of a profiled pipeline run: one Kineto JSON (or .json.gz) per rank.

    `paths` is a folder (its `*.json` and `*.json.gz` files, as `tensorboard_trace_handler`
    writes them), a file, or a list of files. Each file names its rank in its
    `distributedInfo` (torch writes it when a process group exists) or, failing that, in its
    name (`rank3`). Raises TraceImportError naming the file and what was expected."""
    files = _trace_files(paths)
    traces = sorted((_read_rank_trace(path) for path in files), key=lambda trace: trace.rank)
    _check_ranks(traces)
    windows = [_step_windows(trace) for trace in traces]
    counts = {len(found) for found in windows}
    if len(counts) != 1:
        said = ", ".join(f"rank {t.rank}: {len(w)}" for t, w in zip(traces, windows))
        raise TraceImportError(f"the ranks' traces hold different numbers of steps ({said}): record the "
                               f"same steps on every rank (one torch.profiler schedule for all)")
    [n_steps] = counts
    if not -n_steps <= step < n_steps:
        raise TraceImportError(f"step={step}: the traces hold {n_steps} step(s); give 0..{n_steps - 1} or -1")
    index = step % n_steps
    one_host = len({trace.host for trace in traces}) == 1
    device = any(span.device and PP_LABEL.match(span.name) for trace in traces for span in trace.spans)
    timeline, labels, outside, error, notes = _read_step(traces, windows, index, one_host, device)
    others = [_read_step(traces, windows, other, one_host, device)[0] for other in range(n_steps)
              if other != index]
    return ImportedRun(timeline, [t.path for t in traces], index, n_steps, labels, one_host, error, outside,
                       notes, others)


def _read_step(traces: list[RankTrace], windows, index: int, one_host: bool, device: bool):
    """Step `index` of the traces: (timeline, labels, outside per rank, alignment error, notes)."""
    chosen = [found[index][:2] for found in windows]
    offsets, error, notes = _clock_offsets(traces, chosen, one_host)
    _check_one_step(traces, chosen, offsets)
    events, labels, outside = [], set(), []
    for trace, found, offset in zip(traces, windows, offsets):
        start, end, profiled = found[index]
        rank_events, how = _rank_events(trace, (start, end), device)
        events += [event.shifted(offset) for event in rank_events]
        labels.add(how)
        compute = [e for e in rank_events if e.is_compute]
        pipeline = (max(e.end for e in compute) - min(e.start for e in compute)) if compute else 0.0
        outside.append(max(0.0, (end - start) / 1e6 - pipeline) if profiled and compute else None)
    timeline = Timeline(events, n_ranks=len(traces), label="imported from torch.profiler").normalised()
    return timeline, " and ".join(sorted(labels)), outside, error, notes


# ---------------------------------------------------------------- files


def _trace_files(paths) -> list[str]:
    """The trace files `paths` names: a folder's *.json / *.json.gz, or the files given."""
    given = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    files = []
    for path in map(Path, given):
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.name.endswith((".json", ".json.gz")))
            if not found:
                raise TraceImportError(f"{path}: no *.json or *.json.gz trace in this folder; give the "
                                       "folder torch.profiler wrote its traces to, or the files")
            files += found
        elif path.exists():
            files.append(path)
        else:
            raise TraceImportError(f"{path}: no such file or folder")
    if not files:
        raise TraceImportError("no trace files were given")
    return [str(f) for f in files]


def _read_rank_trace(path: str) -> RankTrace:
    """One file: its rank, host, clock base and complete spans."""
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as file:
            data = json.load(file)
    except (json.JSONDecodeError, EOFError, OSError, UnicodeDecodeError) as error:
        raise TraceImportError(f"{path}: not a readable JSON trace ({error}); a trace cut short while "
                               f"it was written reads like this: record it again") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceImportError(f"{path}: no 'traceEvents' list: expected the Chrome/Kineto JSON that "
                               f"torch.profiler's export_chrome_trace writes")
    info = data.get("distributedInfo") or {}
    rank = info.get("rank")
    if rank is None:
        named = re.search(r"rank[_-]?(\d+)", os.path.basename(path))
        if named is None:
            raise TraceImportError(f"{path}: no distributedInfo.rank in the trace and no 'rank<N>' in its "
                                   f"name: profile after init_process_group, or name the file by its rank")
        rank = int(named.group(1))
    spans, launches, device_work = [], {}, {}
    for raw in data["traceEvents"]:
        if raw.get("ph") != "X" or "ts" not in raw or "dur" not in raw:
            continue
        start, name = float(raw["ts"]), raw.get("name", "")
        category = raw.get("cat", "")
        correlation = (raw.get("args") or {}).get("correlation")
        if category in _LAUNCHES and correlation is not None:
            launches[correlation] = start
        elif category in _DEVICE_WORK and correlation is not None and not name.startswith("nccl"):
            # NCCL's kernels are messages and collectives, read as such: not an action's compute.
            device_work[correlation] = (start, start + float(raw["dur"]))
        if category == "gpu_user_annotation" and _is_action_label(name):
            continue  # replaced by the work the action launched (_device_spans)
        spans.append(Span(name, start, start + float(raw["dur"]),
                          device=category in _DEVICE_WORK | {"gpu_user_annotation"}))
    spans += _device_spans(spans, launches, device_work)
    spans.sort(key=lambda span: (span.start, -span.end))
    return RankTrace(path, int(rank), info.get("world_size"), str(data.get("host_name", "")),
                     float(data.get("baseTimeNanoseconds", 0)) / 1e3, spans)


def _is_action_label(name: str) -> bool:
    return bool(PP_LABEL.match(name) or GPIPE_LABEL.match(name) or OVERLAP_LABEL.match(name))


def _device_spans(spans: list[Span], launches: dict, device_work: dict) -> list[Span]:
    """Each action label's span on the device: from the first to the last kernel (or copy) launched
    while the label was open, by any thread of the rank. Kineto's own device copy of a label
    (`gpu_user_annotation`) covers only what the labelling thread launched, and autograd launches
    a backward's kernels from its device thread: on a real GPU trace every B was 1 us long."""
    launched = sorted((launches[key], *work) for key, work in device_work.items() if key in launches)
    launch_times = [launch for launch, _, _ in launched]
    found = []
    for span in spans:
        if span.device or not _is_action_label(span.name):
            continue
        inside = launched[bisect.bisect_left(launch_times, span.start):
                          bisect.bisect_right(launch_times, span.end)]
        if inside:
            found.append(Span(span.name, min(start for _, start, _ in inside),
                              max(end for _, _, end in inside), device=True))
    return found


def _check_ranks(traces: list[RankTrace]) -> None:
    """One file per rank, every rank of the world there."""
    seen: dict[int, str] = {}
    for trace in traces:
        if trace.rank in seen:
            raise TraceImportError(f"{seen[trace.rank]} and {trace.path} are both rank {trace.rank}'s "
                                   "traces: give one step's folder (one file per rank)")
        seen[trace.rank] = trace.path
    sizes = {trace.world_size for trace in traces if trace.world_size is not None}
    world = max(sizes) if sizes else len(traces)
    missing = sorted(set(range(world)) - set(seen))
    if missing:
        raise TraceImportError(f"ranks {missing} of {world} have no trace (found "
                               f"{', '.join(seen.values())}): every rank's file is "
                               "needed to see the pipeline")


# ---------------------------------------------------------------- steps


def _action_spans(trace: RankTrace) -> list[tuple[Span, tuple]]:
    """(span, (stage, kind, microbatch)) for each labelled action, GPipe's labels with stage None."""
    found = []
    for span in trace.spans:
        pp = PP_LABEL.match(span.name)
        if pp:
            found.append((span, (int(pp.group(1)), pp.group(2), int(pp.group(3)))))
            continue
        overlapped = OVERLAP_LABEL.match(span.name)
        if overlapped:
            found += _overlapped_parts(trace, span, overlapped.group(1))
            continue
        gpipe = GPIPE_LABEL.match(span.name)
        if gpipe:
            found.append((span, (None, "F" if gpipe.group(1) == "Forward" else "B", int(gpipe.group(2)))))
    return found


def _overlapped_parts(trace: RankTrace, span: Span, inside: str) -> list[tuple[Span, tuple]]:
    """DualPipeV's `PP:(0F3;3B1)OVERLAP_F_B`: torch 2.13 runs the forward, then the backward, under
    that one label. The backward begins with autograd's first operator; the forward ends with the
    last operator before it (what lies between is the backward's wait for its gradient)."""
    parts = [PP_LABEL.match(f"PP:{text}") for text in inside.split(";")]
    if len(parts) != 2 or None in parts or parts[0].group(2) != "F" or parts[1].group(2) not in ("B", "I"):
        raise TraceImportError(f"{trace.path}: the overlapped action {span.name!r}: pplab reads a forward "
                               f"then a backward under one label, as torch 2.13's DualPipeV writes it")
    operators = [other for other in trace.within(span.start, span.end)
                 if other is not span and not other.name.startswith("PP:")
                 and other.name not in SENDS | RECEIVES | COLLECTIVES.keys()]
    backward = next((op.start for op in operators if op.name.startswith(AUTOGRAD_PREFIX)), None)
    if backward is None:
        raise TraceImportError(f"{trace.path}: no autograd operator inside {span.name!r}: its backward "
                               f"cannot be told from its forward")
    # (In timing mode pplab's padding is such an operator: it is drawn as "pplab: timing pad".)
    forward_end = max((op.end for op in operators if op.end <= backward), default=backward)
    (forward, backward_part) = [(int(m.group(1)), m.group(2), int(m.group(3))) for m in parts]
    return [(Span(span.name, span.start, forward_end, span.device), forward),
            (Span(span.name, backward, span.end, span.device), backward_part)]


def _step_windows(trace: RankTrace) -> list[tuple[float, float, bool]]:
    """Each profiled step's (start, end, profiled) on this rank: torch.profiler's `ProfilerStep#N`
    spans (profiled: True), or else each repetition of the labelled actions (the k-th time an
    action appears: the window is the actions' own extent)."""
    actions = _action_spans(trace)
    if not actions:
        raise TraceImportError(
            f"{trace.path}: no pipeline labels: expected 'PP:<stage><kind><microbatch>' spans (torch's "
            f"multi-stage schedules, pplab's runtimes) or GPipe's 'Forward i' / 'Backward i'. torch 2.13's "
            f"Schedule1F1B writes none, and pplab will not guess its actions from the operators' order: "
            f"profile it through pplab (lab.pipeline(..., impl='torch') labels it), or wrap its stage's "
            f"forward_one_chunk/backward_one_chunk in record_function('PP:<stage>F<mb>') yourself")
    steps = sorted((span.start, span.end) for span in trace.spans
                   if STEP_LABEL.match(span.name) and not span.device)
    steps = [window for window in steps
             if any(window[0] <= span.start and span.end <= window[1] for span, _ in actions)]
    if steps:
        return [(first, last, True) for first, last in steps]
    occurrences: dict[tuple, list[Span]] = {}
    for span, key in actions:
        occurrences.setdefault(key, []).append(span)
    counts = {len(spans) for spans in occurrences.values()}
    if len(counts) != 1:
        raise TraceImportError(f"{trace.path}: its actions appear different numbers of times "
                               f"({sorted(counts)}), so its steps cannot be told apart: record whole steps, "
                               f"with prof.step() after each")
    [n] = counts
    windows = []
    for k in range(n):
        nth = [spans[k] for spans in occurrences.values()]
        windows.append((min(s.start for s in nth), max(s.end for s in nth), False))
    return windows


def _check_one_step(traces: list[RankTrace], windows: list[tuple[float, float]],
                    offsets: list[float]) -> None:
    """The ranks' windows must overlap on the common clock: else the files are from different steps."""
    placed = [(trace.base_us + start) / 1e6 + offset for trace, (start, _), offset in zip(traces, windows,
                                                                                          offsets)]
    ends = [(trace.base_us + end) / 1e6 + offset for trace, (_, end), offset in zip(traces, windows, offsets)]
    if max(placed) > min(ends):
        late = max(range(len(traces)), key=lambda i: placed[i])
        early = min(range(len(traces)), key=lambda i: ends[i])
        raise TraceImportError(
            f"{traces[late].path} starts its step {placed[late] - ends[early]:.3f} s after "
            f"{traces[early].path} ended its own: these files are from different steps. Give the files "
            f"of one profiled step (one folder of tensorboard_trace_handler's)")


# ---------------------------------------------------------------- clocks


def _collectives(trace: RankTrace, start: float, end: float,
                 device: bool = False) -> list[tuple[Span, str | None]]:
    """(span, kind) of the collectives in [start, end]. On the CPU: the backend's spans (gloo's),
    which last until the collective is done, where the trace has them, else the c10d operators
    (which may only post it). On the device: NCCL's collective kernels."""
    if device:
        return [(span, kind) for span in trace.within(start, end) if span.device
                for kind in [_nccl_collective(span.name)] if kind is not None]
    spans = [span for span in trace.within(start, end, COLLECTIVES) if not span.device]
    done = [span for span in spans if _BACKEND_SPAN.match(span.name)]
    return [(span, COLLECTIVES[span.name]) for span in done or spans]


def _nccl_collective(name: str) -> str | None:
    """The Timeline kind of an NCCL kernel ("ncclDevKernel_AllReduce_Sum_f32_RING_LL" -> ALL_REDUCE)."""
    if not name.startswith("nccl"):
        return None
    for marker, kind in (("AllReduce", "ALL_REDUCE"), ("AllGather", "ALL_GATHER"),
                         ("ReduceScatter", "REDUCE_SCATTER")):
        if marker in name:
            return kind
    return None


def _collective_ends(trace: RankTrace, window: tuple[float, float]) -> list[tuple[str, float]]:
    """(operator, end in host seconds) of the collectives around and in a step, in order."""
    start, end = window
    reach = max(end - start, 1.0)  # pplab's step clock takes its collectives just before the step
    return [(span.name, (trace.base_us + span.end) / 1e6)
            for span, _ in _collectives(trace, start - reach, end)]


def _clock_offsets(traces, windows, one_host: bool) -> tuple[list[float], float | None, list[str]]:
    """Seconds to add to each rank's host time to put all on one clock, the alignment error, notes."""
    if one_host:
        return [0.0] * len(traces), 0.0, []
    ends = [_collective_ends(trace, window) for trace, window in zip(traces, windows)]
    common = min(len(found) for found in ends)
    ends = [found[len(found) - common:] for found in ends]  # the latest ones: in and just before the step
    if common == 0 or any([name for name, _ in found] != [n for n, _ in ends[0]] for found in ends):
        return [0.0] * len(traces), None, [
            "the ranks ran on several hosts and took no collective in common around this step: their "
            "clocks are used as the hosts kept them (their skew is unknown)"]
    reference = [t for _, t in ends[0][:common]]
    offsets = [reference[0] - found[0][1] for found in ends]
    residuals = [abs(found[k][1] + offset - reference[k])
                 for found, offset in zip(ends, offsets) for k in range(1, common)]
    return offsets, (max(residuals) if residuals else None), []


# ---------------------------------------------------------------- one rank's step


def _rank_events(trace: RankTrace, window: tuple[float, float], device: bool) -> tuple[list[Event], str]:
    """This rank's compute, send, receive and collective events in the step `window`, in host seconds."""
    start, end = window
    base = trace.base_us
    labelled = _innermost([(span, key) for span, key in _action_spans(trace)
                           if start <= span.start and span.end <= end and span.device == device])
    gpipe = any(key[0] is None for _, key in labelled)
    how = "device labels" if device else "torch GPipe labels" if gpipe else "PP labels"
    messages = _messages(trace, window, device, [(span, key) for span, key in labelled
                                                 if key[1] not in _COMPUTE_KINDS])
    computes: list[tuple[float, float, str, int, int]] = []  # (start, end, kind, stage, mb), µs
    for span, (stage, kind, microbatch) in labelled:
        if kind in _COMPUTE_KINDS:
            stage = trace.rank if stage is None else stage  # GPipe's labels: one stage per rank
            first, last = _compute_part(span, (stage, kind, microbatch), messages)
            computes.append((first, last, kind, stage, microbatch))
    computes.sort()
    events = [Event(trace.rank, kind, stage, microbatch, (base + first) / 1e6, (base + last) / 1e6)
              for first, last, kind, stage, microbatch in computes]
    events += _message_events(trace, messages, computes)
    first_action = min((c[0] for c in computes), default=start)
    for span, kind in _collectives(trace, start, end, device):
        # One done before the rank's first action sets the step up (pplab's step clock takes one
        # to agree on time zero); those during and after it (a tied weight's sum, dp's) are the step's.
        if kind is not None and span.end > first_action:
            events.append(Event(trace.rank, kind, None, None, (base + span.start) / 1e6,
                                (base + span.end) / 1e6))
    return events, how


def _innermost(labelled: list[tuple[Span, tuple]]) -> list[tuple[Span, tuple]]:
    """Where two labels name one action (pplab's inside torch's, or GPipe's
    around pplab's), keep the inner."""
    kept = []
    for span, key in labelled:
        inner = [(other, other_key) for other, other_key in labelled if other is not span
                 and span.start <= other.start and other.end <= span.end
                 and other_key[1:] == key[1:] and other_key[1] in _COMPUTE_KINDS]
        if not inner:
            kept.append((span, key))
    return kept


@dataclass(frozen=True)
class _Message:
    """A send or receive: from its c10d operator's start to its backend span's end (the transfer
    done), and the action a `PP:<stage>RECV_F<mb>`-style label around the operator names, if any."""

    direction: str  # "send" or "recv"
    start: float
    end: float
    action: tuple | None = None  # (stage, kind, microbatch)


def _messages(trace: RankTrace, window: tuple[float, float], device: bool, labels) -> list[_Message]:
    """The step's sends and receives. gloo writes `c10d::recv_` as the receive is posted and a
    `gloo:recv` span from then until the message is in: together, one receive."""
    start, end = window
    found = []
    pending: dict[str, list[Span]] = {"send": [], "recv": []}
    for span in trace.within(start, end, SENDS | RECEIVES):
        if span.device != device:
            continue
        direction = "send" if span.name in SENDS else "recv"
        if not _BACKEND_SPAN.match(span.name):
            pending[direction].append(span)
            continue
        posted = pending[direction].pop(0) if pending[direction] else span
        action = _labelled(posted, labels)
        # A receive's backend span ends when the message is in; a send's when its work is waited
        # for (torch waits for sends late, at the step's end): a send is drawn as its posting.
        arrived = max(posted.end, span.end) if direction == "recv" else posted.end
        found.append(_Message(direction, posted.start, arrived, action))
    for direction, spans in pending.items():  # no backend span (NCCL writes record_param_comms instead)
        for posted in spans:
            found.append(_Message(direction, posted.start, posted.end, _labelled(posted, labels)))
    return sorted(found, key=lambda message: message.start)


def _labelled(posted: Span, labels) -> tuple | None:
    """The action a `PP:<stage>RECV_F<mb>`-style label around an operator names (None: no label)."""
    return next((key for label, key in labels
                 if label.start <= posted.start and posted.end <= label.end), None)


def _compute_part(span: Span, action: tuple, messages: list[_Message]) -> tuple[float, float]:
    """A label's span less the wait for the message it consumes and the sends it posted last.

    torch's multi-stage runtime waits for an action's receive inside the action's label, GPipe's
    `Forward i` holds the receive, the compute and the send; pplab's labels hold the compute alone."""
    stage, kind, microbatch = action
    consumes = (stage, "RECV_F" if kind == "F" else "RECV_B", microbatch) if kind != "W" else None
    first, last = span.start, span.end
    for message in messages:
        if message.direction != "recv" or not span.start < message.end <= span.end:
            continue
        if message.action == consumes or (message.action is None and message.start >= span.start):
            first = max(first, message.end)
    for message in messages:
        if message.direction == "send" and first <= message.start <= span.end:
            last = min(last, message.start)
    return first, last


def _message_events(trace: RankTrace, messages: list[_Message], computes) -> list[Event]:
    """SEND and RECV events. A receive is drawn as the wait it cost, as in pplab's own timelines:
    the idle time before the compute it feeds, from when the rank became free (or the receive
    was posted, if later) until the message was in; zero long when it was there in time. Its
    action is the label's where torch labelled it, else the compute it feeds (the first that
    starts once it is in); a send's is the label's, else the compute whose result it carries."""
    base, events = trace.base_us, []
    starts = [c[0] for c in computes]
    for message in messages:
        if message.direction == "recv":
            consumer = _consumer(message, computes, starts)
            if consumer is None:
                continue
            index = computes.index(consumer)
            free = computes[index - 1][1] if index else message.start
            first = max(message.start, free)
            last = max(first, min(message.end, consumer[0]))
            stage, name, microbatch = message.action or (
                consumer[3], "RECV_F" if consumer[2] == "F" else "RECV_B", consumer[4])
        else:
            carries = [c for c in computes[:bisect.bisect_right(starts, message.start)] if c[2] != "W"]
            if message.action is None and not carries:
                continue
            stage, name, microbatch = message.action or (
                carries[-1][3], "SEND_F" if carries[-1][2] == "F" else "SEND_B", carries[-1][4])
            first, last = message.start, message.end
        events.append(Event(trace.rank, name, stage, microbatch, (base + first) / 1e6, (base + last) / 1e6))
    return events


def _consumer(message: _Message, computes, starts):
    """The compute a receive feeds: the one its label names, else the first to start once it is in."""
    if message.action is not None:
        stage, name, microbatch = message.action
        kinds = ("F",) if name == "RECV_F" else ("B", "I")
        return next((c for c in computes if c[3] == stage and c[4] == microbatch and c[2] in kinds), None)
    return next((c for c in computes[bisect.bisect_left(starts, message.end - 1.0):] if c[2] != "W"), None)
