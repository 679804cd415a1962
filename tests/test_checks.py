"""Check reports read well: short plain-text lines for terminals, a table for notebooks."""

import pytest

from pplab.rank.checks import GradientFlowReport, ParityReport

pytestmark = pytest.mark.quick  # starts no process (conftest makes sure)

LONGEST_LINE = 90  # a notebook cell wraps longer lines, mid-word


def failing_parity() -> ParityReport:
    return ParityReport(4.891439914703369, 4.891439914703369,
                        {"layers.0.mlp.up_proj.weight": (0.0, 0.0), "embed_tokens.weight": (3e-4, 1e-2)},
                        ["lm_head.weight"], loss_rtol=1e-6, grad_atol=1e-5)


def test_parity_report_text_is_short_lines_verdict_first():
    passed = ParityReport(4.5, 4.5, {"norm.weight": (0.0, 0.0)}, [], 1e-6, 1e-5)
    assert str(passed).splitlines() == [
        "parity PASSED",
        "  loss 4.50000000 vs reference 4.50000000 (relative difference 0.0e+00, tolerance 1e-06)",
        "  gradients: largest |difference| 0.0e+00 over 1 parameters (tolerance 1e-05)",
    ]
    lines = str(failing_parity()).splitlines()
    assert lines[0] == "parity FAILED"
    assert lines[3:] == ["  embed_tokens.weight: max abs diff 3.00e-04",
                         "  lm_head.weight: no gradient from the pipeline"]
    assert max(map(len, lines)) <= LONGEST_LINE
    assert repr(failing_parity()) == str(failing_parity())


def test_parity_report_html_puts_each_fact_on_its_own_line_and_lists_every_parameter():
    page = failing_parity()._repr_html_()
    caption = page.split("<caption")[1].split("</caption>")[0]
    assert caption.count("<br>") == 2 and "parity FAILED<br>loss 4.89143991" in caption
    assert page.count("<tr>") == 1 + 3  # the header, two compared parameters, one missing
    assert "<td>embed_tokens.weight</td><td>3.00e-04</td><td>1.00e-02</td><td>FAIL</td>" in page
    assert "<td>lm_head.weight</td>" in page


def test_gradient_flow_report_names_each_failure_on_its_own_line():
    report = GradientFlowReport({"layers.1.mlp.down_proj.weight": "gradient is all zero"}, 3,
                                {"layers.1.mlp.down_proj.weight": 0.0, "norm.weight": 1.0})
    assert str(report).splitlines() == ["gradient flow FAILED for 1 of 3 parameters:",
                                        "  layers.1.mlp.down_proj.weight: gradient is all zero"]
    assert "<td>norm.weight</td><td>1.000e+00</td><td>ok</td>" in report._repr_html_()
