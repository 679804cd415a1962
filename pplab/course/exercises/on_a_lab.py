"""The checkers that run the learner's code on a lab's ranks (messages, torch's API, a schedule,
clipping): a deadlock ends within the lab's op_timeout, and the checker restarts the lab for the
next try."""

from __future__ import annotations

import types

from pplab.course.exercises.verdicts import NOT_WRITTEN, Verdict, needs_two_ranks, reported

# --- send and receive, with gradients (a 2-rank lab) ------------------------------------------

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
        doing = ("returned" if finished
                 else f"was waiting in {waiting}" if waiting else "was past its last message")
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
    from pplab.models.partition import build_stage
    from pplab.rank.rank_context import rank_context

    rank = rank_context().rank
    stage = build_stage(config, rank, 2)
    tokens, targets = batch
    with _MessagesWatched():
        loss = forward_backward(stage, rank, tokens, targets)
    return {"loss": None if loss is None else float(loss),
            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in stage.named_parameters()}}


@reported
def check_send_recv(lab, forward_backward, seed: int = 0) -> Verdict:
    """`forward_backward(stage, rank, tokens, targets)`: rank 0 runs stage 0 and sends its output,
    rank 1 receives it, runs stage 1 and the loss, and sends back the gradient of what it
    received, with which rank 0 runs its backward. Judged against one device, on a 2-rank lab."""
    from pplab.data import batches
    from pplab.models.llama import LlamaConfig
    from pplab.rank.reference import reference_step

    name = "send and receive, with gradients"
    if lab.world_size != 2:
        return needs_two_ranks(name, lab)
    config = LlamaConfig.tiny()
    batch = next(batches(2, 16, seed=seed))
    ran = _run_on_lab(lab, name, _forward_backward_on_rank, forward_backward, config, batch)
    if isinstance(ran, Verdict):
        return ran
    reference = reference_step(config, batch, 1, seed=0)
    loss = ran[1]["loss"]
    if loss is None or abs(loss - reference.loss) > 1e-5 * abs(reference.loss):
        return Verdict(name, False, f"rank 1 returned the loss {loss!r}, one device gets "
                                    f"{reference.loss:.6f}: rank 1 must return loss_fn(stage(x), targets)")
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
                return Verdict(name, False, f"rank {rank}'s {param} differs from one device by "
                                            f"{difference:.2e}: {why}")
    return Verdict(name, True, f"loss {loss:.6f} and every gradient on both ranks equal one device's")



# --- torch's own API by hand: PipelineStage, ScheduleGPipe, each rank's step (a 2-rank lab) ----

def _torch_step_on_rank(train_step, config, batch, n_microbatches) -> dict:
    from pplab.models.partition import build_stage
    from pplab.rank.rank_context import rank_context

    context = rank_context()
    module = build_stage(config, context.rank, context.world_size)
    tokens, targets = batch
    losses = train_step(module, context.rank, context.world_size, tokens, targets, n_microbatches)
    return {"losses": None if losses is None else [float(loss.detach()) for loss in losses],
            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}}


@reported
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
        return needs_two_ranks(name, lab)
    config = LlamaConfig.tiny()
    batch = next(batches(8, 16, seed=seed))
    ran = _run_on_lab(lab, name, _torch_step_on_rank, train_step, config, batch, 4)
    if isinstance(ran, Verdict):
        return _torch_hint(ran)
    reference = reference_step(config, batch, 4, seed=0)
    losses = ran[1]["losses"]
    if not losses:
        return Verdict(name, False, f"the last rank returned {losses!r}: torch puts each microbatch's loss "
                                    "into the list given as step(target=..., losses=losses) on the last "
                                    "rank; pass one and return it")
    mean = sum(losses) / len(losses)
    if len(losses) != 4 or abs(mean - reference.loss) > 1e-5 * abs(reference.loss):
        return Verdict(name, False, f"the last rank's {len(losses)} losses average {mean:.6f}; one "
                                    f"device gets {reference.loss:.6f} over 4 microbatches: use "
                                    "n_microbatches as given")
    for rank in (1, 0):
        for param, grad in ran[rank]["grads"].items():
            if grad is None:
                return Verdict(name, False, f"rank {rank}'s {param} got no gradient: ScheduleGPipe runs the "
                                            f"backward only with a loss: give it loss_fn=loss_fn")
            difference = (grad - reference.grads[param]).abs().max().item()
            if difference > 1e-5:
                return Verdict(name, False, f"rank {rank}'s {param} differs from one device by "
                                            f"{difference:.2e}: every rank must step the same batch, once")
    # Now a batch of 8 with 3 microbatches: torch would split it 3, 3, 2 and fail later, far from the cause.
    refused = _run_on_lab(lab, name, _torch_step_on_rank, train_step, config, batch, 3)
    # Refused on every rank before any step: a ValueError, and the process group intact (no restart).
    if not isinstance(refused, Verdict) or "raised ValueError" not in refused.message \
            or "restarted" in refused.message:
        return Verdict(name, False, "with n_microbatches=3 and a batch of 8, torch splits the batch 3, "
                                    "3, 2 and fails later with 'Expected input batch_size (48) to match "
                                    "target batch_size (32)', or worse; check tokens.shape[0] % "
                                    "n_microbatches first and raise a ValueError naming both (on every "
                                    "rank, before any step)")
    return Verdict(name, True, f"the mean of the last rank's 4 losses ({mean:.6f}) and every gradient on "
                               "both ranks equal one device's, and a batch that 3 microbatches do not "
                               "divide is refused before any rank steps")


def _torch_hint(verdict: Verdict) -> Verdict:
    """The checker's verdict on a failed run, with what torch's own words there usually mean."""
    if "target required for last stage" in verdict.message:
        return Verdict(verdict.exercise, False, "the last rank stepped without its targets: torch's "
                                                "last stage computes the loss, so it takes "
                                                "step(target=targets, losses=losses); the first rank "
                                                "takes the inputs, step(tokens)\n"
                                                + verdict.message)
    return verdict

def _run_on_lab(lab, name: str, on_rank, learner_code, *args):
    """Run `on_rank(learner_code, *args)` on every rank, where the learner's function finds the
    names it uses as in the notebook; a failure (a deadlock's timeout among them) becomes a
    verdict naming the ranks, and the lab is restarted for the next try."""
    from pplab.drivers.cluster.gloo_adapter import gloo_transport_said
    from pplab.rank.rank_context import RankError

    if getattr(learner_code, "__code__", None) is None:
        return Verdict(name, False, f"give a function defined with def, not {type(learner_code).__name__}")
    if lab.device != "cpu":
        return Verdict(name, False, f"this exercise's tensors live on the CPU, but the lab runs on "
                                    f"{lab.device}: start it with pplab.Lab(n_ranks=2, device='cpu')")
    if lab.state == "stopped":  # the notebook's last cell stops it: a check run after Run All finds it so
        return Verdict(name, False, "this lab is stopped (the notebook's last cell stops it): re-run the "
                                    "cell that starts it (lab = pplab.Lab(...)), then this check")
    call = None
    try:
        imports, shared = _globals_used(learner_code)
        lab.run(_bind_on_rank, imports)
        if shared:
            lab.view.push(shared, block=True)
        call = lab.run_async(on_rank, learner_code, *args, timeout=lab.op_timeout + 60)
        return call.result()
    except RankError as error:
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
        return Verdict(name, False, f"{said}{hint}" + ("\n(The lab was restarted for your next "
                                                       "try.)" if restarted else ""))


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
    print("pplab: your code failed on the ranks; restarting the lab for your next try, "
          "the verdict follows ...",
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


# --- a schedule by hand (a lab) ------------------------------------------------------------------

@reported
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
        return Verdict(name, False, f"your schedule has {schedule.n_ranks} rank(s) and "
                                    f"{schedule.n_microbatches} microbatch(es); this exercise wants "
                                    f"{lab.world_size} and {n_microbatches}")
    if max_in_flight is not None:
        for rank, (peak, at) in enumerate(peak_inflight_at(schedule)):
            if peak > max_in_flight:
                return Verdict(name, False, f"rank {rank} holds the activations of {peak} "
                                            f"microbatches at once (after {at}); the limit is "
                                            f"{max_in_flight}: run a backward sooner")
    from pplab.rank.rank_context import RankError

    try:
        pipe = lab.pipeline(LlamaConfig.tiny(), schedule=schedule)
        try:
            report = pipe.check_parity()
        finally:
            pipe.close()
    except RankError as error:
        restarted = _restart_if_needed(lab)
        return Verdict(name, False, error.summary
                       + ("\n(The lab was restarted for your next try.)" if restarted else ""))
    if not report.passed:
        return Verdict(name, False, f"it ran, but differs from one device:\n{report}")
    return Verdict(name, True, f"valid, within the memory limit, and it ran on {lab.world_size} ranks with "
                               f"exactly the single-device gradients (loss {report.loss:.6f})")


# --- global-norm clipping (a 2-rank lab) ----------------------------------------------------------

def _clip_on_rank(clip_global_norm, config, batch, max_norm: float) -> dict:
    from pplab.models.partition import build_stage
    from pplab.rank.rank_context import rank_context
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


@reported
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
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                  for g in grads.values()])).item()
    for max_norm in (total / 2, total * 2):  # one try that must clip, one that must leave all as is
        ran = _run_on_lab(lab, name, _clip_on_rank, clip_global_norm, config, batch, max_norm)
        if isinstance(ran, Verdict):
            return ran
        wrong = _judge_clipping(name, ran, total, max_norm)
        if wrong is not None:
            return wrong
    factor = (total / 2) / (total + 1e-6)
    return Verdict(name, True, f"both ranks returned the global norm {total:.6f}, scaled every gradient by "
                               f"{factor:.3f} when max_norm was half of it and left them as they were when "
                               "it was twice it, as clip_grad_norm_ does on the whole model")


def _judge_clipping(name: str, ran: list[dict], total: float, max_norm: float) -> Verdict | None:
    """What is wrong with one try of the learner's clipping (None: nothing)."""
    import torch

    factor = min(1.0, max_norm / (total + 1e-6))  # what clip_grad_norm_ scales by
    factors = []
    for rank, result in enumerate(ran):
        scale = [(result["grads"][n] * result["before"][n]).sum().item()
                 / (result["before"][n] ** 2).sum().item() for n in result["grads"]]
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
                    return Verdict(name, False, f"with max_norm={max_norm:.3f} above the global norm "
                                                f"{total:.3f} nothing may change, but the gradients were "
                                                f"scaled {scales}: scale by min(1, max_norm / norm)")
                return Verdict(name, False, f"the gradients were scaled {scales}; every rank must "
                                            f"scale by max_norm / global norm = {factor:.3f} (first "
                                            f"wrong: rank {rank}'s {param_name}). Clipping each "
                                            "stage by its own norm scales the stages differently "
                                            "and changes the update's direction")
    return None
