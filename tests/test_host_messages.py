"""Ranks that share a GPU send their messages through host memory (gloo moves CPU tensors only).

No CI machine has a GPU, so these tests force the same path on CPU (`host_messages=True`): every
message is copied into a host buffer of its own and out again, on both runtimes, for the tied
weight's sum and for evaluation's forward-only pass; results must equal the direct path's bitwise.
The GPU itself is checked by hand (bench/bench_gpu.py, ../shared/GPU.md).
"""

from __future__ import annotations

import pytest

import pplab
from pplab.data import batches
from pplab.models.llama import LlamaConfig
from pplab.session import RankPool
from ranks import pool

pytestmark = pytest.mark.slow


def _messages_go_through_host(pipeline_id):
    from pplab.rank.rank_context import rank_context
    from pplab.session.on_rank import built_pipeline

    runtime = built_pipeline(pipeline_id).runtime
    stage_classes = sorted({type(stage).__name__ for stage in getattr(runtime, "torch_stages", [])})
    return rank_context().host_messages, stage_classes


@pytest.fixture(scope="module")
def host_pool():
    with RankPool(2, host_messages=True) as started:
        yield started


@pytest.mark.parametrize("schedule, options", [
    ("1f1b", {}),
    ("zb-h1", {}),                                     # split backward: I and W apart
    ("1f1b", {"impl": "torch"}),
    ("zbv-zero-bubble", {"impl": "torch", "n_virtual": 2}),  # V: two stages per rank, one message kept local
])
def test_both_runtimes_stay_exact_with_messages_through_host_memory(host_pool, schedule, options):
    with host_pool.pipeline(LlamaConfig.tiny(), schedule, 4, **options) as pipe:
        parity, flow = pipe.check_parity(), pipe.check_gradient_flow()
        # (torch's stages: built by now)
        through_host = host_pool.run(_messages_go_through_host, pipe.pipeline_id)
    assert parity.passed and parity.loss_rel_diff == 0.0 and parity.max_abs_diff == 0.0, parity
    assert flow.passed, flow
    expected_class = ["HostMessagesRecordingStage"] if options.get("impl") == "torch" else []
    assert through_host == [(True, expected_class)] * 2


def test_training_through_host_memory_equals_the_direct_path_bitwise(host_pool):
    transformers = pytest.importorskip("transformers")
    from pplab.models.hf import HFModel

    # A tied weight: its gradients summed between the two ends, through the host too.
    config = HFModel.of(transformers.Qwen3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True))
    options = dict(batch_size=8, seq_len=16, eval_every=2, eval_batches=1, clip=1.0, show=False)
    runs = {}
    for name, ranks in (("host", host_pool), ("direct", pool(2))):
        with ranks.pipeline(config, "1f1b", 4) as pipe:
            runs[name] = pipe.train(3, **options)
    assert runs["host"].losses == runs["direct"].losses
    assert [r.grad_norm for r in runs["host"].records] == [r.grad_norm for r in runs["direct"].records]
    assert [r.eval_loss for r in runs["host"].records] == [r.eval_loss for r in runs["direct"].records]
    assert any(r.eval_loss is not None for r in runs["host"].records)  # evaluation's own messages ran


def test_a_lab_says_where_its_messages_go_and_its_ranks_send_them_so():
    batch = next(batches(8, 16, 0))
    with pplab.Lab(2, host_messages=True, verbose=False) as lab:
        assert lab.host_messages and lab.placement == (
            "gloo on cpu (messages through host memory, as ranks that share a GPU send them)")
        assert lab.run(_host_messages_on_rank) == [True, True]
        with lab.pipeline(LlamaConfig.tiny(), "1f1b", 4, impl="torch") as pipe:
            assert pipe.check_parity(batch).passed


def _host_messages_on_rank():
    from pplab.rank.rank_context import rank_context

    return rank_context().host_messages
