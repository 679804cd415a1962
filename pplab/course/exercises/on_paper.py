"""The checkers that need no ranks: the learner's function is called in this process (a schedule's
arithmetic, a stage's forward, a model's layout, packed text, a trace, a mesh's groups)."""

from __future__ import annotations

from pathlib import Path

from pplab.course.exercises.verdicts import (
    NOT_WRITTEN,
    Verdict,
    as_number,
    close_to,
    learner_raised,
    reported,
)

# --- the 1F1B warm-up (pure) ----------------------------------------------------------------

@reported
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
                    return learner_raised(name, error)
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
        why = ("one too many: the first forward of the steady phase is not warm-up (it is paired with a "
               "backward)")
    else:
        why = ("the last rank gets its gradient at once; each rank before it must keep one more "
               "microbatch going while the first one travels to the end and back")
    return f"{case}.\n{why}."


# --- a GPipe step's time from per-stage costs (pure) ---------------------------------------------

@reported
def check_gpipe_time(gpipe_step_time, max_ranks: int = 5, max_microbatches: int = 8) -> Verdict:
    """`gpipe_step_time(forward, backward, n_microbatches, latency)`: the step time of GPipe with one
    stage per rank, `forward[s]` and `backward[s]` the seconds of stage s per microbatch, `latency`
    the seconds of each hop. Judged against pplab's simulator on uneven stages, with and without latency."""
    import random

    from pplab.planning.simulator import Costs, simulate
    from pplab.schedules import build

    name = "a GPipe step's time"
    rng = random.Random(0)
    cases = [([1.0] * p, [2.0] * p, m, 0.0) for p in (1, 2, 4) for m in (1, 4)]  # even stages first
    cases += [([round(rng.uniform(0.5, 3), 1) for _ in range(p)],
               [round(rng.uniform(1, 5), 1) for _ in range(p)],
               m, latency)
              for p in range(2, max_ranks + 1) for m in (1, 3, max_microbatches) for latency in (0.0, 0.5)]
    for forward, backward, m, latency in cases:
        expected = simulate(build("gpipe", len(forward), m),
                            Costs(forward=forward, backward=backward, latency=latency)).step_time()
        try:
            given = gpipe_step_time(list(forward), list(backward), m, latency)
        except Exception as error:  # noqa: BLE001 - whatever the learner's code raised
            return learner_raised(name, error)
        if not close_to(as_number(given), expected):
            case = (f"forward={forward}, backward={backward}, n_microbatches={m}, latency={latency}: "
                    f"you said {given!r}, the simulator {expected:.6g}")
            return Verdict(name, False,
                           f"{case}.\n{_gpipe_hint(forward, backward, m, latency, as_number(given))}")
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
        ((m + p - 1) * (forward[0] + backward[0]), "(m + p - 1)(F + B) holds for even stages "
                                                   "only: with uneven ones the slowest stage "
                                                   "paces the middle of the step"),
        ((m + p - 1) * (max(forward) + max(backward)), "not every stage is the slowest: the fill and the "
                                                      "drain pass each stage once, at its own speed"),
        (m * (sum(forward) + sum(backward)), "that is one device's time: in a pipeline "
                                             "the stages work at once"),
    ]
    for wrong, hint in tries:
        if close_to(given, wrong):
            return hint
    return ("think of the forwards as a flow shop: the last microbatch leaves the last stage after every "
            "stage's F once plus (m - 1) times the slowest F; the backwards flow back the same way")

# --- a stage's forward: first, middle, last (pure) ---------------------------------------------

@reported
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
            hint = ("a decoder layer takes (x, cos, sin): get cos, sin = "
                    "stage.rotary_emb(seq_len) once per forward"
                    if isinstance(error, TypeError) and "cos" in str(error) else "")
            return learner_raised(name, error, f"(on the {role} stage) {hint}".strip())
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return Verdict(name, False, f"the {role} stage should return a tensor of shape "
                                        f"{tuple(expected.shape)}, yours returned {shape}."
                                        + _role_hint(role))
        if got.dtype != expected.dtype:
            return Verdict(name, False, f"the {role} stage should return {expected.dtype}, yours "
                                        f"returned {got.dtype}")
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
            return Verdict(name, False, f"the {role} stage's input got no gradient: your forward detached "
                                        "it, so the stages before this one would learn nothing")
    return Verdict(name, True, "the first, middle and last stage compute exactly what the stages do, "
                               "and every parameter gets its gradient")


def _role_hint(role: str) -> str:
    return {"first": "\nThe first stage turns token ids into vectors (embed_tokens), then runs its layers.",
            "middle": "\nA middle stage gets hidden states: no embedding, no head; only "
                      "its layers, with RoPE.",
            "last": "\nThe last stage ends with the final norm, then lm_head: logits over "
                    "the vocabulary."}[role]


# --- a layout for a model family pplab does not know (pure: the stages chained in-process) ---------

@reported
def check_layout(layout, directory) -> Verdict:
    """`layout`, a `pplab.models.hf.Layout`, must say where the model saved in `directory` keeps its parts,
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
        return Verdict(name, False, "give a pplab.models.hf.Layout(embed=..., blocks=..., norm=..., "
                                    f"head=..., ...), not a {type(layout).__name__}")
    if not (Path(directory) / "config.json").is_file():  # the checker's input is gone, not the answer wrong
        return Verdict(name, False, f"the model this checks against is gone ({directory} holds no "
                                    "config.json: the kernel restarted, or a cell removed it). Re-run the "
                                    "notebook's first code cell, which saves it, then this check")
    try:
        model = HFModel.of(directory, layout=layout)
    except ValueError as error:
        return Verdict(name, False, f"pplab refused it: {error}")
    wrong_place = _parts_inside_blocks(layout)
    if wrong_place:
        role, path = wrong_place
        return Verdict(name, False, f"{role}={path!r} lies inside a decoder block: the blocks run "
                                    f"whole on their stages. Name the {role} that sits beside the "
                                    "blocks, not one of theirs")
    left_out = _parts_left_out(model)
    if left_out:
        path, kind = left_out[0]
        return Verdict(name, False, f"{path} ({kind}) is in no part of your layout, so no stage "
                                    "would run it (it holds no parameters, so nothing else says "
                                    f"so). It is {_role_of(kind)}")
    generator = torch.Generator().manual_seed(0)  # the learner's own random state stays as it was
    batch = tuple(torch.randint(0, model.vocab_size, (2, 2, 16), generator=generator))
    reference = reference_step(model, batch, 1)  # the whole transformers model, on one device
    n = model.num_hidden_layers
    for cut in ([range(0, n // 2), range(n // 2, n)], [range(0, 1), range(1, n - 1), range(n - 1, n)]):
        try:
            loss, grads = _chained_stages(model, cut, *batch)
        except Exception as error:  # noqa: BLE001 - what the learner's layout made the stages raise
            return learner_raised(name, error, _layout_hint(error))
        where = f"cut into stages of {', '.join(f'blocks {r.start}-{r.stop - 1}' for r in cut)}"
        report = compare_with_reference(loss, grads, reference, grad_atol=1e-7)
        if report.loss_rel_diff > report.loss_rtol:
            return Verdict(name, False, f"{where}: the loss is {loss:.6f}, the whole model's "
                                        f"{reference.loss:.6f}")
        if not report.passed:
            return Verdict(name, False, f"{where}: the gradient of {(report.missing + report.failing)[0]} "
                                        "differs from the whole model's")
    return Verdict(name, True, "cut in two and in three, the stages give the whole model's loss "
                               f"({reference.loss:.6f}) and every one of its {len(reference.grads)} "
                               "parameters' gradients: lab.pipeline(pplab.models.hf.HFModel.of(directory, "
                               "layout=...)) will pipeline it")


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
        return ("a dropout after the embeddings: `dropout=`; in training the first stage must run it "
                "where the whole model does")
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
        return ("`positions=` is for learned position embeddings added once, on the first stage (GPT-2's "
                "wpe); rotary ones are computed for the blocks on every stage: `rotary=`")
    return "read the model's outline (print(model) or the refusal's list of modules) for each part's path"


# --- text packed into training sequences (pure) ------------------------------------------------

@reported
def check_packing(pack_documents) -> Verdict:
    """`pack_documents(token_lists, seq_len, bos, eos)` -> (inputs, targets), each [sequences, seq_len]:
    the documents' token ids joined as `<bos> ids <eos>` one after another and cut into training
    sequences the way `pplab.data.text.PackedText` cuts them (`join_documents`, then `cut_sequences`)."""
    import random

    from pplab.data.text import cut_sequences, join_documents

    name = "text packed into sequences"
    rng = random.Random(0)
    bos, eos = 1, 2
    cases = [([[5, 6, 7], [8, 9], [10, 11, 12, 13]], 4)]
    cases += [([[rng.randrange(3, 60) for _ in range(rng.randrange(0, 30))]
                for _ in range(rng.randrange(1, 6))],
               seq_len) for seq_len in (3, 8, 16) for _ in range(4)]
    for token_lists, seq_len in cases:
        windows = cut_sequences(join_documents(token_lists, bos, eos), seq_len)
        expected = (windows[:, :-1].tolist(), windows[:, 1:].tolist())
        try:
            returned = pack_documents([list(ids) for ids in token_lists], seq_len, bos, eos)
        except Exception as error:  # noqa: BLE001 - whatever the learner's code raised
            return learner_raised(name, error)
        given = _rows_pair(returned)
        if given != expected:
            case = f"token_lists={token_lists}, seq_len={seq_len}, bos={bos}, eos={eos}"
            hint = _packing_hint(returned, given, expected, token_lists, seq_len, bos, eos)
            return Verdict(name, False, f"{case}:\n{hint}")
    return Verdict(name, True, f"all {len(cases)} cases packed as pplab packs them: <bos> ids <eos> "
                               "per document, windows of seq_len + 1 sharing one token, targets one "
                               "ahead, the tail dropped")


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
        return ("the targets are the inputs themselves: each position must predict the NEXT token, so "
                "targets are the window shifted by one (window[1:]) and inputs window[:-1]")
    bare = cut_sequences(torch.tensor([t for ids in token_lists for t in ids], dtype=torch.int64), seq_len)
    if given == (bare[:, :-1].tolist(), bare[:, 1:].tolist()):
        return ("the documents run into each other: join each as <bos> ids <eos>, so that the model learns "
                "where a document starts and ends instead of continuing one into the next")
    stream = join_documents(token_lists, bos, eos).tolist()
    apart = [stream[i:i + seq_len + 1] for i in range(0, len(stream) - seq_len, seq_len + 1)]
    if given == ([w[:-1] for w in apart], [w[1:] for w in apart]):
        return ("your windows do not overlap: each window is seq_len + 1 tokens, and the next "
                "starts seq_len tokens later, at its last token. Without that the pair across "
                "each cut is never learned")
    if len(given[0]) == len(inputs) + 1 and given[0][:-1] == inputs and given[1][:-1] == targets:
        return ("the last, partial window is dropped, not padded: pad tokens would be learned as text (or "
                "need a loss mask) and cost compute")
    return (f"you made {len(given[0])} rows; expected {len(inputs)}:\n"
            f"expected inputs  {inputs}\nexpected targets {targets}")


# --- a rank's idle share, read from a trace (pure) ----------------------------------------------

@reported
def check_idle_share(idle_share, *timelines) -> Verdict:
    """`idle_share(timeline, rank)`: the fraction of the step (first start to last end over every rank)
    that `rank` spent not computing, a receive's wait counting as idle. Judged against
    `Timeline.bubble_fraction(rank)` on the timelines given (read from traces) and on simulated ones
    (uneven stages, message latency, split backwards)."""
    from pplab.planning.simulator import Costs, simulate
    from pplab.schedules import build

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
                return learner_raised(name, error)
            if not close_to(as_number(given), expected):
                return Verdict(name, False, f"{which}, rank {rank}: you said {given!r}, it is "
                                            f"{expected:.6g}.\n"
                                            f"{_idle_hint(timeline, rank, as_number(given))}")
    return Verdict(name, True, f"every rank of {len(timelines)} timeline(s) read from traces and "
                               f"{len(simulated)} simulated ones: your idle shares are the "
                               "timelines' own bubble fractions")


def _idle_hint(timeline, rank: int, given: float | None) -> str:
    """What the learner's number most likely measured instead (known mistakes, tried in turn)."""
    if given is None:
        return "return the share as a number between 0 and 1"
    step, busy = timeline.step_time(), timeline.busy_time(rank)
    compute = timeline.compute_events(rank)
    own = max(e.end for e in compute) - min(e.start for e in compute) if compute else 0.0
    tries = [
        (1 - timeline.active_time(rank) / step if step else 0.0,
         "a rank waiting in a receive is idle, not busy: count only compute (F, B, I, W, ...), "
         "not sends and receives"),
        (1 - busy / own if own else 0.0,
         "measure against the whole step, from the first rank's start to the last rank's end: the time a "
         "rank waits before its first action (the fill) and after its last (the drain) is its bubble too"),
        (busy / step if step else 0.0, "that is the share it computed: the idle share is 1 minus it"),
        (step - busy, "that is in seconds: divide by the step time"),
    ]
    for wrong, hint in tries:
        if close_to(given, wrong):
            return hint
    return "idle = the step time minus the time covered by the rank's compute events, over the step time"


# --- a mesh's groups (pure) ------------------------------------------------------------------------

@reported
def check_mesh_groups(mesh_groups) -> Verdict:
    """`mesh_groups(rank, pp, dp, tp)` -> {"pp": [...], "dp": [...], "tp": [...]}: the global ranks (the
    rank itself included, ascending) of `rank`'s pipeline, FSDP group and TP group, on a mesh of those
    sizes laid out as `pplab.Mesh` lays it out. Judged on every rank of meshes up to 3 x 3 x 3."""
    from itertools import product

    from pplab.rank.mesh import Mesh

    name = "a mesh's groups"
    # a typical one first
    sizes = [(2, 2, 2)] + [size for size in product((1, 2, 3), repeat=3) if size != (2, 2, 2)]
    for pp, dp, tp in sizes:
        mesh = Mesh(pp=pp, dp=dp, tp=tp)
        for rank in range(mesh.world_size):
            expected = _groups_of(mesh, rank)
            try:
                returned = mesh_groups(rank, pp, dp, tp)
            except Exception as error:  # noqa: BLE001 - whatever the learner's code raised
                return learner_raised(name, error)
            given = _as_groups(returned)
            if given != expected:
                case = f"rank {rank} of a mesh pp={pp} x dp={dp} x tp={tp}"
                return Verdict(name, False, f"{case}: you said {returned!r}, expected {expected}.\n"
                                            f"{_groups_hint(given, expected, rank, mesh)}")
    return Verdict(name, True, f"every rank of {len(sizes)} meshes up to 3 x 3 x 3: its pipeline, FSDP group "
                               "and TP group are the ones pplab.Mesh builds")


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
        return ("a group includes the rank itself: its pipeline, for example, is every stage, its own "
                "among them")
    reversed_layout = Mesh(pp=mesh.tp, dp=mesh.dp, tp=mesh.pp)  # pp varying fastest instead of tp
    swapped = _groups_of(reversed_layout, rank)
    if given == {"pp": swapped["tp"], "dp": swapped["dp"], "tp": swapped["pp"]}:
        return ("the layout is row-major over (pp, dp, tp): tp varies fastest, so a TP group is neighbouring "
                "ranks (one host's fastest links), and pp slowest, so a pipeline's stages are far apart")
    wrong = [dim for dim in ("pp", "dp", "tp") if given[dim] != expected[dim]]
    stride = {"pp": mesh.dp * mesh.tp, "dp": mesh.tp, "tp": 1}
    return (f"your {' and '.join(wrong)} group{'s are' if len(wrong) > 1 else ' is'} off. Along each "
            f"dimension the ranks of a group are a fixed stride apart: {stride['pp']} for pp (dp x tp), "
            f"{stride['dp']} for dp (tp), 1 for tp")
