"""Checkers for the course's exercises: run the learner's code, say precisely what is wrong or that it is right.

Each exercise notebook (`notebooks/*exercise*.ipynb`) has a marked cell where the learner
writes one piece, and a checker cell that calls one function here. A checker never raises
for a wrong answer: it returns a `Verdict` that prints as a short report, so a notebook
with an unwritten exercise still runs top to bottom. Checkers that need ranks run the
code on a lab; a deadlock there ends within the lab's op_timeout, and the checker restarts
the lab for the next try.

    warmup_forwards(rank, n_ranks, n_microbatches)       -> check_warmup
    stage_forward(stage, x)                              -> check_stage_forward
    forward_backward(stage, rank, tokens, targets)       -> check_send_recv (on a 2-rank lab)
    train_step(module, rank, n_ranks, tokens, targets, n_microbatches)
                                                         -> check_torch_step (on a 2-rank lab)
    a schedule's text, one line per rank                 -> check_schedule (on a lab)
    clip_global_norm(parameters, max_norm)               -> check_clipping (on a 2-rank lab)
    gpipe_step_time(forward, backward, n_microbatches, latency) -> check_gpipe_time
    a pplab.hf.Layout for a Hugging Face family pplab does not know -> check_layout
    pack_documents(token_lists, seq_len, bos, eos)       -> check_packing
    idle_share(timeline, rank)                           -> check_idle_share
    mesh_groups(rank, pp, dp, tp)                        -> check_mesh_groups
"""

from __future__ import annotations

import functools
import html
import math
import traceback
import types
from dataclasses import dataclass

from pplab.course import room

__all__ = ["check_stage_forward", "check_send_recv", "check_warmup", "check_torch_step", "check_clipping",
           "check_gpipe_time", "check_schedule", "check_mesh_groups", "check_layout", "check_packing", "check_idle_share",
           "Verdict"]

NOT_WRITTEN = "not written yet: replace `raise NotImplementedError` in the exercise cell with your code"


@dataclass(frozen=True)
class Verdict:
    """What a checker found: right or not, and what to do about it."""

    exercise: str
    right: bool
    message: str

    def __bool__(self) -> bool:
        return self.right

    def __str__(self) -> str:
        return f"{'RIGHT' if self.right else 'NOT YET'} · {self.exercise}: {self.message}"

    __repr__ = __str__

    def _repr_html_(self) -> str:
        colour, mark = ("#1a7f37", "✔ right") if self.right else ("#c00000", "✘ not yet")
        lines = "<br>".join(html.escape(line) for line in self.message.splitlines())
        return (f"<div style='border-left:4px solid {colour};padding:4px 10px'>"
                f"<b style='color:{colour}'>{mark}</b> · {html.escape(self.exercise)}<br>{lines}</div>")


# The exercises in the course's order, by the names their verdicts carry (the room's columns).
EXERCISES = ["a stage's forward", "send and receive, with gradients", "the 1F1B warm-up", "torch's API by hand",
             "global-norm clipping", "a mesh's groups", "a GPipe step's time", "a schedule by hand",
             "a layout for your own model", "text packed into sequences", "a rank's idle share from a trace"]


def _reported(check):
    """A checker whose verdict also goes to the instructor's room (`pplab.course.room`), where there is one."""
    @functools.wraps(check)
    def checked(*args, **kwargs) -> Verdict:
        verdict = check(*args, **kwargs)
        room.record_verdict(verdict.exercise, verdict.right, verdict.message)
        return verdict
    return checked


def _as_number(given) -> float | None:
    """The learner's number as a float (numpy and 0-d torch scalars too); None for anything else,
    bools included (True is not a step time)."""
    if isinstance(given, (bool, str, bytes)):
        return None
    try:
        return float(given)
    except (TypeError, ValueError):
        return None


def _close(given: float | None, expected: float) -> bool:
    """Equal to rounding (NaN is never close to anything)."""
    return given is not None and math.isclose(given, expected, rel_tol=1e-6, abs_tol=1e-9)


def _needs_two_ranks(exercise: str, lab) -> Verdict:
    return Verdict(exercise, False, f"this exercise runs on 2 ranks; the lab has {lab.world_size}: start it with "
                                    f"pplab.Lab(n_ranks=2)")


def _raised(exercise: str, error: BaseException, hint: str = "") -> Verdict:
    """A verdict for learner code that raised: where, what, and a hint if one fits."""
    if isinstance(error, NotImplementedError):
        return Verdict(exercise, False, NOT_WRITTEN)
    last = traceback.format_exception_only(type(error), error)[-1].strip()
    return Verdict(exercise, False, f"your code raised {last}" + (f"\n{hint}" if hint else ""))


# --- 1 · the 1F1B warm-up (pure) ----------------------------------------------------------------

@_reported
def check_warmup(warmup_forwards, max_ranks: int = 8, max_microbatches: int = 12) -> Verdict:
    """`warmup_forwards(rank, n_ranks, n_microbatches)`: the forwards rank runs in 1F1B before
    its steady one-forward-one-backward phase. Judged against pplab's 1F1B schedules."""
    from pplab.schedules import Kind, build

    name = "the 1F1B warm-up"
    for n_ranks in range(1, max_ranks + 1):
        for n_microbatches in range(1, max_microbatches + 1):
            schedule = build("1f1b", n_ranks, n_microbatches).compute_only()
            for rank in range(n_ranks):
                actions = schedule.actions[rank]
                before_first_backward = next(i for i, a in enumerate(actions) if a.kind == Kind.B)
                expected = min(before_first_backward, n_ranks - 1 - rank)  # the steady phase opens with an F
                try:
                    given = warmup_forwards(rank, n_ranks, n_microbatches)
                    wrong = bool(given != expected)
                except Exception as error:  # noqa: BLE001 - whatever the learner's code raised
                    return _raised(name, error)
                if wrong:
                    return Verdict(name, False, _warmup_hint(rank, n_ranks, n_microbatches, given, expected))
    return Verdict(name, True, f"every rank of every 1F1B schedule up to {max_ranks} ranks and "
                               f"{max_microbatches} microbatches warms up with as many forwards as you said")


def _warmup_hint(rank: int, n_ranks: int, n_microbatches: int, given, expected: int) -> str:
    microbatches = f"{n_microbatches} microbatch{'es' if n_microbatches > 1 else ''}"
    case = f"rank {rank} of {n_ranks} with {microbatches}: you said {given!r}, it runs {expected}"
    if given == n_ranks - 1 - rank:
        why = f"with {microbatches} a rank cannot run more forwards than that"
    elif given == n_ranks - 1 and rank:
        why = "the warm-up shrinks along the pipeline: rank r's first gradient comes back r hops sooner"
    elif isinstance(given, int) and given == expected + 1:
        why = "one too many: the first forward of the steady phase is not warm-up (it is paired with a backward)"
    else:
        why = ("the last rank gets its gradient at once; each rank before it must keep one more "
               "microbatch going while the first one travels to the end and back")
    return f"{case}.\n{why}."


# --- a GPipe step's time from per-stage costs (pure) ---------------------------------------------

@_reported
def check_gpipe_time(gpipe_step_time, max_ranks: int = 5, max_microbatches: int = 8) -> Verdict:
    """`gpipe_step_time(forward, backward, n_microbatches, latency)`: the step time of GPipe with one
    stage per rank, `forward[s]` and `backward[s]` the seconds of stage s per microbatch, `latency`
    the seconds of each hop. Judged against pplab's simulator on uneven stages, with and without latency."""
    import random

    from pplab.schedules import build
    from pplab.planning.simulator import Costs, simulate

    name = "a GPipe step's time"
    rng = random.Random(0)
    cases = [([1.0] * p, [2.0] * p, m, 0.0) for p in (1, 2, 4) for m in (1, 4)]  # even stages first
    cases += [([round(rng.uniform(0.5, 3), 1) for _ in range(p)], [round(rng.uniform(1, 5), 1) for _ in range(p)],
               m, latency) for p in range(2, max_ranks + 1) for m in (1, 3, max_microbatches) for latency in (0.0, 0.5)]
    for forward, backward, m, latency in cases:
        expected = simulate(build("gpipe", len(forward), m),
                            Costs(forward=forward, backward=backward, latency=latency)).step_time()
        try:
            given = gpipe_step_time(list(forward), list(backward), m, latency)
        except Exception as error:  # noqa: BLE001 - whatever the learner's code raised
            return _raised(name, error)
        if not _close(_as_number(given), expected):
            case = (f"forward={forward}, backward={backward}, n_microbatches={m}, latency={latency}: "
                    f"you said {given!r}, the simulator {expected:.6g}")
            return Verdict(name, False, f"{case}.\n{_gpipe_hint(forward, backward, m, latency, _as_number(given))}")
    return Verdict(name, True, f"all {len(cases)} cases, even and uneven stages, with and without latency, "
                               f"equal the simulator's step time")


def _gpipe_hint(forward, backward, m: int, latency: float, given) -> str:
    """What the learner's number most likely left out (known wrong formulas, tried in turn)."""
    p = len(forward)
    right_without_latency = sum(forward) + sum(backward) + (m - 1) * (max(forward) + max(backward))
    tries = [  # the most specific first: with one microbatch some of these coincide
        (right_without_latency, "the latency: the forwards cross p - 1 hops, and the backwards again"),
        (right_without_latency + (p - 1) * latency, "the latency is paid going forward and coming back: "
                                                   "2 (p - 1) hops"),
        ((m + p - 1) * (forward[0] + backward[0]), "(m + p - 1)(F + B) holds for even stages only: with uneven "
                                                   "ones the slowest stage paces the middle of the step"),
        ((m + p - 1) * (max(forward) + max(backward)), "not every stage is the slowest: the fill and the drain "
                                                      "pass each stage once, at its own speed"),
        (m * (sum(forward) + sum(backward)), "that is one device's time: in a pipeline the stages work at once"),
    ]
    for wrong, hint in tries:
        if _close(given, wrong):
            return hint
    return ("think of the forwards as a flow shop: the last microbatch leaves the last stage after every stage's "
            "F once plus (m - 1) times the slowest F; the backwards flow back the same way")

# --- 2 · a stage's forward: first, middle, last (pure) ---------------------------------------------

@_reported
def check_stage_forward(stage_forward, seed: int = 0) -> Verdict:
    """`stage_forward(stage, x)`: what a stage (`pplab.build_stage`) computes, from its parts
    (embed_tokens, rotary_emb, layers, norm, lm_head): judged on the first, a middle and the
    last of three stages, in value and in gradient."""
    import torch

    from pplab.data import batches
    from pplab.models.llama import LlamaConfig
    from pplab.models.partition import build_stage

    name = "a stage's forward"
    config = LlamaConfig.tiny()
    tokens, _ = next(batches(2, 16, seed=seed))
    hidden = torch.randn(2, 16, config.hidden_size, generator=torch.Generator().manual_seed(seed))
    for index, role in enumerate(("first", "middle", "last")):
        stage = build_stage(config, index, 3, seed=seed)
        x = tokens if index == 0 else hidden.clone().requires_grad_(True)
        expected = stage(x)
        stage.zero_grad(set_to_none=True)
        try:
            got = stage_forward(stage, x)
        except Exception as error:  # noqa: BLE001
            hint = ("a decoder layer takes (x, cos, sin): get cos, sin = stage.rotary_emb(seq_len) once per forward"
                    if isinstance(error, TypeError) and "cos" in str(error) else "")
            return _raised(name, error, f"(on the {role} stage) {hint}".strip())
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return Verdict(name, False, f"the {role} stage should return a tensor of shape "
                                        f"{tuple(expected.shape)}, yours returned {shape}."
                                        + _role_hint(role))
        if got.dtype != expected.dtype:
            return Verdict(name, False, f"the {role} stage should return {expected.dtype}, yours returned {got.dtype}")
        if not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
            return Verdict(name, False, f"the {role} stage's output differs from the stage's own forward "
                                        f"(largest difference {(got - expected).abs().max().item():.2e})."
                                        + _role_hint(role))
        got.float().sum().backward()
        missing = [n for n, p in stage.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
        if missing:
            return Verdict(name, False, f"on the {role} stage, {missing[0]} got no gradient: something in "
                                        f"your forward detached the tensor (.detach(), torch.no_grad, .data) "
                                        f"or skipped that part")
        if index > 0 and (x.grad is None or not x.grad.abs().sum() > 0):
            return Verdict(name, False, f"the {role} stage's input got no gradient: your forward detached it, "
                                        f"so the stages before this one would learn nothing")
    return Verdict(name, True, "the first, middle and last stage compute exactly what the stages do, "
                               "and every parameter gets its gradient")


def _role_hint(role: str) -> str:
    return {"first": "\nThe first stage turns token ids into vectors (embed_tokens), then runs its layers.",
            "middle": "\nA middle stage gets hidden states: no embedding, no head; only its layers, with RoPE.",
            "last": "\nThe last stage ends with the final norm, then lm_head: logits over the vocabulary."}[role]


# --- 3 · send and receive, with gradients (a 2-rank lab) ------------------------------------------

MESSAGES = "pplab-exercise-messages"  # the tag of what a rank publishes about the learner's messages


class _MessagesWatched:
    """The learner's sends and receives on this rank (`dist.send`, `recv`, `isend`, `irecv` and the
    waits on their works). Before each wait the rank publishes what it sent so far and what it now
    waits for, so that when a run fails the checker can say what every rank was doing, also a rank
    still stuck in its wait. torch.distributed's own functions do the work; this only notes the calls."""

    NAMES = ("send", "recv", "isend", "irecv")

    def __init__(self):
        self.sent: list[str] = []
        self.received: list[str] = []

    def __enter__(self):
        import torch.distributed as dist

        self.originals = {name: getattr(dist, name) for name in self.NAMES}
        for name, original in self.originals.items():
            setattr(dist, name, self._watched(name, original))
        return self

    def __exit__(self, kind, error, trace):
        import torch.distributed as dist

        for name, original in self.originals.items():
            setattr(dist, name, original)
        if error is None:
            self.note(None, finished=True)

    def note(self, waiting: str | None, finished: bool = False) -> None:
        from pplab.rank.rank_context import publish

        sent = ", ".join(self.sent) or "nothing"
        received = f", received {', '.join(self.received)}" if self.received else ""
        doing = "returned" if finished else f"was waiting in {waiting}" if waiting else "was past its last message"
        publish((MESSAGES, f"sent {sent}{received}, and {doing}"))

    def waits(self, what: str, wait, sends: bool):
        self.note(what)
        result = wait()
        (self.sent if sends else self.received).append(what)
        self.note(None)  # the wait is over: a later failure is not this wait's
        return result

    def _watched(self, name, original):
        def call(tensor, *args, **kwargs):
            peer = kwargs.get("dst", kwargs.get("src", args[0] if args else None))
            given = f"a {list(tensor.shape)} tensor" if hasattr(tensor, "shape") else repr(tensor)
            what = f"dist.{name}({'dst' if 'send' in name else 'src'}={peer}) of {given}"
            if name in ("isend", "irecv"):
                return _WatchedWork(original(tensor, *args, **kwargs), self, what, sends=name == "isend")
            return self.waits(what, lambda: original(tensor, *args, **kwargs), sends=name == "send")
        return call


class _WatchedWork:
    """A work of isend/irecv whose wait() is noted."""

    def __init__(self, work, watched: _MessagesWatched, what: str, sends: bool):
        self._work, self._watched, self._what, self._sends = work, watched, what, sends

    def wait(self, *args, **kwargs):
        return self._watched.waits(f"the wait() of {self._what}", lambda: self._work.wait(*args, **kwargs),
                                   self._sends)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _forward_backward_on_rank(forward_backward, config, batch) -> dict:
    from pplab.rank.rank_context import rank_context
    from pplab.models.partition import build_stage

    rank = rank_context().rank
    stage = build_stage(config, rank, 2)
    tokens, targets = batch
    with _MessagesWatched():
        loss = forward_backward(stage, rank, tokens, targets)
    return {"loss": None if loss is None else float(loss),
            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in stage.named_parameters()}}


@_reported
def check_send_recv(lab, forward_backward, seed: int = 0) -> Verdict:
    """`forward_backward(stage, rank, tokens, targets)`: rank 0 runs stage 0 and sends its output,
    rank 1 receives it, runs stage 1 and the loss, and sends back the gradient of what it
    received, with which rank 0 runs its backward. Judged against one device, on a 2-rank lab."""
    from pplab.data import batches
    from pplab.models.llama import LlamaConfig
    from pplab.rank.reference import reference_step

    name = "send and receive, with gradients"
    if lab.world_size != 2:
        return _needs_two_ranks(name, lab)
    config = LlamaConfig.tiny()
    batch = next(batches(2, 16, seed=seed))
    ran = _run_on_lab(lab, name, _forward_backward_on_rank, forward_backward, config, batch)
    if isinstance(ran, Verdict):
        return ran
    reference = reference_step(config, batch, 1, seed=0)
    loss = ran[1]["loss"]
    if loss is None or abs(loss - reference.loss) > 1e-5 * abs(reference.loss):
        return Verdict(name, False, f"rank 1 returned the loss {loss!r}, one device gets {reference.loss:.6f}: "
                                    f"rank 1 must return loss_fn(stage(x), targets)")
    for rank in (1, 0):
        for param, grad in ran[rank]["grads"].items():
            if grad is None:
                why = ("rank 1 sent no gradient back, or rank 0 never called out.backward(grad)" if rank == 0
                       else "rank 1 never ran the backward of its loss")
                return Verdict(name, False, f"rank {rank}'s {param} got no gradient: {why}")
            difference = (grad - reference.grads[param]).abs().max().item()
            if difference > 1e-5:
                why = ("the gradient rank 1 sent is not the gradient of what it received: call "
                       "x.requires_grad_() on the received activation before stage 1 runs, and send x.grad"
                       if rank == 0 else "rank 1's backward differs from one device's")
                return Verdict(name, False, f"rank {rank}'s {param} differs from one device by {difference:.2e}: {why}")
    return Verdict(name, True, f"loss {loss:.6f} and every gradient on both ranks equal one device's")



# --- 4 · torch's own API by hand: PipelineStage, ScheduleGPipe, each rank's step (a 2-rank lab) ----

def _torch_step_on_rank(train_step, config, batch, n_microbatches) -> dict:
    from pplab.models.partition import build_stage
    from pplab.rank.rank_context import rank_context

    context = rank_context()
    module = build_stage(config, context.rank, context.world_size)
    tokens, targets = batch
    losses = train_step(module, context.rank, context.world_size, tokens, targets, n_microbatches)
    return {"losses": None if losses is None else [float(loss.detach()) for loss in losses],
            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}}


@_reported
def check_torch_step(lab, train_step, seed: int = 0) -> Verdict:
    """`train_step(module, rank, n_ranks, tokens, targets, n_microbatches)`: on every rank, wrap this
    rank's stage module in torch's `PipelineStage`, make a `ScheduleGPipe` with `loss_fn`, and call
    its `step` as each rank must (the inputs on the first rank, `target=` and `losses=` on the last,
    nothing between); return the losses on the last rank (None elsewhere). A batch that
    `n_microbatches` does not divide must be refused with a ValueError on every rank, before any
    rank steps. Judged against one device on a 2-rank lab."""
    from pplab.data import batches
    from pplab.models.llama import LlamaConfig
    from pplab.rank.reference import reference_step

    name = "torch's API by hand"
    if lab.world_size != 2:
        return _needs_two_ranks(name, lab)
    config = LlamaConfig.tiny()
    batch = next(batches(8, 16, seed=seed))
    ran = _run_on_lab(lab, name, _torch_step_on_rank, train_step, config, batch, 4)
    if isinstance(ran, Verdict):
        return _torch_hint(ran)
    reference = reference_step(config, batch, 4, seed=0)
    losses = ran[1]["losses"]
    if not losses:
        return Verdict(name, False, f"the last rank returned {losses!r}: torch puts each microbatch's loss into "
                                    f"the list given as step(target=..., losses=losses) on the last rank; "
                                    f"pass one and return it")
    mean = sum(losses) / len(losses)
    if len(losses) != 4 or abs(mean - reference.loss) > 1e-5 * abs(reference.loss):
        return Verdict(name, False, f"the last rank's {len(losses)} losses average {mean:.6f}; one device gets "
                                    f"{reference.loss:.6f} over 4 microbatches: use n_microbatches as given")
    for rank in (1, 0):
        for param, grad in ran[rank]["grads"].items():
            if grad is None:
                return Verdict(name, False, f"rank {rank}'s {param} got no gradient: ScheduleGPipe runs the "
                                            f"backward only with a loss: give it loss_fn=loss_fn")
            difference = (grad - reference.grads[param]).abs().max().item()
            if difference > 1e-5:
                return Verdict(name, False, f"rank {rank}'s {param} differs from one device by {difference:.2e}: "
                                            f"every rank must step the same batch, once")
    # Now a batch of 8 with 3 microbatches: torch would split it 3, 3, 2 and fail later, far from the cause.
    refused = _run_on_lab(lab, name, _torch_step_on_rank, train_step, config, batch, 3)
    # Refused on every rank before any step: a ValueError, and the process group intact (no restart).
    if not isinstance(refused, Verdict) or "raised ValueError" not in refused.message \
            or "restarted" in refused.message:
        return Verdict(name, False, "with n_microbatches=3 and a batch of 8, torch splits the batch 3, 3, 2 and "
                                    "fails later with 'Expected input batch_size (48) to match target batch_size "
                                    "(32)', or worse; check tokens.shape[0] % n_microbatches first and raise a "
                                    "ValueError naming both (on every rank, before any step)")
    return Verdict(name, True, f"the mean of the last rank's 4 losses ({mean:.6f}) and every gradient on both "
                               f"ranks equal one device's, and a batch that 3 microbatches do not divide is "
                               f"refused before any rank steps")


def _torch_hint(verdict: Verdict) -> Verdict:
    """The checker's verdict on a failed run, with what torch's own words there usually mean."""
    if "target required for last stage" in verdict.message:
        return Verdict(verdict.exercise, False, "the last rank stepped without its targets: torch's last stage "
                                                "computes the loss, so it takes step(target=targets, "
                                                "losses=losses); the first rank takes the inputs, step(tokens)\n"
                                                + verdict.message)
    return verdict

def _run_on_lab(lab, name: str, on_rank, learner_code, *args):
    """Run `on_rank(learner_code, *args)` on every rank, where the learner's function finds the
    names it uses as in the notebook; a failure (a deadlock's timeout among them) becomes a
    verdict naming the ranks, and the lab is restarted for the next try."""
    from pplab.drivers.cluster import LabError
    from pplab.drivers.cluster.gloo_adapter import gloo_transport_said

    if getattr(learner_code, "__code__", None) is None:
        return Verdict(name, False, f"give a function defined with def, not {type(learner_code).__name__}")
    if lab.device != "cpu":
        return Verdict(name, False, f"this exercise's tensors live on the CPU, but the lab runs on "
                                    f"{lab.device}: start it with pplab.Lab(n_ranks=2, device='cpu')")
    call = None
    try:
        imports, shared = _globals_used(learner_code)
        lab.run(_bind_on_rank, imports)
        if shared:
            lab.view.push(shared, block=True)
        call = lab.run_async(on_rank, learner_code, *args, timeout=lab.op_timeout + 60)
        return call.result()
    except LabError as error:
        if getattr(error, "ename", "") == "NotImplementedError":
            _restart_if_needed(lab)
            return Verdict(name, False, NOT_WRITTEN)
        # The first lines say who raised what, in the learner's function (not the checker's, on the
        # ranks); what every rank did with its messages follows, from what the ranks published.
        said = "\n".join(line.replace(f"{on_rank.__name__}()", f"your {learner_code.__name__}()")
                         for line in error.summary.splitlines()[:2] if line.strip())
        every_error = {rank: str(remote) for rank, remote in lab.last_errors.items()}
        # A deadlock only if every rank that failed, failed in gloo's transport (a wait that timed out, or
        # the pair its peer closed after timing out). A rank that raised anything else is the cause, and
        # its peers' timeouts follow from it: on a busy machine the grace after its error outlasts the
        # op_timeout, and those arrive too, in any order.
        deadlocked = (any("timed out" in text.lower() for text in every_error.values())
                      and all(gloo_transport_said(text) for text in every_error.values()))
        messages = _messages_of_every_rank(call, lab.world_size)
        if deadlocked:  # gloo's words for a receive that gave up, on every rank that failed
            said = f"a wait gave up after the lab's op_timeout of {lab.op_timeout:g} s" + \
                (f":\n{messages}" if messages else ".")
        elif messages:
            said += f"\nThe ranks' messages by then:\n{messages}"
        hint = ""
        if deadlocked:
            hint = ("\nIf both ranks receive first, neither sends: a deadlock; let one side send first. "
                    "If only one rank waited, its peer never sent what it expected: check each send's dst "
                    "and each receive's src, and that every message has its partner.")
        elif "NoneType" in said or " of None" in said:
            hint = ("\nSomething was None: a received activation has no .grad unless it requires grad "
                    "(x.requires_grad_()) before the stage runs on it.")
        restarted = _restart_if_needed(lab)
        return Verdict(name, False, f"{said}{hint}" + ("\n(The lab was restarted for your next try.)" if restarted else ""))


def _messages_of_every_rank(call, world_size: int) -> str:
    """'rank 0 sent nothing, and was waiting in dist.recv(src=1) of a [2, 16, 64] tensor\nrank 1 ...', from
    the last state each rank published (see _MessagesWatched); '' where no rank said anything."""
    if call is None:
        return ""
    try:
        call.wait_for_events(1.0)  # what a rank published just before it failed may trail its error
    except Exception:  # noqa: BLE001 - a call that never reached the ranks has nothing to wait for
        pass
    last = {event.rank: event.payload[1] for event in call.poll_events()
            if isinstance(event.payload, tuple) and event.payload[:1] == (MESSAGES,)}
    if not last:
        return ""
    return "\n".join(f"rank {rank} {last.get(rank, 'sent and received nothing')}"
                              for rank in range(world_size))


def _restart_if_needed(lab) -> bool:
    """Give the learner a working lab for the next try; True if it had to be restarted."""
    if lab.state == "running":
        return False
    # A restart takes seconds (the stuck ranks are killed, fresh ones join): say why the verdict waits.
    print("pplab: your code failed on the ranks; restarting the lab for your next try, the verdict follows ...",
          flush=True)
    lab.restart()
    return True


def _globals_used(function) -> tuple[dict[str, tuple[str, str | None]], dict]:
    """The global names a notebook function uses: those an engine can import (modules, and what
    importable modules define: name -> (module, attribute or None)), and the notebook's own
    values and functions (sent as they are; a function with what it uses in turn)."""
    imports, functions, todo = {}, {}, [function]
    while todo:
        current = todo.pop()
        for name in _names_in(current.__code__):
            value = current.__globals__.get(name)
            if value is None or name in imports or name in functions:
                continue
            if isinstance(value, types.ModuleType):
                imports[name] = (value.__name__, None)
            elif isinstance(value, types.FunctionType) and value.__module__ == "__main__":
                functions[name] = value
                todo.append(value)
            elif getattr(value, "__module__", "__main__") != "__main__" and \
                    getattr(value, "__qualname__", "").isidentifier():
                imports[name] = (value.__module__, value.__qualname__)
            else:  # a value of the notebook's (a number, a config, a tensor): sent by pickling
                functions[name] = value
    return imports, functions


def _names_in(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):  # nested functions, comprehensions
            names |= _names_in(constant)
    return names


def _bind_on_rank(imports: dict[str, tuple[str, str | None]]) -> None:
    """Import, into the engine's namespace (where a sent function looks up its globals), what
    the learner's function uses."""
    import importlib

    from IPython import get_ipython

    namespace = get_ipython().user_ns
    for name, (module, attribute) in imports.items():
        value = importlib.import_module(module)
        namespace[name] = value if attribute is None else getattr(value, attribute)


# --- 4 · a schedule by hand (a lab) ------------------------------------------------------------------

@_reported
def check_schedule(lab, lines, n_microbatches: int = 4, max_in_flight: int | None = None) -> Verdict:
    """A schedule written as one line of actions per rank ("0F0 0F1 0B0 ..."): it must name every
    microbatch, hold at most `max_in_flight` activations on a rank, never deadlock, and match
    one device when run on the lab."""
    from pplab.models.llama import LlamaConfig
    from pplab.schedules import ScheduleError, from_text, peak_inflight_at, validate

    name = "a schedule by hand"
    if lines is None or lines is ... or (isinstance(lines, (list, tuple)) and ... in lines):
        return Verdict(name, False, NOT_WRITTEN.replace("`raise NotImplementedError`", "the `...`"))
    if not isinstance(lines, (list, tuple)) or not all(isinstance(line, str) for line in lines):
        return Verdict(name, False, f"give a list with one string per rank, e.g. [\"0F0 0F1 0B0 ...\", "
                                    f"\"1F0 1B0 ...\"], not {type(lines).__name__}")
    try:
        schedule = from_text(list(lines), name="yours")
        validate(schedule)
    except (ScheduleError, ValueError) as error:
        return Verdict(name, False, str(error))
    if schedule.n_ranks != lab.world_size or schedule.n_microbatches != n_microbatches:
        return Verdict(name, False, f"your schedule has {schedule.n_ranks} rank(s) and {schedule.n_microbatches} "
                                    f"microbatch(es); this exercise wants {lab.world_size} and {n_microbatches}")
    if max_in_flight is not None:
        for rank, (peak, at) in enumerate(peak_inflight_at(schedule)):
            if peak > max_in_flight:
                return Verdict(name, False, f"rank {rank} holds the activations of {peak} microbatches at once "
                                            f"(after {at}); the limit is {max_in_flight}: run a backward sooner")
    from pplab.drivers.cluster import LabError

    try:
        pipe = lab.pipeline(LlamaConfig.tiny(), schedule=schedule)
        try:
            report = pipe.check_parity()
        finally:
            pipe.close()
    except LabError as error:
        restarted = _restart_if_needed(lab)
        return Verdict(name, False, error.summary
                       + ("\n(The lab was restarted for your next try.)" if restarted else ""))
    if not report.passed:
        return Verdict(name, False, f"it ran, but differs from one device:\n{report}")
    return Verdict(name, True, f"valid, within the memory limit, and it ran on {lab.world_size} ranks with "
                               f"exactly the single-device gradients (loss {report.loss:.6f})")


# --- 5 · global-norm clipping (a 2-rank lab) ----------------------------------------------------------

def _clip_on_rank(clip_global_norm, config, batch, max_norm: float) -> dict:
    from pplab.rank.rank_context import rank_context
    from pplab.models.partition import build_stage
    from pplab.rank.reference import reference_step

    context = rank_context()
    stage = build_stage(config, context.rank, context.world_size)
    reference = reference_step(config, batch, 1)  # every rank's gradients as one device has them
    for param_name, param in stage.named_parameters():
        param.grad = reference.grads[param_name].clone()
    returned = clip_global_norm(list(stage.parameters()), max_norm)
    return {"norm": None if returned is None else float(returned),
            "grads": {n: p.grad.clone() for n, p in stage.named_parameters()},
            "before": {n: reference.grads[n] for n, _ in stage.named_parameters()}}


@_reported
def check_clipping(lab, clip_global_norm, seed: int = 0) -> Verdict:
    """`clip_global_norm(parameters, max_norm)` runs on every rank with that rank's stage
    parameters, scales their gradients so that the norm of all stages' gradients together is at
    most `max_norm`, and returns that global norm (before clipping). Judged against
    torch.nn.utils.clip_grad_norm_ on the whole model, on one device."""
    import torch

    from pplab.data import batches
    from pplab.models.llama import LlamaConfig
    from pplab.rank.reference import reference_step

    name = "global-norm clipping"
    config = LlamaConfig.tiny()
    batch = next(batches(2, 16, seed=seed))
    grads = reference_step(config, batch, 1).grads
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])).item()
    for max_norm in (total / 2, total * 2):  # one try that must clip, one that must leave all as is
        ran = _run_on_lab(lab, name, _clip_on_rank, clip_global_norm, config, batch, max_norm)
        if isinstance(ran, Verdict):
            return ran
        wrong = _judge_clipping(name, ran, total, max_norm)
        if wrong is not None:
            return wrong
    factor = (total / 2) / (total + 1e-6)
    return Verdict(name, True, f"both ranks returned the global norm {total:.6f}, scaled every gradient by "
                               f"{factor:.3f} when max_norm was half of it and left them as they were when it "
                               f"was twice it, as clip_grad_norm_ does on the whole model")


def _judge_clipping(name: str, ran: list[dict], total: float, max_norm: float) -> Verdict | None:
    """What is wrong with one try of the learner's clipping (None: nothing)."""
    import torch

    factor = min(1.0, max_norm / (total + 1e-6))  # what clip_grad_norm_ scales by
    factors = []
    for rank, result in enumerate(ran):
        scale = [(result["grads"][n] * result["before"][n]).sum().item() / (result["before"][n] ** 2).sum().item()
                 for n in result["grads"]]
        factors.append(sum(scale) / len(scale))
        norm = result["norm"]
        if norm is None or abs(norm - total) > 1e-4 * total:
            if norm is not None and abs(norm - max_norm) <= 1e-4 * max_norm:
                hint = " (you returned the norm after clipping: return the one before)"
            elif norm is not None and norm < total:
                hint = (" (the norm of this rank's own gradients: sum the squares on every rank, all_reduce "
                        "them, then take the square root)")
            else:
                hint = ""
            returned = "None" if norm is None else f"{norm:.6f}"
            return Verdict(name, False, f"rank {rank} returned the norm {returned}, but the norm of all "
                                        f"stages' gradients is {total:.6f}{hint}")
    for rank, result in enumerate(ran):
        for param_name, grad in result["grads"].items():
            if not torch.allclose(grad, result["before"][param_name] * factor, rtol=1e-5, atol=1e-8):
                scales = ", ".join(f"rank {r} by {f:.3f}" for r, f in enumerate(factors))
                if factor == 1.0:
                    return Verdict(name, False, f"with max_norm={max_norm:.3f} above the global norm {total:.3f} "
                                                f"nothing may change, but the gradients were scaled {scales}: "
                                                f"scale by min(1, max_norm / norm)")
                return Verdict(name, False, f"the gradients were scaled {scales}; every rank must scale by "
                                            f"max_norm / global norm = {factor:.3f} (first wrong: rank {rank}'s "
                                            f"{param_name}). Clipping each stage by its own norm scales the "
                                            f"stages differently and changes the update's direction")
    return None


# --- 6 · a layout for a model family pplab does not know (pure: the stages chained in-process) ---------

@_reported
def check_layout(layout, directory) -> Verdict:
    """`layout`, a `pplab.hf.Layout`, must say where the model saved in `directory` keeps its parts,
    so that its stages, cut two ways and chained in this process, compute exactly what the whole
    `transformers` model computes on one device: the loss and every parameter's gradient."""
    import torch

    from pplab.models.hf import HFModel, Layout
    from pplab.rank.checks import compare_with_reference
    from pplab.rank.reference import reference_step

    name = "a layout for your own model"
    if layout is None or layout is ... or (isinstance(layout, Layout) and ... in vars(layout).values()):
        return Verdict(name, False, NOT_WRITTEN.replace("`raise NotImplementedError`", "each `...`"))
    if not isinstance(layout, Layout):
        return Verdict(name, False, f"give a pplab.hf.Layout(embed=..., blocks=..., norm=..., head=..., ...), "
                                    f"not a {type(layout).__name__}")
    try:
        model = HFModel.of(directory, layout=layout)
    except ValueError as error:
        return Verdict(name, False, f"pplab refused it: {error}")
    wrong_place = _parts_inside_blocks(layout)
    if wrong_place:
        role, path = wrong_place
        return Verdict(name, False, f"{role}={path!r} lies inside a decoder block: the blocks run whole on their "
                                    f"stages. Name the {role} that sits beside the blocks, not one of theirs")
    left_out = _parts_left_out(model)
    if left_out:
        path, kind = left_out[0]
        return Verdict(name, False, f"{path} ({kind}) is in no part of your layout, so no stage would run it (it "
                                    f"holds no parameters, so nothing else says so). It is {_role_of(kind)}")
    generator = torch.Generator().manual_seed(0)  # the learner's own random state stays as it was
    batch = tuple(torch.randint(0, model.vocab_size, (2, 2, 16), generator=generator))
    reference = reference_step(model, batch, 1)  # the whole transformers model, on one device
    n = model.num_hidden_layers
    for cut in ([range(0, n // 2), range(n // 2, n)], [range(0, 1), range(1, n - 1), range(n - 1, n)]):
        try:
            loss, grads = _chained_stages(model, cut, *batch)
        except Exception as error:  # noqa: BLE001 - what the learner's layout made the stages raise
            return _raised(name, error, _layout_hint(error))
        where = f"cut into stages of {', '.join(f'blocks {r.start}-{r.stop - 1}' for r in cut)}"
        report = compare_with_reference(loss, grads, reference, grad_atol=1e-7)
        if report.loss_rel_diff > report.loss_rtol:
            return Verdict(name, False, f"{where}: the loss is {loss:.6f}, the whole model's {reference.loss:.6f}")
        if not report.passed:
            return Verdict(name, False, f"{where}: the gradient of {(report.missing + report.failing)[0]} differs "
                                        f"from the whole model's")
    return Verdict(name, True, f"cut in two and in three, the stages give the whole model's loss "
                               f"({reference.loss:.6f}) and every one of its {len(reference.grads)} parameters' "
                               f"gradients: lab.pipeline(pplab.hf.HFModel.of(directory, layout=...)) will pipeline it")


def _parts_inside_blocks(layout) -> tuple[str, str] | None:
    """(role, path) of a part the layout puts inside the blocks, where only whole blocks belong."""
    for role, path in layout.parts().items():
        if role != "blocks" and path.startswith(layout.blocks + "."):
            return role, path
    return None


def _parts_left_out(model) -> list[tuple[str, str]]:
    """(path, class name) of the modules beside the blocks (in the module that holds them) and at the
    top of the causal LM that the layout names nowhere: each runs in the model's forward."""
    layout = model.layout_
    named = set(layout.parts().values())
    body = layout.blocks.rsplit(".", 1)[0] if "." in layout.blocks else ""
    beside = {body, ""}  # the module holding the blocks, and the causal LM itself
    left_out = []
    for path, module in model.meta_model().named_modules():
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        if path and parent in beside and path not in named | {body}:
            left_out.append((path, type(module).__name__))
    return left_out


def _role_of(kind: str) -> str:
    """What a weightless module the layout left out is for, by its class name."""
    if "Rotary" in kind:
        return "the rotary position embeddings: `rotary=`; pplab computes them on every stage that has blocks"
    if "Dropout" in kind:
        return ("a dropout after the embeddings: `dropout=`; in training the first stage must run it where the "
                "whole model does")
    return "a part of the model's forward: give it its role in the layout"


def _chained_stages(model, cut, tokens, targets) -> tuple[float, dict]:
    """The stages of `cut` (block ranges) built and run one after the other in this process, each
    backward fed with the gradient of the next stage's input: (loss, gradients by name)."""
    from pplab.models.llama import loss_fn

    stages = [model.build_stage(blocks, embed=i == 0, head=i == len(cut) - 1) for i, blocks in enumerate(cut)]
    inputs, outputs, x = [], [], tokens
    for stage in stages:
        inputs.append(x)
        x = stage(x)
        outputs.append(x)
        if not stage.is_last:
            x = x.detach().requires_grad_()
    loss = loss_fn(outputs[-1], targets)
    loss.backward()
    for i in range(len(stages) - 2, -1, -1):
        outputs[i].backward(inputs[i + 1].grad)
    grads = {name: param.grad for stage in stages for name, param in stage.named_parameters()
             if param.grad is not None}
    for first, last in model.tied:  # one weight on one device: each stage's copy has half its gradient
        if first in grads and last in grads:
            grads[first] = grads[last] = grads[first] + grads[last]
    return loss.item(), grads


def _layout_hint(error: BaseException) -> str:
    if "position_ids" in str(error):
        return ("`positions=` is for learned position embeddings added once, on the first stage (GPT-2's wpe); "
                "rotary ones are computed for the blocks on every stage: `rotary=`")
    return "read the model's outline (print(model) or the refusal's list of modules) for each part's path"


# --- 7 · text packed into training sequences (pure) ------------------------------------------------

@_reported
def check_packing(pack_documents) -> Verdict:
    """`pack_documents(token_lists, seq_len, bos, eos)` -> (inputs, targets), each [sequences, seq_len]:
    the documents' token ids joined as `<bos> ids <eos>` one after another and cut into training
    sequences the way `pplab.text.PackedText` cuts them (`join_documents`, then `cut_sequences`)."""
    import random

    from pplab.data.text import cut_sequences, join_documents

    name = "text packed into sequences"
    rng = random.Random(0)
    bos, eos = 1, 2
    cases = [([[5, 6, 7], [8, 9], [10, 11, 12, 13]], 4)]
    cases += [([[rng.randrange(3, 60) for _ in range(rng.randrange(0, 30))] for _ in range(rng.randrange(1, 6))],
               seq_len) for seq_len in (3, 8, 16) for _ in range(4)]
    for token_lists, seq_len in cases:
        windows = cut_sequences(join_documents(token_lists, bos, eos), seq_len)
        expected = (windows[:, :-1].tolist(), windows[:, 1:].tolist())
        try:
            returned = pack_documents([list(ids) for ids in token_lists], seq_len, bos, eos)
        except Exception as error:  # noqa: BLE001 - whatever the learner's code raised
            return _raised(name, error)
        given = _rows_pair(returned)
        if given != expected:
            case = f"token_lists={token_lists}, seq_len={seq_len}, bos={bos}, eos={eos}"
            hint = _packing_hint(returned, given, expected, token_lists, seq_len, bos, eos)
            return Verdict(name, False, f"{case}:\n{hint}")
    return Verdict(name, True, f"all {len(cases)} cases packed as pplab packs them: <bos> ids <eos> per document, "
                               f"windows of seq_len + 1 sharing one token, targets one ahead, the tail dropped")


def _rows_pair(returned) -> tuple[list, list] | None:
    """The learner's (inputs, targets) as two lists of rows of ints (tensors and arrays too); None if
    it is not a pair of such."""
    def rows(part):
        part = part.tolist() if hasattr(part, "tolist") else part
        if not isinstance(part, (list, tuple)) or not all(isinstance(row, (list, tuple)) for row in part):
            raise TypeError
        return [[int(token) for token in row] for row in part]

    try:
        inputs, targets = returned
        return rows(inputs), rows(targets)
    except (TypeError, ValueError):
        return None


def _packing_hint(returned, given, expected, token_lists, seq_len: int, bos: int, eos: int) -> str:
    """What the learner's packing most likely did (known mistakes, tried in turn)."""
    import torch

    from pplab.data.text import cut_sequences, join_documents

    if given is None:
        return (f"return a pair (inputs, targets), each a list of rows (or a tensor [rows, seq_len]); "
                f"you returned {type(returned).__name__}")
    inputs, targets = expected
    lengths = {len(row) for part in given for row in part}
    if lengths - {seq_len}:
        short = " (keep whole windows only: the short tail is dropped)" if max(lengths) == seq_len else ""
        return f"every row must be seq_len = {seq_len} tokens long; yours are {sorted(lengths)} long{short}"
    if given[0] == inputs and given[1] == inputs:
        return ("the targets are the inputs themselves: each position must predict the NEXT token, so targets "
                "are the window shifted by one (window[1:]) and inputs window[:-1]")
    bare = cut_sequences(torch.tensor([t for ids in token_lists for t in ids], dtype=torch.int64), seq_len)
    if given == (bare[:, :-1].tolist(), bare[:, 1:].tolist()):
        return ("the documents run into each other: join each as <bos> ids <eos>, so that the model learns where a "
                "document starts and ends instead of continuing one into the next")
    stream = join_documents(token_lists, bos, eos).tolist()
    apart = [stream[i:i + seq_len + 1] for i in range(0, len(stream) - seq_len, seq_len + 1)]
    if given == ([w[:-1] for w in apart], [w[1:] for w in apart]):
        return ("your windows do not overlap: each window is seq_len + 1 tokens, and the next starts seq_len tokens "
                "later, at its last token. Without that the pair across each cut is never learned")
    if len(given[0]) == len(inputs) + 1 and given[0][:-1] == inputs and given[1][:-1] == targets:
        return ("the last, partial window is dropped, not padded: pad tokens would be learned as text (or need a "
                "loss mask) and cost compute")
    return (f"you made {len(given[0])} rows; expected {len(inputs)}:\n"
            f"expected inputs  {inputs}\nexpected targets {targets}")


# --- 8 · a rank's idle share, read from a trace (pure) ----------------------------------------------

@_reported
def check_idle_share(idle_share, *timelines) -> Verdict:
    """`idle_share(timeline, rank)`: the fraction of the step (first start to last end over every rank)
    that `rank` spent not computing, a receive's wait counting as idle. Judged against
    `Timeline.bubble_fraction(rank)` on the timelines given (read from traces) and on simulated ones
    (uneven stages, message latency, split backwards)."""
    from pplab.schedules import build
    from pplab.planning.simulator import Costs, simulate

    name = "a rank's idle share from a trace"
    given_ones = [(timeline, f"your timeline {i + 1}") for i, timeline in enumerate(timelines)]
    simulated = [(simulate(build(schedule, 3, 4), Costs(forward=[1.0, 2.0, 1.0], backward=[2.0, 3.0, 2.5],
                                                         latency=latency)),
                  f"{schedule} simulated on 3 uneven stages with latency {latency}")
                 for schedule in ("gpipe", "1f1b", "zb-h1") for latency in (0.0, 0.4)]
    for timeline, which in given_ones + simulated:
        for rank in range(timeline.n_ranks):
            expected = timeline.bubble_fraction(rank)
            try:
                given = idle_share(timeline, rank)
            except Exception as error:  # noqa: BLE001 - whatever the learner's code raised
                return _raised(name, error)
            if not _close(_as_number(given), expected):
                return Verdict(name, False, f"{which}, rank {rank}: you said {given!r}, it is {expected:.6g}.\n"
                                            f"{_idle_hint(timeline, rank, _as_number(given))}")
    return Verdict(name, True, f"every rank of {len(timelines)} timeline(s) read from traces and {len(simulated)} "
                               f"simulated ones: your idle shares are the timelines' own bubble fractions")


def _idle_hint(timeline, rank: int, given: float | None) -> str:
    """What the learner's number most likely measured instead (known mistakes, tried in turn)."""
    if given is None:
        return "return the share as a number between 0 and 1"
    step, busy = timeline.step_time(), timeline.busy_time(rank)
    compute = timeline.compute_events(rank)
    own = max(e.end for e in compute) - min(e.start for e in compute) if compute else 0.0
    tries = [
        (1 - timeline.active_time(rank) / step if step else 0.0,
         "a rank waiting in a receive is idle, not busy: count only compute (F, B, I, W, ...), not sends and receives"),
        (1 - busy / own if own else 0.0,
         "measure against the whole step, from the first rank's start to the last rank's end: the time a rank waits "
         "before its first action (the fill) and after its last (the drain) is its bubble too"),
        (busy / step if step else 0.0, "that is the share it computed: the idle share is 1 minus it"),
        (step - busy, "that is in seconds: divide by the step time"),
    ]
    for wrong, hint in tries:
        if _close(given, wrong):
            return hint
    return "idle = the step time minus the time covered by the rank's compute events, over the step time"


# --- 9 · a mesh's groups (pure) ------------------------------------------------------------------------

@_reported
def check_mesh_groups(mesh_groups) -> Verdict:
    """`mesh_groups(rank, pp, dp, tp)` -> {"pp": [...], "dp": [...], "tp": [...]}: the global ranks (the
    rank itself included, ascending) of `rank`'s pipeline, FSDP group and TP group, on a mesh of those
    sizes laid out as `pplab.Mesh` lays it out. Judged on every rank of meshes up to 3 x 3 x 3."""
    from itertools import product

    from pplab.rank.mesh import Mesh

    name = "a mesh's groups"
    sizes = [(2, 2, 2)] + [size for size in product((1, 2, 3), repeat=3) if size != (2, 2, 2)]  # a typical one first
    for pp, dp, tp in sizes:
        mesh = Mesh(pp=pp, dp=dp, tp=tp)
        for rank in range(mesh.world_size):
            expected = _groups_of(mesh, rank)
            try:
                returned = mesh_groups(rank, pp, dp, tp)
            except Exception as error:  # noqa: BLE001 - whatever the learner's code raised
                return _raised(name, error)
            given = _as_groups(returned)
            if given != expected:
                case = f"rank {rank} of a mesh pp={pp} x dp={dp} x tp={tp}"
                return Verdict(name, False, f"{case}: you said {returned!r}, expected {expected}.\n"
                                            f"{_groups_hint(given, expected, rank, mesh)}")
    return Verdict(name, True, f"every rank of {len(sizes)} meshes up to 3 x 3 x 3: its pipeline, FSDP group and "
                               f"TP group are the ones pplab.Mesh builds")


def _groups_of(mesh, rank: int) -> dict[str, list[int]]:
    """The ranks sharing all of `rank`'s coordinates but one, for each dimension: its groups."""
    where = mesh.coordinates(rank)
    return {dim: [mesh.rank_of(**{**where, dim: i}) for i in range(size)] for dim, size in mesh.sizes.items()}


def _as_groups(returned) -> dict[str, list[int]] | None:
    """The learner's answer as {dimension: ascending ranks}; None if it is not such a mapping."""
    try:
        return {dim: sorted(int(r) for r in returned[dim]) for dim in ("pp", "dp", "tp")}
    except (TypeError, KeyError, ValueError):
        return None


def _groups_hint(given, expected, rank: int, mesh) -> str:
    """What the learner's groups most likely got wrong (known mistakes, tried in turn)."""
    from pplab.rank.mesh import Mesh

    if given is None:
        return 'return a dict with the keys "pp", "dp" and "tp", each a list of global ranks'
    if any(rank not in ranks for ranks in given.values()):
        return "a group includes the rank itself: its pipeline, for example, is every stage, its own among them"
    reversed_layout = Mesh(pp=mesh.tp, dp=mesh.dp, tp=mesh.pp)  # pp varying fastest instead of tp
    swapped = _groups_of(reversed_layout, rank)
    if given == {"pp": swapped["tp"], "dp": swapped["dp"], "tp": swapped["pp"]}:
        return ("the layout is row-major over (pp, dp, tp): tp varies fastest, so a TP group is neighbouring "
                "ranks (one host's fastest links), and pp slowest, so a pipeline's stages are far apart")
    wrong = [dim for dim in ("pp", "dp", "tp") if given[dim] != expected[dim]]
    stride = {"pp": mesh.dp * mesh.tp, "dp": mesh.tp, "tp": 1}
    return (f"your {' and '.join(wrong)} group{'s are' if len(wrong) > 1 else ' is'} off. Along each dimension "
            f"the ranks of a group are a fixed stride apart: {stride['pp']} for pp (dp x tp), {stride['dp']} for dp "
            f"(tp), 1 for tp")
