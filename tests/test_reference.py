"""The single-device reference: microbatched exactly like a pipeline, mean loss."""

import pytest
import torch

import pplab
from pplab.data import batches
from pplab.models.llama import loss_fn

pytestmark = pytest.mark.quick  # starts no process (conftest makes sure)

CONFIG = pplab.LlamaConfig.tiny()


def test_microbatched_reference_equals_full_batch_gradients():
    batch = next(batches(8, 16, seed=1))
    model = pplab.build_model(CONFIG)
    loss_fn(model(batch[0]), batch[1]).backward()   # equal microbatches, no padding: same mean
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}

    result = pplab.reference_step(CONFIG, batch, n_microbatches=4)
    assert len(result.microbatch_losses) == 4
    assert result.loss == pytest.approx(sum(result.microbatch_losses) / 4)
    assert result.grads.keys() == expected.keys()
    for name, grad in result.grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_reference_takes_a_list_of_microbatches_of_different_lengths():
    short, long = next(batches(2, 8, seed=2)), next(batches(2, 24, seed=3))
    result = pplab.reference_step(CONFIG, [short, long])
    model = pplab.build_model(CONFIG)
    expected = (loss_fn(model(short[0]), short[1]) + loss_fn(model(long[0]), long[1])) / 2
    assert result.loss == pytest.approx(expected.item(), rel=1e-6)
    with pytest.raises(ValueError, match="n_microbatches=3 but 2 microbatches"):
        pplab.reference_step(CONFIG, [short, long], n_microbatches=3)
