"""A torchtitan job's TOML read as a pplab run: what pplab models mapped field by field, every
other field listed (never dropped), a schedule CSV taken, and `pplab simulate --torchtitan-config`."""

from __future__ import annotations

import json

import pytest

from pplab.planning.simulator import Costs, simulate
from pplab.schedules import Schedule, build, from_torch
from pplab.session import read_torchtitan
from pplab.session.run import RunConfig

pytestmark = pytest.mark.quick

# torchtitan's llama3 debug job, as its train_configs write it.
DEBUG_JOB = """
[job]
dump_folder = "./outputs"
description = "Llama 3 debug training"

[model]
name = "llama3"
flavor = "debugmodel"

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 2
decay_type = "linear"
min_lr_factor = 0.0

[training]
local_batch_size = 8
seq_len = 2048
max_norm = 1.0
steps = 10
dataset = "c4_test"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 2
pipeline_parallel_schedule = "Interleaved1F1B"
pipeline_parallel_microbatch_size = 2
context_parallel_degree = 2

[activation_checkpoint]
mode = "selective"
"""


def test_a_torchtitan_job_reads_as_a_run_and_lists_what_pplab_does_not_model(tmp_path):
    path = tmp_path / "debug.toml"
    path.write_text(DEBUG_JOB)
    job = read_torchtitan(path)
    c = job.config
    assert (c.pp, c.dp, c.tp, c.schedule, c.impl, c.n_microbatches, c.n_virtual) == \
        (2, 1, 1, "interleaved-1f1b", "torch", 4, 2)
    assert (c.batch_size, c.seq_len, c.steps, c.clip, c.lr, c.eps, c.warmup, c.min_lr) == \
        (8, 2048, 10, 1.0, 8e-4, 1e-8, 2, 0.0)
    assert (job.model.num_hidden_layers, job.model.hidden_size, job.model.intermediate_size) == (6, 256, 768)
    assert job.unmodeled == {"job.dump_folder": "./outputs", "job.description": "Llama 3 debug training",
                             "lr_scheduler.decay_type": "linear", "training.dataset": "c4_test",
                             "parallelism.context_parallel_degree": 2,
                             "activation_checkpoint.mode": "selective"}
    assert "parallelism.data_parallel_replicate_degree" in job.read  # 1: nothing to model
    text = job.text()
    assert "pp=2 x dp=1 x tp=1, schedule interleaved-1f1b, 4 microbatches, 2 stage(s) per rank" in text
    assert "not modeled by pplab (6): job.dump_folder = './outputs'" in text
    assert "context_parallel_degree = 2" in text
    assert "data_parallel_shard_degree = -1" in text  # the assumption is said
    with pytest.warns(UserWarning, match=r"not modeled by pplab: job.dump_folder, .*training.dataset"):
        assert RunConfig.from_torchtitan(path) == c


@pytest.mark.quick
def test_a_misspelt_key_is_refused_with_the_key_meant_and_a_job_without_a_model_says_so(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text("[parallelism]\npipeline_paralel_degree = 4\n")
    with pytest.raises(ValueError, match=r"\[parallelism\] pipeline_paralel_degree is not a torchtitan key; "
                                         r"did you mean pipeline_parallel_degree\?"):
        read_torchtitan(path)
    path.write_text("[parallelism]\npipeline_parallel_degree = 2\n[training]\nglobal_batch_size = 64\n"
                    "[fancy]\nwhatever = 1\n")  # a key torchtitan has, and a table pplab does not read
    job = read_torchtitan(path)
    assert job.unmodeled == {"training.global_batch_size": 64, "fancy.whatever": 1}
    assert "no [model] name and flavor: the model's sizes are not read" in job.text()
    assert "None/None" not in job.text()


def test_a_jobs_schedule_csv_is_the_schedule_and_what_does_not_fit_is_refused(tmp_path):
    found = from_torch("zbv-zero-bubble", 2, 4, 2)
    found.to_torch_csv(tmp_path / "found.csv")
    job = tmp_path / "job.toml"
    job.write_text('[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = '
                   '"_PipelineScheduleRuntime"\npipeline_parallel_schedule_csv = '
                   '"found.csv"\n[training]\nlocal_batch_size = 4\n')
    c = read_torchtitan(job).config
    assert isinstance(c.schedule, Schedule)
    assert c.schedule.compute_only().actions == found.compute_only().actions
    assert c.n_virtual == 2
    job.write_text('[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule_csv = '
                   '"found.csv"\n[training]\nlocal_batch_size = 8\n')
    with pytest.raises(ValueError,
                       match=r"found.csv is for 2 ranks and 4 microbatches, the job for .* and 8"):
        read_torchtitan(job)
    job.write_text('[parallelism]\npipeline_parallel_schedule = "PipelineScheduleMulti"\n')
    with pytest.raises(ValueError,
                       match=r"runs the schedule of a CSV, and pipeline_parallel_schedule_csv is not"):
        read_torchtitan(job)
    job.write_text('[parallelism]\npipeline_parallel_microbatch_size = 3\n[training]\nlocal_batch_size = 8\n')
    with pytest.raises(ValueError, match=r"local_batch_size = 8 is not a multiple of .*microbatch_size = 3"):
        read_torchtitan(job)
    job.write_text("[parallelism\n")
    with pytest.raises(ValueError, match=r"job.toml is not TOML"):
        read_torchtitan(job)


def test_pplab_simulate_shows_a_torchtitan_jobs_schedule_with_its_layers(tmp_path, capsys):
    from pplab.cli import main

    path = tmp_path / "debug.toml"
    path.write_text(DEBUG_JOB)
    assert main(["simulate", "--torchtitan-config", str(path), "--out", str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "not modeled by pplab (6)" in said and "the stages hold 2, 2, 1, 1 of the 6 layers" in said
    numbers = json.loads((tmp_path / "out" / "interleaved-1f1b.json").read_text())
    expected = simulate(build("interleaved-1f1b", 2, 4, 2),
                        Costs(forward=(2, 2, 1, 1), backward=(4, 4, 2, 2)))
    assert numbers["step_time"] == expected.step_time()
    assert numbers["torchtitan"]["unmodeled"]["training.dataset"] == "c4_test"
    assert main(["simulate", "1f1b", "--torchtitan-config", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "--torchtitan-config brings the schedule and its sizes" in capsys.readouterr().err
