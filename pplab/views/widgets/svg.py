"""A per-rank Gantt chart as SVG text: what the live timeline draws while a step runs.

Matplotlib takes about 0.3 s to render a timeline to PNG on a laptop core, which is
CPU the ranks need while they run; building this SVG takes well under a millisecond
(bench/bench_dashboard.py measures both). So a step in progress is drawn as SVG
several times a second, and the finished step as the full matplotlib picture.
"""

from __future__ import annotations

import html

from pplab.trace.timeline import Timeline

ROW = 18  # pixels per rank row
LABEL_WIDTH = 56  # pixels left of the time axis for "rank r"
IDLE = "#f1f1f1"
IDLE_COLUMN = 36  # pixels right of the boxes for each rank's idle share (a finished step)


def timeline_svg(measured: Timeline | None, predicted: Timeline | None = None,
                 colours: dict[str, str] | None = None, width: int = 900,
                 labels: dict[str, str] | None = None, idle: bool = False,
                 rank_labels: list[str] | None = None) -> str:
    """Measured (and predicted, above it) per-rank boxes on one time axis, as an SVG string;
    with `labels` (kind -> words), a legend of the kinds drawn under the axis; with `idle` (a
    finished step: a running one's share would mislead), each rank's idle share at its row's end."""
    colours = colours or {}
    parts = [(t, t.label or "") for t in (predicted, measured) if t is not None and len(t)]
    measured_index = len(parts) - 1 if measured is not None and len(measured) else None
    if not parts:
        return "<div style='color:#888'>no events yet</div>"
    parts = [(t.normalised(), label) for t, label in parts]
    until = max(t.end for t, _ in parts) or 1.0
    # `rank_labels` name the measured rows (a mesh's 'rank 3 · pp1 dp1'); the boxes start after the longest.
    left = max([LABEL_WIDTH, *(6 * len(name) + 8 for name in rank_labels or [])])
    scale = (width - left - 8 - (IDLE_COLUMN if idle else 0)) / until
    shapes, y = [], 0
    for index, (timeline, label) in enumerate(parts):
        shapes.append(f"<text x='0' y='{y + 12}' font-size='12' "
                      f"font-weight='bold'>{html.escape(label)}</text>")
        if idle:
            shapes.append(f"<text x='{width - 4}' y='{y + 12}' font-size='10' text-anchor='end' "
                          f"fill='#555'>idle</text>")
        y += 18
        named = rank_labels if index == measured_index and rank_labels else None
        for rank in range(timeline.n_ranks):
            name = named[rank] if named else f"rank {rank}"
            shapes.append(f"<text x='0' y='{y + 13}' font-size='11'>{html.escape(name)}</text>")
            shapes.append(f"<rect x='{left}' y='{y}' width='{until * scale:.1f}' height='{ROW - 4}' "
                          f"fill='{IDLE}'/>")
            for event in timeline.of_rank(rank):
                shapes.append(_box(event, y, scale, colours, left))
            if idle:
                shapes.append(f"<text x='{width - 4}' y='{y + 11}' font-size='10' text-anchor='end' "
                              f"fill='#555'>{timeline.bubble_fraction(rank):.0%}</text>")
            y += ROW
        y += 6
    ticks = _ticks(until, scale, y, left)
    # The axis says its unit: the simulator's own label means cost units, anything else seconds.
    unit = "cost units" if all(label == "simulated" for _, label in parts) else "time (s)"
    ticks += (f"<text x='{width - 4}' y='{y + 15}' font-size='10' text-anchor='end' fill='#444'>"
              f"{unit}</text>")
    height = y + 20
    if labels:
        kinds = {event.kind for timeline, _ in parts for event in timeline.events}
        legend, height = _legend(kinds, colours, labels, height + 4, left)
        ticks += legend
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
            f"font-family='sans-serif'>{''.join(shapes)}{ticks}</svg>")


def _legend(kinds: set[str], colours: dict[str, str], labels: dict[str, str], y: float,
            left: float) -> tuple[str, float]:
    """One row of swatches for the kinds drawn (a send or a receive once, whichever way it went)."""
    entries = dict.fromkeys(labels.get(kind, kind) for kind in labels if kind in kinds)  # the legend's order
    entries.update(dict.fromkeys(sorted(labels.get(kind, kind) for kind in kinds - labels.keys())))
    colour_of = {labels.get(kind, kind): colours.get(kind, "#999999") for kind in kinds}
    parts, x = [], left
    for words in entries:
        parts.append(f"<rect x='{x}' y='{y}' width='12' height='8' fill='{colour_of[words]}'/>"
                     f"<text x='{x + 16}' y='{y + 8}' font-size='10' fill='#444'>{html.escape(words)}</text>")
        x += 28 + 6 * len(words)
    return "".join(parts), y + 16


def _box(event, y: float, scale: float, colours: dict[str, str], left: float) -> str:
    x = left + event.start * scale
    w = max(event.duration * scale, 0.5)
    colour = colours.get(event.kind, "#999999")
    if event.is_comm:  # a thin strip under the row: time spent on the wire
        return f"<rect x='{x:.1f}' y='{y + ROW - 7}' width='{w:.1f}' height='3' fill='{colour}'/>"
    title = f"<title>rank {event.rank} {event.kind} stage {event.stage} microbatch {event.microbatch}</title>"
    label = ""
    if event.microbatch is not None and w >= 7 * len(str(event.microbatch)) + 2:
        label = (f"<text x='{x + w / 2:.1f}' y='{y + 11}' font-size='10' text-anchor='middle'>"
                 f"{event.microbatch}</text>")
    return (f"<g><rect x='{x:.1f}' y='{y}' width='{w:.1f}' height='{ROW - 8}' fill='{colour}' "
            f"stroke='white' stroke-width='0.5'/>{label}{title}</g>")


def _ticks(until: float, scale: float, y: float, left: float) -> str:
    step = _nice_step(until / 6)
    marks, t = [], 0.0
    while t <= until + 1e-12:
        x = left + t * scale
        marks.append(f"<line x1='{x:.1f}' y1='{y}' x2='{x:.1f}' y2='{y + 4}' stroke='#444'/>"
                     f"<text x='{x:.1f}' y='{y + 15}' font-size='10' text-anchor='middle'>{t:g}</text>")
        t += step
    return "".join(marks)


def _nice_step(rough: float) -> float:
    """1, 2 or 5 times a power of ten, at least `rough`."""
    import math

    if rough <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(rough))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= rough)
