"""The dashboard's panels, each a widget that also works alone, on static or simulated data.

Every panel has a `show(...)`/`add(...)` that takes plain pplab objects (a `Timeline`,
boundary records, gradient statistics, a rank's `Now`) and keeps what it shows in
plain attributes (`rows`, `flagged`, `red`, `states`), so tests and notebooks can
read the state without a browser.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import ipywidgets as widgets

from pplab.base.formatting import format_bytes
from pplab.trace.timeline import Timeline
from pplab.views.widgets.render import AMBER, RED, show_png, table

FULL_WIDTH = widgets.Layout(width="100%")


def _image() -> widgets.Image:
    # Natural size, scaled down to the panel's width on narrow screens (never up); hidden
    # until it has a picture (an empty image shows as a broken one).
    return widgets.Image(format="png", layout=widgets.Layout(max_width="100%", height="auto",
                                                             align_self="flex-start", display="none"))




def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


# ---------------------------------------------------------------- timeline


class TimelineView(widgets.VBox):
    """Per-rank Gantt chart of a timeline, its prediction above it on one time axis; past steps selectable.

    A step in progress is drawn as SVG (`show_live`, cheap enough for several redraws a
    second); a finished one as the full matplotlib picture (`show`).
    """

    def __init__(self, timeline: Timeline | None = None, predicted: Timeline | None = None,
                 rank_labels: list[str] | None = None, pictures: bool = True):
        """`rank_labels` names the rows of a measured timeline (a mesh's: 'rank 3 · pp1 dp1');
        `pictures=False` draws finished steps as SVG too, the size of the live view (the dashboard:
        its height stays put when a run ends, and no picture takes the ranks' CPU)."""
        self.rank_labels, self.pictures = rank_labels, pictures
        self.image = _image()
        self.live = widgets.HTML(layout=widgets.Layout(display="none", overflow="auto"))
        self.caption = widgets.HTML()
        self.picker = widgets.Dropdown(description="step", options=[], layout=widgets.Layout(display="none"))
        self.history: list[tuple[Timeline, Timeline | None]] = []
        self.shown: Timeline | None = None
        self.draws = 0  # finished steps drawn (PNG pictures, or SVG where pictures=False)
        self.live_draws = 0  # live (SVG) redraws
        from pplab.views import (
            viz,  # matplotlib's import takes a second: pay it now, not in the first live redraw
        )

        self._colours, self._labels = viz.kind_colours(), viz.kind_labels()
        super().__init__([self.picker, self.caption, self.live, self.image])
        self._hide_picker()
        self.picker.observe(self._picked, names="value")
        if timeline is not None or predicted is not None:
            self.show(timeline, predicted)

    def show(self, timeline: Timeline | None, predicted: Timeline | None = None, note: str = "") -> None:
        """Draw `timeline` under `predicted` (if given) as a picture."""
        from pplab.views import viz

        has_events = timeline is not None and len(timeline) > 0
        if not self.pictures:
            from pplab.views.widgets.svg import timeline_svg

            self.live.value = timeline_svg(timeline if has_events else None, predicted, self._colours,
                                           labels=self._labels, idle=True,
                                           rank_labels=self.rank_labels if has_events else None)
            self.live.layout.display, self.image.layout.display = None, "none"
            self.draws += 1
            self._caption(timeline if has_events else None, predicted, note)
            return
        if has_events and predicted is not None:
            fig = viz.compare_timelines(predicted, timeline)
        else:
            fig = viz.plot_timeline(timeline if has_events else predicted,
                                    rank_labels=self.rank_labels if has_events else None)
        show_png(self.image, fig)
        self.live.layout.display = "none"
        self.draws += 1
        self._caption(timeline if has_events else None, predicted, note)

    def show_live(self, timeline: Timeline, predicted: Timeline | None = None, note: str = "") -> None:
        """Draw a step in progress (or any timeline, quickly) as SVG."""
        from pplab.views.widgets.svg import timeline_svg

        self.live.value = timeline_svg(timeline, predicted, self._colours, labels=self._labels,
                                       rank_labels=self.rank_labels)
        self.live.layout.display, self.image.layout.display = None, "none"
        self.live_draws += 1
        self._caption(timeline if len(timeline) else None, predicted, note)

    def add_step(self, timeline: Timeline, predicted: Timeline | None = None, show: bool = True) -> None:
        """Keep a finished step in the picker and, with `show`, draw it as a picture (without,
        where the caller draws over it at once: a run's next live view, or its closing picture)."""
        self.history.append((timeline, predicted))
        self.picker.unobserve(self._picked, names="value")
        self.picker.options = [(f"{i + 1}", i) for i in range(len(self.history))]
        self.picker.value = len(self.history) - 1
        self.picker.layout.display, self.picker.layout.visibility = None, "visible"
        self.picker.observe(self._picked, names="value")
        if show:
            self.show(timeline, predicted, f"step {len(self.history)}")

    def _hide_picker(self) -> None:
        # In a dashboard its place stays taken, so that the first finished step moves nothing below it.
        if self.pictures:
            self.picker.layout.display = "none"
        else:
            self.picker.layout.display, self.picker.layout.visibility = None, "hidden"

    def reset(self, rank_labels: list[str] | None = None) -> None:
        """Forget every step (a rebuilt pipeline starts a fresh history); nothing is drawn."""
        self.rank_labels, self.history = rank_labels, []
        self.picker.unobserve(self._picked, names="value")
        self.picker.options = []
        self._hide_picker()
        self.picker.observe(self._picked, names="value")
        self.image.layout.display = self.live.layout.display = "none"
        self._caption(None, None, "")

    def _caption(self, timeline: Timeline | None, predicted: Timeline | None, note: str) -> None:
        """Two lines at most, running or done, so that the panel keeps its height: the step and
        what was measured, then what was predicted."""
        self.shown = timeline
        lines = [" · ".join(part for part in (note, self._numbers(timeline)) if part),
                 self._numbers(predicted) + self._gap(timeline, predicted)]
        self.caption.value = "<br>".join(line for line in lines if line)

    @staticmethod
    def _gap(measured: Timeline | None, predicted: Timeline | None) -> str:
        """Why a measured step is much longer than its prediction, where it is."""
        if measured is None or predicted is None or not len(measured) or not len(predicted) \
                or (measured.label or "").endswith("(running)") or predicted.step_time() <= 0:
            return ""
        ratio = measured.step_time() / predicted.step_time()
        if ratio < 1.5:
            return ""
        return (f" · measured {ratio:.1f}x that: the prediction has the compute times only; messages, the "
                f"gaps between actions and a busy machine's waits make the rest")

    @staticmethod
    def _numbers(shown: Timeline | None) -> str:
        if shown is None or not len(shown):
            return ""
        if (shown.label or "").endswith("(running)"):  # no step time or bubble yet: half a step would mislead
            return shown.label
        # The simulator's own label means cost units; measured or seconds-costed ones are seconds.
        unit = " cost units" if shown.label == "simulated" else " s"
        return f"{shown.label}: step {shown.step_time():.3g}{unit}, bubble {shown.bubble_fraction():.1%}"

    def _picked(self, change) -> None:
        if change["new"] is not None:
            timeline, predicted = self.history[change["new"]]
            self.show(timeline, predicted, note=f"step {change['new'] + 1}")


# ---------------------------------------------------------------- bubbles


class BubblesView(widgets.VBox):
    """Measured bubble fraction per rank and overall, step by step, against theory and simulation."""

    def __init__(self, theory: float | None = None, simulated: float | None = None, theory_note: str = ""):
        self.table = widgets.HTML()
        self.image = _image()
        self.rows: list[dict] = []
        self.theory, self.simulated, self.theory_note = theory, simulated, theory_note
        self.simulated_label: str | None = None
        super().__init__([self.table, self.image])
        self._render()

    def set_reference(self, theory: float | None, simulated: float | None, theory_note: str = "",
                      picture: bool = True, simulated_label: str | None = None) -> None:
        """The numbers measured steps are compared with (theory is None where no formula holds);
        `simulated_label` says whose costs the simulation ran on ('(costs of step 3)')."""
        self.theory, self.simulated, self.theory_note = theory, simulated, theory_note
        self.simulated_label = simulated_label
        self._render(picture)

    def add(self, timeline: Timeline, picture: bool = True) -> dict:
        """Add one finished step's measured bubble (overall and per rank); the plot waits if not `picture`."""
        row = dict(step=len(self.rows) + 1, overall=timeline.bubble_fraction(),
                   per_rank=[timeline.bubble_fraction(r) for r in range(timeline.n_ranks)])
        self.rows.append(row)
        self._render(picture)
        return row

    def reset(self) -> None:
        """Forget the measured steps (a rebuilt pipeline's are another schedule's); its plot goes too."""
        self.rows = []
        self.image.layout.display = "none"
        self._render()

    def draw_plot(self) -> None:
        """Draw the plot of the bubble across steps (deferred during a run)."""
        self._render(picture=True)

    def _render(self, picture: bool = True) -> None:
        n_ranks = max((len(r["per_rank"]) for r in self.rows), default=0)
        header = ["", "overall", *(f"rank {r}" for r in range(n_ranks))]
        rows = [([f"step {r['step']}", _percent(r["overall"]), *map(_percent, r["per_rank"])], "")
                for r in self.rows[-8:]]  # the latest steps; the plot shows them all
        rows.append((["theory", _percent(self.theory)], ""))
        rows.append(([f"simulation {self.simulated_label}" if self.simulated_label else "simulation",
                      _percent(self.simulated)], ""))
        note = (f"<div style='font-size:11px;color:#555'>theory: {self.theory_note}</div>"
                if self.theory_note else "")
        self.table.value = table(header, rows, "bubble: idle time / step time") + note
        if self.rows and picture:
            show_png(self.image, self._figure())

    def _figure(self):
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator, PercentFormatter

        fig = Figure(figsize=(5.5, 2.4), layout="constrained")
        ax = fig.add_subplot()
        steps = [r["step"] for r in self.rows]
        ax.plot(steps, [r["overall"] for r in self.rows], "o-", color="#0072B2", label="measured")
        # Theory dotted and thick over simulation dashed: where the two agree, both still show.
        for value, colour, label, style, width in ((self.simulated, "#009E73", "simulation", "--", 1.5),
                                                   (self.theory, "#E69F00", "theory", ":", 3.0)):
            if value is not None:
                ax.axhline(value, color=colour, linestyle=style, linewidth=width, label=label)
        highest = max([row["overall"] for row in self.rows] + [self.theory or 0, self.simulated or 0, 0.05])
        ax.set_ylim(0, highest * 1.2)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.set_xlim(0.5, len(steps) + 0.5)
        ax.set_xlabel("step")
        ax.spines[["top", "right"]].set_visible(False)
        ax.legend(frameon=False, fontsize=8)
        return fig


# ---------------------------------------------------------------- activation shapes


class ShapesView(widgets.VBox):
    """What crossed each stage boundary, per microbatch: shape, dtype, bytes; a change of shape flagged."""

    def __init__(self, boundaries: Sequence | None = None):
        self.table = widgets.HTML()
        self.flagged: list[tuple[int, int]] = []  # (source stage, microbatch) whose shape changed
        self._usual: dict[int, tuple] = {}  # boundary -> the shape it carried first
        super().__init__([self.table])
        self.show(boundaries or [])

    def show(self, boundaries: Sequence) -> None:
        """Show one step's boundary records (`StepResult.boundary_shapes`)."""
        self.flagged = []
        rows = []
        for b in sorted(boundaries, key=lambda b: (b.source, b.microbatch)):
            usual = self._usual.setdefault(b.source, tuple(b.shape))
            changed = tuple(b.shape) != usual
            if changed:
                self.flagged.append((b.source, b.microbatch))
            note = f"shape changed (was {usual})" if changed else ""
            rows.append(([f"stage {b.source} → {b.source + 1}", b.microbatch, tuple(b.shape), b.dtype,
                          format_bytes(b.bytes), note], RED if changed else ""))
        caption = "activations that crossed each stage boundary"
        if self.flagged:
            caption += f": {len(self.flagged)} shape change(s), flagged red"
        self.table.value = table(["boundary", "microbatch", "shape", "dtype", "bytes", ""], rows, caption)


# ---------------------------------------------------------------- gradient flow


class GradientsView(widgets.VBox):
    """Gradient norm per stage and parameter (and parity difference); missing, zero or non-finite in red."""

    def __init__(self, grad_stats: dict | None = None, parity=None,
                 stage_of: Callable[[str], int] | None = None):
        self.table = widgets.HTML()
        self.red: dict[str, str] = {}
        super().__init__([self.table])
        if grad_stats is not None:
            self.show(grad_stats, parity, stage_of)

    def show(self, grad_stats: dict, parity=None, stage_of: Callable[[str], int] | None = None) -> None:
        """Show `StepResult.grad_stats`; `parity` is a `ParityReport` from `pipe.check_parity()`."""
        from pplab.rank.checks import check_gradient_flow

        self.red = dict(check_gradient_flow(grad_stats).failures)
        diffs = getattr(parity, "grad_diffs", {})
        for name in getattr(parity, "failing", []):
            self.red.setdefault(name, f"differs from one device by {diffs[name][0]:.2e}")
        compared = ["max |diff| vs one device"] if parity else []
        header = ["stage", "parameter", "grad norm", *compared, "status"]
        rows = []
        for name in sorted(grad_stats, key=lambda n: (stage_of(n) if stage_of else 0, n)):
            cells = ["" if stage_of is None else stage_of(name), name, f"{grad_stats[name]['norm']:.3e}"]
            if parity:
                cells.append(f"{diffs[name][0]:.1e}" if name in diffs else "missing")
            cells.append(self.red.get(name, "ok"))
            rows.append((cells, RED if name in self.red else ""))
        verdict = (f"gradient flow: {len(self.red)} of {len(grad_stats)} parameters in trouble (red)"
                   if self.red else f"gradient flow: all {len(grad_stats)} parameters have "
                                    "finite, non-zero gradients")
        self.table.value = (f"<div style='max-height:260px;overflow:auto'>"
                            f"{table(header, rows, verdict)}</div>")


# ---------------------------------------------------------------- memory and loss


class MemoryView(widgets.VBox):
    """In-flight activation bytes per rank over the step, and the loss step by step."""

    def __init__(self, timeline: Timeline | None = None):
        self.image = _image()
        self.loss_image = _image()
        self.losses: list[float] = []
        super().__init__([self.image, self.loss_image])
        if timeline is not None:
            self.show(timeline)

    def show(self, timeline: Timeline) -> None:
        """Draw the activations each rank holds for a backward, over `timeline`."""
        from pplab.views import viz

        if len(timeline):
            show_png(self.image, viz.plot_memory(timeline))

    def add_loss(self, loss: float, picture: bool = True) -> None:
        """Add one step's loss to the loss curve (drawn now, or by `draw_losses` later)."""
        self.losses.append(loss)
        if picture:
            self.draw_losses()

    def draw_losses(self) -> None:
        """Draw the loss curve."""
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        fig = Figure(figsize=(5.5, 2.2), layout="constrained")
        ax = fig.add_subplot()
        ax.plot(range(1, len(self.losses) + 1), self.losses, "o-", color="#D55E00")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.set_xlim(0.5, len(self.losses) + 0.5)
        ax.set_title("loss per step (a lab step applies no optimizer: flat unless "
                     "weights change)", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.spines[["top", "right"]].set_visible(False)
        show_png(self.loss_image, fig)


# ---------------------------------------------------------------- where each rank is


_WHERE_STYLE = ("<style>.pplab-where table{table-layout:fixed;width:100%;max-width:1000px}"
                ".pplab-where td{white-space:nowrap;overflow:hidden;text-overflow:ellipsis}"
                ".pplab-where th:nth-child(1){width:90px}.pplab-where th:nth-child(2){width:45%}"
                ".pplab-where th:nth-child(3){width:60px}</style>")


class WhereView(widgets.VBox):
    """What every rank is doing now; a rank that waits shows on whom and for
    what, turning red when stalled."""

    def __init__(self, n_ranks: int, stalled_after: float = 2.0, labels: list[str] | None = None):
        """`labels` names the rows (a mesh's ranks by their coordinates); default the rank numbers."""
        self.html = widgets.HTML()
        self.stalled_after = stalled_after
        super().__init__([self.html])
        self.reset(n_ranks, labels)

    def reset(self, n_ranks: int, labels: list[str] | None = None) -> None:
        """Forget every rank's state (a new pipeline, maybe with another number of ranks)."""
        self.n_ranks, self.labels = n_ranks, labels
        self.latest: dict[int, object] = {}  # rank -> its latest `Now`
        self.seen_at: dict[int, float] = {}  # rank -> when that `Now` reached this client
        self.states: dict[int, str] = {}  # rank -> "running", "waiting", "stalled", "done" or "idle"
        self.stalls: list[dict] = []  # every wait that lasted stalled_after or more, and how long
        self.render()

    def update(self, now, seen_at: float | None = None) -> None:
        """Take a rank's latest `pplab.trace.timeline.Now` (what it started, whom it waits on)."""
        before = self.latest.get(now.rank)
        if before is not None and before.waits_for and now.since >= before.since:  # (same step)
            self._settle(before, now.since - before.since)
        self.latest[now.rank] = now
        self.seen_at[now.rank] = time.monotonic() if seen_at is None else seen_at

    def _settle(self, wait, seconds: float) -> None:
        """A wait that ended: its length on the rank's own clock decides whether it was a stall.
        While it lasted, the client could only count from when it heard of it, and a busy client
        hears late: on a busy machine a wait of milliseconds would show as a stall."""
        logged = next((stall for stall in self.stalls if stall["note"] is wait), None)
        if seconds < self.stalled_after:
            if logged is not None:
                self.stalls.remove(logged)
        elif logged is not None:
            logged["seconds"] = seconds
        else:  # a stall the client never drew (it was busy the whole time)
            self._log_stall(wait, _waits_in_words(wait), seconds)

    def render(self, at: float | None = None) -> None:
        """Redraw, with how long each rank has been at its action as of `at` (monotonic seconds)."""
        rows = self._rows(at)
        last = ""
        if self.stalls:
            stall = self.stalls[-1]
            last = (f"<div style='{RED};font-size:12px'>last stall: rank {stall['rank']} waited "
                    f"{stall['seconds']:.1f} s in {_in_words(stall['doing'])}, for "
                    f"{stall['waits_for']}</div>")
        # Fixed columns, one line each (cut with an ellipsis): the table keeps its shape as ranks move on.
        self.html.value = (_WHERE_STYLE + "<div class='pplab-where'>"
                           + table(["rank", "doing", "for", "waits for"], rows, "where each rank is")
                           + "</div>" + last)

    def text(self) -> str:
        """The panel as lines of text, as of its last redraw (for logs and static notebooks)."""
        return "\n".join(f"{name if self.labels else f'rank {name}'}: {self.states.get(rank, 'idle')}"
                         + (f", {doing} for {held}" if held else f", {doing}" if doing != "idle" else "")
                         + (f", waiting for {waits}" if waits else "")
                         for rank, (name, doing, held, waits) in enumerate(self._cells))

    def _rows(self, at: float | None) -> list:
        """One (cells, style) row per rank; sets `states` (and `_cells`, for `text`)."""
        at = time.monotonic() if at is None else at
        rows = []
        for rank in range(self.n_ranks):
            now = self.latest.get(rank)
            name = self.labels[rank] if self.labels else rank
            if now is None:
                self.states[rank] = "idle"
                rows.append(([name, "idle", "", ""], "color:#888"))
                continue
            held = at - self.seen_at[rank]
            waits = _waits_in_words(now)
            if now.doing == "done":
                state, style = "done", "color:#888"
            elif now.waits_for:
                state = "stalled" if held >= self.stalled_after else "waiting"
                style = RED if state == "stalled" else AMBER
                if state == "stalled":
                    self._log_stall(now, waits, held)
            else:
                state, style = "running", ""
            self.states[rank] = state
            held_for = f"{held:.1f} s" if state != "done" else ""
            rows.append(([name, _in_words(now.doing), held_for, waits], style))
        self._cells = [cells for cells, _ in rows]
        return rows

    def _log_stall(self, now, waits: str, held: float) -> None:
        same = next((stall for stall in self.stalls if stall["note"] is now), None)
        if same is not None:
            same["seconds"] = held  # the same wait, longer
        else:
            self.stalls.append(dict(rank=now.rank, doing=now.doing, waits_for=waits, seconds=held, note=now))


def _waits_in_words(now) -> str:
    """Whom a `Now` waits on: 'rank 0: send of the activation of microbatch 1 on stage 0'; several joined."""
    from pplab.schedules import Action

    return "; ".join(f"rank {peer}: {Action.parse(text).describe()}" for peer, text in now.waits_for)


def _in_words(doing: str) -> str:
    """'1RECV_F0' as 'receive of the activation of microbatch 0 on stage 1 (1RECV_F0)'; batches joined."""
    from pplab.schedules import Action

    if doing in ("done", "idle"):
        return doing
    return "; ".join(f"{Action.parse(word).describe()} ({word})" for word in doing.split())
