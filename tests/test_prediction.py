"""Predict before you run: per-stage costs and bytes measured on one device, predictions from them."""

import pytest

import pplab
from pplab.data import batches
from pplab.planning.prediction import Profile, StageProfile, predict
from pplab.planning.simulator import Costs
from pplab.rank.profiler import profile
from pplab.rank.rank_pipeline import PipelineSpec, run_jobs_on_rank, split_for_ranks
from pplab.schedules import build, theory
from pplab.session.results import merge_steps
from ranks import run_ranks

CONFIG = pplab.LlamaConfig.tiny()
MICROBATCH_SIZE, SEQ_LEN = 2, 32


@pytest.fixture(scope="module")
def two_stages() -> Profile:
    return profile(CONFIG, MICROBATCH_SIZE, SEQ_LEN, 2, repeats=3, show=False)


def test_profile_measures_positive_costs_and_the_tensors_bytes(two_stages):
    first, last = two_stages.stages
    for stage in (first, last):
        assert stage.forward > 0 and stage.backward > 0 and stage.weight_grad > 0
        assert stage.activation_bytes > 0
    assert first.input_grad == 0  # token ids have no gradient: W is the whole backward
    assert last.input_grad > 0
    assert first.output_bytes == MICROBATCH_SIZE * SEQ_LEN * CONFIG.hidden_size * 4 and last.output_bytes == 0
    for index, stage in enumerate(two_stages.stages):
        module = pplab.build_stage(CONFIG, index, 2)
        assert stage.parameter_bytes == sum(p.numel() * 4 for p in module.parameters())
        assert stage.static_bytes == 4 * stage.parameter_bytes  # parameters, gradients, AdamW's two moments
    assert "(I+W)/B" in str(two_stages) and "<table>" in two_stages._repr_html_()


def uniform(n_stages: int, activation_bytes: int = 1000) -> Profile:
    stage = StageProfile(forward=1.0, backward=2.0, input_grad=1.0, weight_grad=1.0, parameter_bytes=10,
                         activation_bytes=activation_bytes, output_bytes=100)
    return Profile((stage,) * n_stages, MICROBATCH_SIZE, SEQ_LEN)


@pytest.mark.quick
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_uniform_costs_give_the_textbook_bubble_and_activation_peaks(name):
    p, m = 4, 8
    schedule = build(name, p, m)
    prediction = predict(schedule, uniform(p))
    expected = theory(schedule, Costs(forward=1.0, backward=2.0))
    assert prediction.bubble == pytest.approx(expected.bubble_fraction)
    held = [m] * p if name == "gpipe" else [min(p - r, m) for r in range(p)]
    if name != "zb-h1":  # ZB-H1 holds what 1F1B holds until its W passes release it
        assert list(prediction.peak_activation_bytes) == [1000 * n for n in held]
    assert list(prediction.static_bytes) == [40] * p
    assert list(prediction.peak_bytes) == [s + a for s, a in zip(prediction.static_bytes,
                                                                 prediction.peak_activation_bytes)]


@pytest.mark.quick
def test_predict_takes_costs_and_a_profile_for_the_bytes():
    schedule = build("1f1b", 2, 4)
    plain = predict(schedule, Costs(forward=1.0, backward=2.0))
    assert plain.step_time == pytest.approx((4 + 1) * 3.0) and set(plain.peak_activation_bytes) == {0}
    with_bytes = predict(schedule, Costs(forward=1.0, backward=2.0), memory=uniform(2))
    assert with_bytes.peak_activation_bytes == (2000, 1000)
    with pytest.raises(ValueError, match="the profile has 3 stages but the schedule '1f1b' has 2"):
        predict(schedule, uniform(3))


def test_profile_refuses_bad_sizes_before_measuring():
    with pytest.raises(ValueError, match="n_stages=9 is more than n_layers=8"):
        profile(CONFIG, 2, 32, 9, show=False)
    with pytest.raises(ValueError, match="seq_len=512 exceeds max_position_embeddings=256"):
        profile(CONFIG, 2, 512, 2, show=False)


@pytest.mark.quick
def test_a_hop_measurement_refuses_bad_counts_before_any_message():
    from pplab.rank.profiler import hop_costs_on_rank

    with pytest.raises(ValueError, match=r"warmup=0 must be at least 1, e.g. warmup=10"):
        hop_costs_on_rank(0, 2, 1024, warmup=0)  # no process group needed: refused first
    with pytest.raises(ValueError, match=r"repeats=2.5 must be a whole number"):
        hop_costs_on_rank(0, 2, 1024, repeats=2.5)


def test_measured_activation_peaks_land_on_the_prediction(two_stages):
    """Real mode (no padding), 2 ranks: each rank's peak of held activation bytes within 5 %."""
    m = 4
    specs = [PipelineSpec.create(CONFIG, name, 2, m) for name in ("gpipe", "1f1b")]
    batch = next(batches(MICROBATCH_SIZE * m, SEQ_LEN))
    per_rank = run_ranks(2, run_jobs_on_rank, [(spec, split_for_ranks(spec, batch)) for spec in specs],
                         False, timeout=120)
    for job, spec in enumerate(specs):
        measured = merge_steps([per_rank[rank][job] for rank in range(2)]).timeline
        predicted = predict(spec.schedule, two_stages)
        for rank in range(2):
            assert measured.peak_inflight_bytes(rank) == pytest.approx(predicted.peak_activation_bytes[rank],
                                                                       rel=0.05), (spec.schedule.name, rank)


@pytest.mark.quick
def test_a_link_whose_late_receive_waits_a_hop_is_a_rendezvous_in_the_prediction():
    """`with_link` reads how a message moves off the hop measurement: a receive posted after
    its message was sent that still waits more than half a hop means a rendezvous, and the
    prediction then holds messages until their receives are posted (a compute-only schedule
    gets its sends and receives added)."""
    stage = StageProfile(forward=1.0, backward=2.0, input_grad=1.0, weight_grad=1.0, parameter_bytes=4,
                         activation_bytes=8, output_bytes=8)
    bare = Profile((stage, stage), 1, 1)
    hop = {"pplab": 2.1, "send": 0.1}
    assert bare.with_link(hop).link == "buffered"  # measured before late receives were
    assert bare.with_link({**hop, "late_receive": 0.05}).link == "buffered"
    rendezvous = bare.with_link({**hop, "late_receive": 1.9})
    assert rendezvous.link == "rendezvous" and rendezvous.costs(False).link == "rendezvous"
    gpipe = build("gpipe", 2, 4)
    assert predict(gpipe.compute_only(), rendezvous).step_time == predict(gpipe, rendezvous).step_time
    assert predict(gpipe, rendezvous).step_time > predict(gpipe, bare.with_link(hop)).step_time
    assert "rendezvous link" in predict(gpipe, rendezvous).how


@pytest.mark.quick
def test_a_prediction_says_what_a_busy_machine_does_to_it():
    from dataclasses import replace

    from pplab.base.machine import MachineLoad

    schedule, profiled = build("1f1b", 4, 8), replace(uniform(4), machine=MachineLoad(8, 0.0, 1.0))
    quiet = predict(schedule, profiled, machine=MachineLoad(8, 0.5, 1.0))
    assert (quiet.notes, quiet.shared_step_time) == ((), None)
    # 4 ranks, 1.5 cores free: 4 x 8 x (1 + 2) s of compute over 1.5 cores, longer than the schedule's step
    crowded = predict(schedule, profiled, machine=MachineLoad(2, 0.5, 1.0))
    assert crowded.shared_step_time == pytest.approx(96 / 1.5)
    assert crowded.shared_step_time > crowded.step_time
    assert "4 ranks on 1.5 free core(s)" in str(crowded) and "take turns" in crowded.notes[0]
    # the same cores, but each thread now gets half of one: every cost doubles, and it is said
    slower = predict(schedule, profiled, machine=MachineLoad(8, 3.0, 0.5))
    assert slower.shared_step_time == pytest.approx(2 * slower.step_time)
    assert "load changed since the profile" in slower.notes[0] and "2.00x as long" in slower.notes[0]


def test_a_labs_calibration_turns_a_profile_into_its_costs_and_says_how_sure(two_stages):
    from pplab.planning import prediction
    from ranks import pool

    ranks = pool(2)
    ranks._calibration = None
    made = ranks.calibration  # measured on first use, then kept
    assert ranks.calibration is made and prediction.last_calibration is made
    assert made.n_ranks == 2 and made.device == "cpu" and made.scale > 0 and made.fixed >= 0
    assert made.overhead >= 0 and made.latency >= 0 and 0 <= made.spread < 1
    assert "64 wide at 8 and 256 wide at 2 x 64 tokens" in made.probe
    assert "calibration of 2 ranks on cpu" in str(made)
    schedule = build("1f1b", 2, 4)
    on_lab = predict(schedule, two_stages, lab=ranks)
    costs = made.costs(two_stages, schedule)  # each compute as a rank runs it, plus the runtime's time
    assert costs.compute_time(pplab.schedules.Kind.F, 0) == pytest.approx(
        made.scale * two_stages.stages[0].forward + made.fixed + made.overhead)
    assert costs.latency == made.latency and on_lab.uncertainty == made.spread
    assert f"± {made.spread:.0%}" in str(on_lab) and "as this lab runs them" in on_lab.how
    alone = predict(schedule, two_stages)  # no lab: what is left out, and what the last calibration said
    assert "without a lab" in alone.left_out and "this machine's last calibration" in alone.left_out
    assert f"left out: {alone.left_out}" in str(alone) and not on_lab.left_out
    with pytest.raises(ValueError, match="the lab has 2 ranks and schedule '1f1b' 4"):
        predict(build("1f1b", 4, 4), two_stages, lab=ranks)
    with pytest.raises(ValueError, match="give a Profile"):
        predict(schedule, Costs(), lab=ranks)
    one_device = Costs(forward=[0.004, 0.006], backward=[0.008, 0.012])  # search ranks them as the lab runs
    as_run = made.apply(one_device)
    assert as_run.forward[1] == pytest.approx(made.scale * 0.006 + made.fixed + made.overhead)
    split = made.apply(Costs(forward=0.004, input_grad=0.003, weight_grad=0.005))  # B stays I + W
    assert split.backward == pytest.approx(split.input_grad + split.weight_grad)
    found = pplab.search(2, 4, one_device, lab=ranks, improve_seconds=0, show=False)
    ranked_alone = pplab.search(2, 4, as_run, improve_seconds=0, show=False)
    assert found.step_time == pytest.approx(ranked_alone.step_time)
