"""One cut, three frameworks: a balance written as torchtitan's module_fqns_per_model_part and as
Megatron's --pipeline-model-parallel-layout, read back the same, and a layout pplab's model cannot
have refused by what is wrong."""

import pytest

import pplab

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("balance", [(2, 6), (3, 5), (1, 2, 2, 3), (4,), (0, 3, 1)])
def test_a_balance_written_for_either_framework_reads_back_the_same(balance):
    for framework in ("torchtitan", "megatron"):
        written = pplab.layer_layout(balance, framework)
        assert pplab.balance_of_layout(written) == balance, (framework, written)


def test_the_layouts_place_the_embedding_first_and_the_head_and_loss_last():
    assert pplab.layer_layout((2, 3), "megatron") == "Et*2|t*3L"
    assert pplab.layer_layout((1, 2), "torchtitan") == [["tok_embeddings", "layers.0"],
                                                       ["layers.1", "layers.2", "norm", "output"]]
    # a searched balance, written for both
    found = pplab.search_balance(2, 4, pplab.Costs(forward=(1, 1, 1, 1, 1, 3)), memory_limit=None)
    assert pplab.balance_of_layout(pplab.layer_layout(found.balance, "megatron")) == found.balance


def test_megatrons_repetitions_commas_and_empty_stages_are_read():
    assert pplab.balance_of_layout("Et*3|(tt|)*2,t*2L") == (3, 2, 2, 2)
    assert pplab.balance_of_layout("E||t|L") == (0, 0, 1, 0)
    assert pplab.balance_of_layout("Et |\n\ttL") == (1, 1)  # whitespace is cosmetic, as commas are


@pytest.mark.parametrize("written, said", [
    ("tE|tL", r"stage 0 holds 'tE'; pplab's model has one embedding \(E\), first on stage 0"),
    ("EEt|tL", r"stage 0 holds 'EEt'; pplab's model has one embedding"),
    ("Et|Lt", r"stage 1 holds 'Lt'; pplab's model has one loss \(L\), last on stage 1"),
    ("Et|tLL", r"stage 1 holds 'tLL'"),
    ("Et|tm|L", r"stage 1 holds 'm'; pplab's model has E .* t .* and L"),
    ("t|tL", r"stage 0 holds 't'; pplab's model has one embedding"),
    ("E(t|L", r"a repetition pplab cannot read"),
    ([["tok_embeddings", "layers.1"], ["layers.0", "norm", "output"]], r"the layers are \[1, 0\]"),
    ([["layers.0"], ["tok_embeddings", "layers.1", "norm", "output"]], r"'tok_embeddings' first in"),
    ([["tok_embeddings", "layers.0", "norm"], ["layers.1", "output"]], r"'norm', 'output' last in the last"),
    ([["tok_embeddings", "layers.0"], ["norm", "layers.1", "norm", "output"]], r"'norm' is in part 1, place"),
    ([["tok_embeddings", "blocks.0"], ["norm", "output"]], r"part 0 holds 'blocks.0'"),
    (42, r"give Megatron's layout string"),
])
def test_a_layout_pplabs_model_cannot_have_is_refused_naming_what_is_wrong(written, said):
    with pytest.raises(ValueError, match=said):
        pplab.balance_of_layout(written)


def test_another_framework_is_refused():
    with pytest.raises(ValueError, match=r"framework='deepspeed': give one of 'torchtitan', 'megatron'"):
        pplab.layer_layout((1, 1), "deepspeed")
