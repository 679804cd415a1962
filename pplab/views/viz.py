"""Pictures of timelines: Gantt charts, in-flight memory and bubble bars.

Every function returns a `matplotlib.figure.Figure` built with the object API
(no pyplot state), so the same code draws in a notebook, in a widget and
headless in CI. Save one with `save(fig, "x.png")` (or ".svg", ".pdf").

Colours come from the Okabe-Ito palette, which colour-blind readers can tell
apart; the kinds also differ in lightness (and I and W are hatched) so that
a greyscale print still shows which box is which.
"""

from __future__ import annotations

import statistics
from os import PathLike
from typing import Mapping, Sequence

from matplotlib.axes import Axes
from matplotlib.collections import PatchCollection
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import PercentFormatter
from matplotlib.transforms import blended_transform_factory

from pplab.base.formatting import byte_unit, format_bytes
from pplab.trace.timeline import Event, Timeline

__all__ = ["plot_timeline", "compare_timelines", "plot_bubbles", "plot_memory", "plot_training", "save"]

# ---------------------------------------------------------------- style

# kind -> (face colour, hatch, legend label). Hues differ for colour
# readers (blue forward, red-orange backward, green weight gradient); in
# greyscale F is light, B dark, and I and W carry hatches.
_KIND_STYLE = {
    "F": ("#56B4E9", "", "forward F"),
    "B": ("#D55E00", "", "backward B"),
    "I": ("#E69F00", "\\\\", "input grad I"),
    "W": ("#009E73", "//", "weight grad W"),
    "SEND_F": ("#CC79A7", "", "send"),
    "SEND_B": ("#CC79A7", "", "send"),
    "RECV_F": ("#F0E442", "", "receive (waiting on the wire)"),
    "RECV_B": ("#F0E442", "", "receive (waiting on the wire)"),
    "ALL_GATHER": ("#0072B2", "", "all-gather (FSDP)"),
    "REDUCE_SCATTER": ("#999933", "", "reduce-scatter (FSDP)"),  # olive: apart from the gathers at a glance
    "ALL_REDUCE": ("#444444", "", "all-reduce (TP; tied weights)"),
}
_SHADING_LABEL = "lighter = later virtual stage"
_OTHER_COLOUR = "#999999"  # free-form kinds, like an optimizer step "OPT"
_IDLE_FACE, _IDLE_HATCH_COLOUR = "#f4f4f4", "#c8c8c8"

_SMALLEST_FONT, _LARGEST_FONT = 5.0, 9.0
_CHAR_WIDTH = 0.62  # width of a digit, in units of the font size
_LABEL_MARGIN_PT = 1.5  # space left between a number and its box's edges


def kind_colours() -> dict[str, str]:
    """The face colour of every action kind, for drawings made outside matplotlib (the live SVG)."""
    return {kind: face for kind, (face, _, _) in _KIND_STYLE.items()}


def kind_labels() -> dict[str, str]:
    """The legend's words for every action kind ("forward F", "send", ...), for the live SVG's legend."""
    return {kind: label for kind, (_, _, label) in _KIND_STYLE.items()}


def _style(kind: str) -> tuple[str, str, str]:
    return _KIND_STYLE.get(kind, (_OTHER_COLOUR, "", kind))


def _lighter(colour: str, amount: float) -> tuple[float, float, float]:
    """The colour mixed with `amount` (0..1) of white."""
    return tuple(c + (1.0 - c) * amount for c in to_rgb(colour))


def _darker(colour: str, amount: float) -> tuple[float, float, float]:
    """The colour mixed with `amount` (0..1) of black."""
    return tuple(c * (1.0 - amount) for c in to_rgb(colour))


def _is_dark(rgb) -> bool:
    red, green, blue = to_rgb(rgb)
    return 0.299 * red + 0.587 * green + 0.114 * blue < 0.5


# ---------------------------------------------------------------- figures


def _new_figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def _timeline_width(*timelines: Timeline) -> float:
    # Wider for long rows, so that two-digit microbatch numbers still fit
    # in their boxes at 32 microbatches; capped to stay a screen wide.
    boxes_per_rank = max((len(t.compute_events(r)) for t in timelines for r in range(t.n_ranks)), default=0)
    return min(16.0, max(11.0, 0.15 * boxes_per_rank))


def _timeline_height(n_ranks: int) -> float:
    # Half an inch per rank keeps 8 ranks on a screen and 1 rank legible.
    return 1.7 + 0.5 * max(n_ranks, 1)


def save(fig: Figure, path: str | PathLike, dpi: int = 150) -> None:
    """Write the figure to a file; the suffix (.png, .svg, .pdf) picks the format."""
    # A constrained layout already fits everything in; "tight" would draw the figure twice.
    fig.savefig(path, dpi=dpi, bbox_inches=None if fig.get_layout_engine() else "tight")


# ---------------------------------------------------------------- timeline


def plot_timeline(timeline: Timeline, ax: Axes | None = None, title: str | None = None,
                  rank_labels: Sequence[str] | None = None) -> Figure:
    """Gantt chart of a timeline: one row per rank, idle time hatched, bubble in the title.

    `rank_labels` names the rows (e.g. each rank's mesh coordinates); default "rank r".
    """
    if ax is None:
        fig = _new_figure(_timeline_width(timeline), _timeline_height(timeline.n_ranks))
        ax = fig.add_subplot()
    handles = _draw_timeline(ax, timeline, title, rank_labels=rank_labels)
    if ax.figure.get_layout_engine() is not None and len(ax.figure.axes) == 1:
        ax.figure.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False,
                         fontsize=8)
    else:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.04, 1.0), frameon=False, fontsize=8)
    return ax.figure


def compare_timelines(predicted: Timeline, measured: Timeline, titles: tuple[str, str] | None = None,
                      shared_time: bool = True) -> Figure:
    """Predicted and measured timelines stacked on one shared time axis, both starting at 0.

    Give the simulator's `Costs` in seconds (e.g. measured F and B times) for
    the two to be on the same scale. `shared_time=False` gives each its own time axis:
    for comparing the shapes of steps of very different lengths (real mode and timing mode).
    """
    titles = titles or (predicted.label or "predicted", measured.label or "measured")
    n_rows = predicted.n_ranks + measured.n_ranks
    fig = _new_figure(_timeline_width(predicted, measured), 2.2 + 0.5 * n_rows)
    top, bottom = fig.subplots(2, 1, sharex=shared_time,
                               height_ratios=[max(predicted.n_ranks, 1), max(measured.n_ranks, 1)])
    handles = {}
    predicted, measured = predicted.normalised(), measured.normalised()
    # Both panels span the longer step: the shared x axis must not cut the other one off.
    until = max(predicted.end, measured.end) if shared_time else None
    for ax, timeline, title in ((top, predicted, titles[0]), (bottom, measured, titles[1])):
        for handle in _draw_timeline(ax, timeline, title, until):
            handles[handle.get_label()] = handle
    if shared_time:
        top.set_xlabel("")
    # Kinds first, then the entries that explain the background and the shading.
    last = [handles.pop(label) for label in ("idle", _SHADING_LABEL) if label in handles]
    legend = [*handles.values(), *last]
    fig.legend(handles=legend, loc="outside lower center", ncol=len(legend), frameon=False, fontsize=8)
    return fig


def _draw_timeline(ax: Axes, timeline: Timeline, title: str | None, until: float | None = None,
                   rank_labels: Sequence[str] | None = None) -> list[Patch]:
    """Draw the rows, boxes and labels of a timeline on `ax` (its x axis reaching at least
    `until`); return legend handles."""
    n_ranks = max(timeline.n_ranks, 1)
    t0, t1 = timeline.start, timeline.end
    x_end = t1 if until is None else max(t1, until)
    span = (x_end - t0) or 1.0
    show_comm = any(e.is_comm and e.duration > 0 for e in timeline.events)
    compute_band, comm_band = _row_bands(show_comm)

    ax.set_xlim(t0 - 0.01 * span, x_end + 0.01 * span)
    ax.set_ylim(n_ranks, 0)  # rank 0 on top
    if rank_labels is not None and len(rank_labels) != n_ranks:
        raise ValueError(f"rank_labels has {len(rank_labels)} names but the timeline has {n_ranks} ranks: "
                         f"give one per rank (a mesh pipeline's are pipe.rank_labels)")
    labels = list(rank_labels) if rank_labels is not None else [f"rank {r}" for r in range(n_ranks)]
    ax.set_yticks([r + 0.5 for r in range(n_ranks)], labels)
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("time (cost units)" if timeline.label == "simulated" else "time (s)")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)

    _settle_layout(ax)
    _draw_idle(ax, timeline, t0, t1, compute_band)
    shading = _Shading(timeline)
    boxes = [e for e in timeline.events if e.duration > 0 and (e.is_compute or show_comm)]
    compute_boxes = [e for e in boxes if e.is_compute]
    typical_width_pt = statistics.median([e.duration
                                          for e in compute_boxes] or [span]) * _points_per_time_unit(ax)
    _draw_boxes(ax, boxes, shading, (compute_band, comm_band), typical_width_pt)
    _draw_labels(ax, compute_boxes, shading, compute_band)
    _draw_rank_bubbles(ax, timeline)

    heading = title if title is not None else (timeline.label or "timeline")
    ranks = f"{n_ranks} rank" + ("s" if n_ranks != 1 else "")
    ax.set_title(f"{heading}: {ranks}, bubble {timeline.bubble_fraction():.1%}", fontsize=11)
    return _legend_handles(boxes, shading.most_chunks)


def _row_bands(show_comm: bool) -> tuple[tuple[float, float], tuple[float, float]]:
    """(top, height) of the compute bar and of the communication strip inside a row."""
    if show_comm:
        return (0.08, 0.6), (0.72, 0.2)
    return (0.1, 0.8), (0.0, 0.0)


def _draw_idle(ax: Axes, timeline: Timeline, t0: float, t1: float, band) -> None:
    # The whole step is drawn as hatched idle time; the boxes cover the busy parts.
    top, height = band
    idle = [Rectangle((t0, r + top), t1 - t0, height) for r in range(timeline.n_ranks)]
    ax.add_collection(PatchCollection(idle, facecolor=_IDLE_FACE, edgecolor=_IDLE_HATCH_COLOUR,
                                      hatch="///", linewidth=0.0, zorder=1))


class _Shading:
    """Box colours: the kind's colour, lighter for a rank's later virtual stages."""

    def __init__(self, timeline: Timeline):
        stages_by_rank: dict[int, set[int]] = {}
        for e in timeline.events:
            if e.stage is not None and e.is_compute:
                stages_by_rank.setdefault(e.rank, set()).add(e.stage)
        # (rank, stage) -> which of the rank's stages it is: 0 for its first.
        self.chunk = {(rank, stage): i for rank, stages in stages_by_rank.items()
                      for i, stage in enumerate(sorted(stages))}
        self.n_chunks = {rank: len(stages) for rank, stages in stages_by_rank.items()}
        self.most_chunks = max(self.n_chunks.values(), default=1)

    def face(self, event: Event) -> tuple[float, float, float]:
        colour = _style(event.kind)[0]
        n_chunks = self.n_chunks.get(event.rank, 1)
        if event.is_comm or n_chunks == 1 or event.stage is None:
            return to_rgb(colour)
        return _lighter(colour, 0.55 * self.chunk[(event.rank, event.stage)] / (n_chunks - 1))


def _draw_boxes(ax: Axes, events: list[Event], shading: _Shading, bands, typical_width_pt: float) -> None:
    compute_band, comm_band = bands
    # White edges separate neighbouring boxes, but must not swamp narrow ones.
    edge_width = min(0.6, 0.12 * typical_width_pt)
    # One collection per kind: thousands of boxes draw fast and share a hatch.
    by_kind: dict[str, list[Event]] = {}
    for e in events:
        by_kind.setdefault(e.kind, []).append(e)
    for kind, kind_events in by_kind.items():
        top, height = comm_band if kind_events[0].is_comm else compute_band
        rects = [Rectangle((e.start, e.rank + top), e.duration, height) for e in kind_events]
        boxes = PatchCollection(rects, facecolors=[shading.face(e) for e in kind_events], edgecolor="white",
                                linewidth=edge_width, hatch=_style(kind)[1] or None, zorder=2)
        _style_hatch(boxes, _style(kind)[0])
        ax.add_collection(boxes)


def _style_hatch(artist, colour: str) -> None:
    """Thin hatch lines in a darker shade of the box colour, so numbers stay readable."""
    # matplotlib < 3.10 lacks these setters and draws hatches in the edge colour.
    if hasattr(artist, "set_hatchcolor"):
        artist.set_hatchcolor(_darker(colour, 0.3))
    if hasattr(artist, "set_hatch_linewidth"):
        artist.set_hatch_linewidth(0.8)


def _settle_layout(ax: Axes) -> None:
    """Let the layout size the axes now, so that box widths in points are known."""
    engine = ax.figure.get_layout_engine()
    if engine is not None:
        engine.execute(ax.figure)


def _points_per_time_unit(ax: Axes) -> float:
    width_pt = ax.get_position().width * ax.figure.get_figwidth() * 72
    left, right = ax.get_xlim()
    return width_pt / (right - left)


def _row_height_pt(ax: Axes) -> float:
    rows = abs(ax.get_ylim()[0] - ax.get_ylim()[1])
    return ax.get_position().height * ax.figure.get_figheight() * 72 / rows


def _label_font_size(events: list[Event], ax: Axes, bar_height: float) -> float | None:
    """One font size for all microbatch numbers, or None when typical boxes are too narrow."""
    widest_text = max(len(str(e.microbatch)) for e in events)
    typical_pt = statistics.median(e.duration for e in events) * _points_per_time_unit(ax)
    size = min(_LARGEST_FONT, (typical_pt - _LABEL_MARGIN_PT) / (_CHAR_WIDTH * widest_text),
               0.7 * bar_height * _row_height_pt(ax))
    # Below the smallest legible size, numbers on a few wide boxes only distract.
    return size if size >= _SMALLEST_FONT else None


def _draw_labels(ax: Axes, events: list[Event], shading: _Shading, band) -> None:
    """Microbatch numbers inside the boxes, in one font size, where they fit."""
    labelled = [e for e in events if e.microbatch is not None]
    top, height = band
    size = _label_font_size(labelled, ax, height) if labelled else None
    if size is None:
        return
    per_unit = _points_per_time_unit(ax)
    # Room for the longest number, so that boxes of one width are all labelled or none.
    needed_pt = max(len(str(e.microbatch)) for e in labelled) * _CHAR_WIDTH * size + _LABEL_MARGIN_PT
    for e in labelled:
        if e.duration * per_unit < needed_pt:
            continue  # too narrow: a number spilling over its box misleads
        colour = "white" if _is_dark(shading.face(e)) else "black"
        ax.text((e.start + e.end) / 2, e.rank + top + height / 2, str(e.microbatch), ha="center", va="center",
                fontsize=size, color=colour, zorder=3, clip_on=True)


def _draw_rank_bubbles(ax: Axes, timeline: Timeline) -> None:
    # Per-rank bubble at the right end of each row: where the idle time is; the column says so.
    to_row = blended_transform_factory(ax.transAxes, ax.transData)
    ax.text(1.005, 1.0, "idle", transform=ax.transAxes, ha="left", va="bottom", fontsize=8, color="#555555")
    for r in range(timeline.n_ranks):
        ax.text(1.005, r + 0.5, f"{timeline.bubble_fraction(r):.0%}", transform=to_row,
                ha="left", va="center", fontsize=8, color="#555555")


def _legend_handles(events: list[Event], n_chunks: int) -> list[Patch]:
    """One entry per kind drawn (known kinds in a fixed order), then idle and shading."""
    present = {e.kind for e in events}
    kinds = [k for k in _KIND_STYLE if k in present] + sorted(present - _KIND_STYLE.keys())
    handles, labels_seen = [], set()
    for kind in kinds:
        colour, hatch, label = _style(kind)
        if label in labels_seen:  # SEND_F and SEND_B share one entry, as do the receives
            continue
        labels_seen.add(label)
        handle = Patch(facecolor=colour, hatch=hatch, edgecolor="white", label=label)
        _style_hatch(handle, colour)
        handles.append(handle)
    handles.append(Patch(facecolor=_IDLE_FACE, edgecolor=_IDLE_HATCH_COLOUR, hatch="///", label="idle"))
    if n_chunks > 1:
        handles.append(Patch(facecolor=_lighter("#777777", 0.55), edgecolor="white", label=_SHADING_LABEL))
    return handles


# ---------------------------------------------------------------- memory


def plot_memory(timeline: Timeline, title: str | None = None) -> Figure:
    """In-flight activations of every rank over time, one small panel per rank (bytes when known)."""
    n_ranks = max(timeline.n_ranks, 1)
    fig = _new_figure(11.0, 1.2 + 0.85 * n_ranks)
    axes = fig.subplots(n_ranks, 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    use_bytes = timeline.n_ranks > 0 and all(timeline.inflight_bytes(r) is not None
                                             for r in range(timeline.n_ranks))
    most = max((timeline.peak_inflight_bytes(r)
                for r in range(timeline.n_ranks)), default=0) if use_bytes else 0
    scale, unit = byte_unit(most) if use_bytes else (1, "")
    highest = 0.0
    for rank, ax in enumerate(axes):
        steps = timeline.inflight_bytes(rank) if use_bytes else timeline.inflight(rank)
        values = [(t, held / scale) for t, held in steps or []]
        _draw_steps(ax, values, timeline.start, timeline.end)
        highest = max([highest, *(v for _, v in values)])
        held = timeline.peak_inflight(rank)
        note = f"peak {held} microbatch{'es' if held != 1 else ''}"
        if use_bytes:
            note += f" ({format_bytes(timeline.peak_inflight_bytes(rank))})"
        ax.text(1.005, 0.5, note, transform=ax.transAxes, ha="left", va="center", fontsize=8)
        ax.set_ylabel(f"rank {rank}", rotation=0, ha="right", va="center")
        ax.spines[["top", "right"]].set_visible(False)
    # One y range for all panels, set after all are drawn, from the highest peak of any rank
    # (a limit set while drawing would freeze the range at the ranks drawn so far).
    axes[0].set_ylim(0, 1.1 * highest if highest > 0 else 1.0)
    # Shared y axes share their ticks: setting them on one sets them on all.
    axes[0].yaxis.get_major_locator().set_params(integer=not use_bytes)
    if use_bytes:
        axes[0].yaxis.set_major_formatter(lambda value, _: f"{value:g} {unit}")
    axes[-1].set_xlabel("time (cost units)" if timeline.label == "simulated" else "time (s)")
    what = "bytes of activations" if use_bytes else "activations"
    heading = title if title is not None else (timeline.label or "timeline")
    fig.suptitle(f"{heading}: {what} held for a backward, per rank", fontsize=11)
    return fig


def _draw_steps(ax: Axes, steps: list[tuple[float, float]], t0: float, t1: float) -> None:
    times = [t0] + [t for t, _ in steps] + [t1]
    values = [0] + [v for _, v in steps] + [steps[-1][1] if steps else 0]
    ax.step(times, values, where="post", color="#0072B2", linewidth=1.2)
    ax.fill_between(times, values, step="post", color="#56B4E9", alpha=0.35, linewidth=0)


# ---------------------------------------------------------------- bubbles


def plot_bubbles(results: Mapping[str, tuple[float | Timeline, float | None]],
                 title: str | None = None) -> Figure:
    """Bars of measured vs theory bubble per schedule: {name: (measured, theory or None)}.

    `measured` may be a number or a Timeline (its bubble_fraction is used).
    """
    names = list(results)
    measured = [_bubble_of(results[n][0]) for n in names]
    theory = [results[n][1] for n in names]
    fig = _new_figure(max(4.0, 1.3 * len(names) + 2.0), 3.6)
    ax = fig.add_subplot()
    width = 0.38
    xs = range(len(names))
    measured_bars = ax.bar([x - width / 2 for x in xs], measured, width, color="#0072B2", label="measured")
    theory_bars = ax.bar([x + width / 2 for x in xs], [t or 0.0 for t in theory], width,
                         color="#E69F00", hatch="//", edgecolor="white", label="theory")
    ax.bar_label(measured_bars, [f"{m:.1%}" for m in measured], fontsize=8, padding=2)
    ax.bar_label(theory_bars, [("n/a" if t is None else f"{t:.1%}") for t in theory], fontsize=8, padding=2)
    ax.set_xticks(list(xs), names)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, max([*measured, *(t for t in theory if t is not None), 0.05]) * 1.2)
    ax.set_ylabel("bubble (idle / step time)")
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(frameon=False, fontsize=8)
    ax.set_title(title or "bubble per schedule: measured vs theory", fontsize=11)
    return fig


def _bubble_of(value: float | Timeline) -> float:
    return value.bubble_fraction() if isinstance(value, Timeline) else float(value)


# ---------------------------------------------------------------- training


def plot_training(records: Sequence, title: str | None = None) -> Figure:
    """Training loss per step, held-out loss at each evaluation, and the learning rate (right axis).

    `records` are `pplab.rank.train.TrainRecord`s (anything with step, loss, lr, eval_loss).
    """
    fig = _new_figure(7.0, 3.0)
    ax = fig.add_subplot()
    steps = [r.step for r in records]
    ax.plot(steps, [r.loss for r in records], color="#4878a8", lw=1.2, label="training loss")
    evaluations = [(r.step, r.eval_loss) for r in records if r.eval_loss is not None]
    if evaluations:
        ax.plot(*zip(*evaluations), "o-", color="#c0504d", ms=4, lw=1.2, label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    lr_axis = ax.twinx()
    lr_axis.plot(steps, [r.lr for r in records], color="#999999", lw=1, ls="--", label="learning rate")
    lr_axis.set_ylabel("learning rate", color="#777777")
    lr_axis.tick_params(axis="y", colors="#777777", labelsize=8)
    lr_axis.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    handles = ax.get_legend_handles_labels()[0] + lr_axis.get_legend_handles_labels()[0]
    # Below the axes: inside, wherever it sat, it covered the loss or the learning rate's curve.
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False, fontsize=8)
    if records:
        last = records[-1]
        ax.set_title(title or f"step {last.step}: loss {last.loss:.3f}"
                     + (f", held-out {evaluations[-1][1]:.3f}" if evaluations else ""), fontsize=10)
    return fig
