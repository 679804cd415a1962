"""Pictures: every plot renders for every schedule, headless, to PNG and SVG."""

import ast
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless, as in CI

import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import pplab  # noqa: E402
from pplab import Event, Timeline  # noqa: E402
from pplab.planning.simulator import Costs, simulate  # noqa: E402
from pplab.schedules import build, theory  # noqa: E402
from pplab.views import viz  # noqa: E402

pytestmark = pytest.mark.quick  # starts no process (conftest makes sure)

SCHEDULES = [
    ("gpipe", 4, 8, 1),
    ("1f1b", 4, 8, 1),
    ("interleaved-1f1b", 4, 8, 2),
    ("zb-h1", 4, 8, 1),
    ("gpipe", 1, 1, 1),
    ("interleaved-1f1b", 8, 32, 3),
]


def saved(fig: Figure, tmp_path: Path, stem: str) -> list[Path]:
    """Save as PNG and SVG and return both paths, after checking they are real images."""
    paths = [tmp_path / f"{stem}.png", tmp_path / f"{stem}.svg"]
    for path in paths:
        viz.save(fig, path, dpi=50)  # a low resolution keeps the tests quick
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in paths[1].read_text()[:1000]
    return paths


@pytest.mark.parametrize("name, p, m, v", SCHEDULES, ids=lambda x: str(x))
def test_timeline_and_memory_render_for_every_schedule(tmp_path, name, p, m, v):
    timeline = simulate(build(name, p, m, v))
    fig = viz.plot_timeline(timeline, title=name)
    assert isinstance(fig, Figure)
    assert f"{timeline.bubble_fraction():.1%}" in fig.axes[0].get_title()
    saved(fig, tmp_path, f"timeline-{name}")
    memory = viz.plot_memory(timeline)
    assert len(memory.axes) == p
    saved(memory, tmp_path, f"memory-{name}")


def compute_labels(fig: Figure) -> list[str]:
    """The microbatch numbers written inside boxes (the per-rank bubbles end in
    %, under their 'idle' header)."""
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "idle" in texts  # the right margin's percentages say what they are
    return [text for text in texts if not text.endswith("%") and text != "idle"]


def test_every_box_is_numbered_when_boxes_are_wide():
    timeline = simulate(build("gpipe", 4, 8))
    labels = compute_labels(viz.plot_timeline(timeline))
    assert sorted(labels) == sorted(str(e.microbatch) for e in timeline.compute_events())


def test_numbers_are_left_out_when_boxes_are_too_narrow():
    timeline = simulate(build("interleaved-1f1b", 8, 32, 3))
    assert compute_labels(viz.plot_timeline(timeline)) == []


def test_idle_time_is_hatched_and_the_legend_names_every_kind():
    fig = viz.plot_timeline(simulate(build("zb-h1", 3, 4), Costs(latency=0.2)))
    hatches = {c.get_hatch() for c in fig.axes[0].collections}
    assert "///" in hatches
    legend = {t.get_text() for t in fig.legends[0].get_texts()}
    assert {"forward F", "input grad I", "weight grad W", "send", "idle"} <= legend


def test_plot_timeline_draws_on_a_given_axes():
    fig = Figure()
    ax = fig.add_subplot()
    assert viz.plot_timeline(simulate(build("1f1b", 2, 2)), ax=ax) is fig


def test_compare_timelines_shares_one_time_axis(tmp_path):
    predicted = simulate(build("1f1b", 4, 8))
    measured = Timeline([Event(e.rank, e.kind, e.stage, e.microbatch, 50 + 1.1 * e.start, 50 + 1.1 * e.end)
                         for e in predicted.events], predicted.n_ranks, "measured")
    fig = viz.compare_timelines(predicted, measured)
    top, bottom = fig.axes
    assert top.get_xlim() == bottom.get_xlim()
    assert top.get_xlim()[1] > 1.1 * predicted.step_time()  # the measured run is longer; both start at 0
    assert "simulated" in top.get_title() and "measured" in bottom.get_title()
    saved(fig, tmp_path, "compare")


def test_compare_timelines_shows_the_longer_one_whole_whichever_is_on_top():
    longer = simulate(build("1f1b", 4, 8))       # 1F1B's bubble is larger: its step is longer
    shorter = simulate(build("zb-h1", 4, 8))
    assert longer.step_time() > shorter.step_time()
    for pair in ((longer, shorter), (shorter, longer)):
        fig = viz.compare_timelines(*pair, titles=("top", "bottom"))
        for ax in fig.axes:
            assert ax.get_xlim()[1] >= longer.step_time(), "the longer timeline is cut off"


def test_memory_plot_uses_bytes_when_forwards_carry_them(tmp_path):
    timeline = Timeline([
        Event(0, "F", 0, 0, 0, 1, bytes=3 << 20), Event(0, "F", 0, 1, 1, 2, bytes=3 << 20),
        Event(0, "B", 0, 0, 2, 4), Event(0, "B", 0, 1, 4, 6),
    ])
    fig = viz.plot_memory(timeline)
    assert "bytes" in fig._suptitle.get_text()
    assert any("6.0 MiB" in t.get_text() for t in fig.axes[0].texts)
    saved(fig, tmp_path, "memory-bytes")


def gpipe_memory_like_the_lesson() -> Timeline:
    """GPipe on 2 ranks: the last rank holds more bytes per microbatch (6.0 MiB) than the first."""
    events = []
    for rank, size in ((0, 2.65), (1, 3.0)):
        for mb in range(2):
            events.append(Event(rank, "F", rank, mb, mb, mb + 1, bytes=int(size * (1 << 20))))
            events.append(Event(rank, "B", rank, mb, 2 + 2 * mb, 4 + 2 * mb))
    return Timeline(events)


@pytest.mark.parametrize("in_bytes", [True, False], ids=["bytes", "counts"])
def test_memory_plot_shows_every_ranks_whole_curve(in_bytes):
    timeline = gpipe_memory_like_the_lesson()
    if not in_bytes:
        timeline = Timeline([Event(e.rank, e.kind, e.stage, e.microbatch, e.start, e.end)
                             for e in timeline.events]
                            + [Event(1, "F", 1, 2, 1.5, 1.8), Event(1, "B", 1, 2, 8, 9)])
    fig = viz.plot_memory(timeline)
    for rank, ax in enumerate(fig.axes):
        drawn = max(max(line.get_ydata()) for line in ax.lines)
        bottom, top = ax.get_ylim()
        assert bottom == 0 and drawn < top, f"rank {rank}: peak {drawn} is cut off by the y limit {top}"
    assert fig.axes[0].get_ylim() == fig.axes[1].get_ylim()  # one scale, so ranks compare at a glance


def test_plot_bubbles_measured_against_theory(tmp_path):
    results = {}
    for name in ("gpipe", "1f1b", "zb-h1"):
        schedule = build(name, 4, 2)
        results[name] = (simulate(schedule), theory(schedule).bubble_fraction)
    results["interleaved-1f1b"] = (0.2, None)
    fig = viz.plot_bubbles(results)
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert "n/a" in labels  # zb-h1 with m < p and the interleaved entry have no theory
    assert f"{3 / 5:.1%}" in labels  # gpipe measured and theory, (p-1)/(m+p-1)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == list(results)
    saved(fig, tmp_path, "bubbles")


def test_public_names():
    assert pplab.simulate is simulate and pplab.Costs is Costs
    assert pplab.Event is Event and pplab.Timeline is Timeline
    # one path: the top
    assert pplab.views.viz is viz and not {"Event", "Timeline"} & set(pplab.trace.__all__)


# ---------------------------------------------------------------- layering


def imported_modules(module_name: str) -> set[str]:
    source = Path(pplab.__file__).parent.joinpath(*module_name.split(".")).with_suffix(".py").read_text()
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module)
    return names


@pytest.mark.parametrize("module, allowed_pplab", [
    ("trace.timeline", {"pplab.schedules.actions"}),  # which pass frees a forward's activations
    # the event model, the reader
    ("trace.__init__", {"pplab.trace", "pplab.trace.timeline", "pplab.trace.profiled",
                        "pplab.trace.flight_recorder",
                        "pplab.base.renames"}),  # (the moved names' warning)
    ("trace.profiled", {"pplab.trace.timeline"}),
    ("base.formatting", set()),
    ("planning.simulator", {"pplab.schedules", "pplab.schedules.communication", "pplab.schedules.compiled",
                            "pplab.trace.timeline",  # communication: the runtime's comm-batch rule
                            "pplab.base.config"}),  # Costs' fields are options
    ("views.viz", {"pplab.trace.timeline", "pplab.base.formatting"}),
    ("planning.search", {"pplab.schedules", "pplab.planning.simulator", "pplab.trace.timeline",
                         "pplab.base.formatting", "pplab.base.config",
                         "pplab.planning.list_scheduling", "pplab.planning.zero_bubble_heuristic",
                         "pplab.planning.exact"}),
    # (OR-Tools on use)
    ("planning.exact", {"pplab.schedules", "pplab.planning.simulator", "pplab.base.formatting"}),
    ("planning.list_scheduling", {"pplab.schedules", "pplab.planning.simulator", "pplab.trace.timeline"}),
    ("planning.zero_bubble_heuristic",
     {"pplab.schedules", "pplab.planning.simulator", "pplab.trace.timeline",
      "pplab.planning.list_scheduling"}),
    ("planning.prediction",
     {"pplab.schedules", "pplab.planning.simulator", "pplab.trace.timeline", "pplab.base.formatting",
      "pplab.base.machine"}),
    ("base.machine", set()),  # pure Python: what every floor may read
])
def test_modules_keep_to_their_floor(module, allowed_pplab):
    imports = imported_modules(module)
    assert {name for name in imports if name.startswith("pplab")} <= allowed_pplab
    forbidden = ("ipyparallel", "ipywidgets", "torch", "matplotlib.pyplot")
    assert not [name for name in imports if name.startswith(forbidden)]
