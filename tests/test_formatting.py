"""One look for every report: byte sizes, aligned text tables and HTML tables."""

from pplab.base.formatting import ShownAsText, format_bytes, html_table, text_table


def test_bytes_read_in_the_largest_unit_they_fill():
    sizes = (0, 512, 16 * 2**10, 6 * 2**20, 3 * 2**30)
    assert [format_bytes(n) for n in sizes] == ["0 B", "512 B", "16.0 KiB", "6.0 MiB", "3.0 GiB"]


def test_a_text_table_aligns_to_the_right_only_the_columns_it_is_told():
    rows = [["gpipe", 1.5], ["1f1b", 12.25]]
    assert text_table(["schedule", "ms"], rows, right=[1]).splitlines() == [
        "schedule     ms",
        "gpipe       1.5",
        "1f1b      12.25",
    ]
    assert text_table(["schedule", "ms"], rows).splitlines()[2] == "1f1b      12.25"
    assert text_table(["schedule", "ms"], rows, right=True).splitlines()[2] == "    1f1b  12.25"


def test_an_html_table_escapes_its_cells_and_styles_the_rows_it_is_told():
    page = html_table(["a"], [["<b>"], ["x"]], ["first", "second"], row_styles=["color:red", ""])
    assert '<caption style="text-align: left">first<br>second</caption>' in page
    assert '<tr style="color:red"><td>&lt;b&gt;</td></tr><tr><td>x</td></tr>' in page
    assert "<caption" not in html_table(["a"], [["x"]])  # no caption, no empty caption box


def test_a_report_reads_the_same_as_text_and_as_repr():
    class Report(ShownAsText):
        def __str__(self):
            return "all good"

    assert repr(Report()) == "all good"
