"""The report layer: what a command prints and writes is assembled here, once."""

import pandas as pd
import pytest

from bnprobe.core.errors import BNProbeError
from bnprobe.reports import Report, file_stem, html_report, output_dir, write_result
from bnprobe.reports.compare import REPORT_FORMATS, report_files, report_formats


def _report() -> Report:
    return Report("title: PASS", ["table", "more"], ["a note"], True, {"k": float("nan")}, "gradcheck-x",
                  pd.DataFrame({"a": [1, 2]}), "# title\n")


def test_lines_are_title_blocks_notes_then_files():
    r = _report()
    assert r.lines() == ["title: PASS", "table", "more", "note: a note"]
    assert r.lines([]) == [*r.lines(), "wrote "]


def test_write_result_writes_csv_json_markdown_and_never_over_a_file_without_force(tmp_path):
    sink = output_dir(tmp_path / "out", "")
    paths = write_result(sink, _report())
    assert sorted(p.name for p in paths) == ["gradcheck-x.csv", "gradcheck-x.json", "gradcheck-x.md"]
    assert (tmp_path / "out" / "gradcheck-x.json").read_text() == '{\n  "k": "nan"\n}'
    assert (tmp_path / "out" / "gradcheck-x.csv").read_text() == "a\n1\n2\n"
    again = output_dir(tmp_path / "out", "")
    with pytest.raises(BNProbeError, match="exist"):
        again.claim("gradcheck-x.csv")
        write_result(again, _report())
    forced = output_dir(tmp_path / "out", "", force=True)
    assert len(write_result(forced, _report())) == 3


def test_file_stems_hold_no_separator():
    assert file_stem("gradcheck", "dump:runs/a", "fp16") == "gradcheck-dump_runs_a-fp16"
    assert "/" not in file_stem("overflow", "pkg.mod:Kernel/x", "recorded")


def test_report_formats_are_checked_and_name_their_files():
    assert report_formats(" csv, md ") == ("csv", "md")
    with pytest.raises(BNProbeError, match="unknown report format.*pdf"):
        report_formats("csv,pdf")
    assert report_files(("md",)) == ["summary.md"]
    assert len(report_files(REPORT_FORMATS)) == 6


def test_html_body_goes_last_inside_the_page():
    page = html_report("t <x>", "intro", [("Findings", "none")], body="<h2>fig</h2>")
    assert page.endswith("<h2>fig</h2></body></html>\n") and "t &lt;x&gt;" in page
