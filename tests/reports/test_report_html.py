"""compare-precision's report.html as a person sees it, in a real browser (headless Chromium, where installed; .ci/run
installs it and sets BNPROBE_REQUIRE_BROWSER=1, which turns a missing browser from a skip into a failure): at 1400 px
no table is clipped or wider than its box and the page is no wider than the window, no cell grows into a tall narrow
column, the long table stays in the CSV, and the page prints on few pages; its headings are words, each explained;
the failing outputs come worst first, sort by a click on a heading and filter by adapter, format and output, in one
self-contained file that shows every row without JavaScript."""

import html
import json
import math
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from bnprobe.engine.cases import stress_cases
from bnprobe.checks.compare.precision import compare_precision
from bnprobe.reports.compare import COLUMNS, write_report

BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
# CI must test the page in a real browser: there a missing one fails the browser tests instead of skipping them
REQUIRED = os.environ.get("BNPROBE_REQUIRE_BROWSER", "") not in ("", "0")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# after the page has laid out: its width, the window's, the tables wider than their box, the tallest cell
PROBE = """<script>
window.addEventListener('load', () => {
  const cut = [...document.querySelectorAll('div.wide')].filter(d => d.scrollWidth > d.clientWidth + 1).length;
  const tall = Math.max(0, ...[...document.querySelectorAll('td')].map(td => td.getBoundingClientRect().height));
  document.body.setAttribute('data-probe', [document.documentElement.scrollWidth, window.innerWidth, cut,
                                            Math.round(tall)].join(' '));
});
</script></body>"""


def need_browser() -> None:
    """Skip without a browser, or fail where BNPROBE_REQUIRE_BROWSER says one is required (CI)."""
    if BROWSER is None:
        why = "no Chromium on this machine (chromium, chromium-browser or google-chrome on PATH)"
        if REQUIRED:
            pytest.fail(f"{why}, and BNPROBE_REQUIRE_BROWSER is set: the report page must be tested in a browser")
        pytest.skip(f"{why}; .ci/run installs it")


def browser(tmp_path, *args):
    return subprocess.run([BROWSER, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A report with failing, worse-than-bench and format-warned rows (the built-in kernels on stress inputs)."""
    cases = [c for c in stress_cases() if c.name in ("stress/mean/std=1000", "stress/mean/std=10000",
                                                     "stress/near-fp16-max", "stress/var-near-eps")]
    r = compare_precision(["ascend-tbe", "ascend-bnv3", "emulated:fp16-acc16", "emulated:bf16-acc16"], None, cases)
    out = tmp_path_factory.mktemp("report")
    write_report(r, out)
    return out, r


def test_the_page_holds_the_summary_and_failures_and_leaves_every_row_to_the_csv(report):
    out, r = report
    html = (out / "report.html").read_text()
    assert "Per adapter and format" in html and "Outputs that fail" in html
    assert f"{len(r.rows)} outputs, each with every metric" in html and "compare.csv" in html
    assert html.count("<tr>") < len(r.rows)  # not every output as a row


def test_report_html_in_a_browser_at_1400px(report, tmp_path):
    need_browser()
    out, _ = report
    page = tmp_path / "r.html"
    page.write_text((out / "report.html").read_text().replace("</body>", PROBE))
    dom = browser(tmp_path, "--window-size=1400,900", "--virtual-time-budget=5000", "--dump-dom", page.as_uri())
    width, window, cut, tall = map(int, re.search(r'data-probe="([^"]*)"', dom.stdout).group(1).split())
    assert width <= window and cut == 0, (width, window, cut)
    assert tall <= 200, f"a cell {tall} px tall: a column squeezed narrow"
    pdf = tmp_path / "r.pdf"
    browser(tmp_path, "--no-pdf-header-footer", f"--print-to-pdf={pdf}", (out / "report.html").as_uri())
    pages = len(re.findall(rb"/Type\s*/Page[^s]", pdf.read_bytes()))
    assert 0 < pages <= 30, pages
    shot = tmp_path / "shot.png"
    browser(tmp_path, "--window-size=1400,1200", f"--screenshot={shot}", (out / "report.html").as_uri())
    assert shot.stat().st_size > 10_000  # a page was drawn


class _Tables(HTMLParser):
    """The page's tables as written (what a browser without JavaScript shows): per table its attributes, headings
    (text and title) and rows (each cell's text and data-v), and the select boxes' attributes and options."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[dict] = []
        self.selects: list[dict] = []
        self.h2 = ""
        self._cell: dict | None = None
        self._in_h2 = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "h2":
            self._in_h2, self.h2 = True, ""
        elif tag == "table":
            self.tables.append({"attrs": a, "section": self.h2, "heads": [], "rows": []})
        elif tag == "tr" and self.tables:
            self.tables[-1]["rows"].append([])
        elif tag in ("th", "td") and self.tables:
            self._cell = {"tag": tag, "text": "", **a}
        elif tag == "select":
            self.selects.append({**a, "options": []})
        elif tag == "option" and self.selects:
            self.selects[-1]["options"].append(a.get("value"))

    def handle_endtag(self, tag):
        if tag == "h2":
            self._in_h2 = False
        elif tag == "tr" and self.tables and not self.tables[-1]["rows"][-1]:  # the headings' row
            self.tables[-1]["rows"].pop()
        elif tag in ("th", "td") and self._cell is not None:
            t, cell = self.tables[-1], self._cell
            (t["heads"] if cell["tag"] == "th" else t["rows"][-1]).append(cell)
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell["text"] += data
        if self._in_h2:
            self.h2 += data


def _page(out) -> tuple[str, _Tables]:
    text = (out / "report.html").read_text()
    parsed = _Tables()
    parsed.feed(text)
    return text, parsed


def _failing_table(parsed: _Tables) -> dict:
    return next(t for t in parsed.tables if t["section"].startswith("Outputs that fail"))


def test_every_heading_is_words_with_its_explanation(report):
    """No table shows a field's raw name (worse_worst, budget_top, max_abs): every heading is COLUMNS' words for
    its field, with the explanation as its tooltip, and COLUMNS knows every column of the page."""
    _, parsed = _page(report[0])
    heads = [h for t in parsed.tables for h in t["heads"]]
    assert len(parsed.tables) >= 5 and heads
    # a snake_case name, or a field's own name where COLUMNS words it otherwise (dtype, checked, worse)
    raw = [h["text"] for h in heads if "_" in h["text"] or COLUMNS.get(h["text"], (h["text"],))[0] != h["text"]]
    assert not raw, f"raw field names as headings: {raw}"
    known = set(COLUMNS.values())
    assert all((h["text"], h.get("title")) in known for h in heads), \
        [h for h in heads if (h["text"], h.get("title")) not in known]


def test_the_failing_outputs_come_worst_first_every_one_with_javascript_off(report):
    """As written (no script run): every failing output is a row, by error / bound largest first (inf first, no
    NaN), and the filters are hidden (a script shows them); nothing is fetched from elsewhere."""
    out, r = report
    text, parsed = _page(out)
    t = _failing_table(parsed)
    fails = r.rows[r.rows["verdict"] == "FAIL"]
    assert len(t["rows"]) == len(fails) > 1
    i = [h["text"] for h in t["heads"]].index(COLUMNS["error_over_bound"][0])
    ratio = [float(row[i]["data-v"]) for row in t["rows"]]
    assert ratio == sorted(ratio, reverse=True) and not any(map(math.isnan, ratio))
    assert sorted(ratio) == sorted((fails["score"] / fails["bound"]).tolist())
    assert re.search(r'<div class="filters" data-table="[^"]+" hidden>', text)
    assert not re.search(r"<(script|link|img|iframe)[^>]*\b(src|href)=\"(?!data:)", text), "an external file"


# after the page has laid out and its script has run: the headings as shown, then the failing outputs' table sorted
# by a click on a number's heading, again (the other way), by the output's heading, and filtered by one format
DRIVE = """<script>
window.addEventListener('load', () => {
  const out = {};
  try {
    out.heads = [...document.querySelectorAll('th')].map(th => th.textContent);
    const h2 = [...document.querySelectorAll('h2')].find(h => h.textContent.startsWith('Outputs that fail'));
    let el = h2.nextElementSibling;
    while (!el.querySelector('table')) el = el.nextElementSibling;
    const t = el.querySelector('table'), head = [...t.tHead.rows[0].cells];
    const col = name => head.findIndex(th => th.textContent === name);
    const shown = (i, v) => [...t.tBodies[0].rows].filter(tr => tr.getClientRects().length > 0)
                                                  .map(tr => v ? tr.cells[i].dataset.v : tr.cells[i].textContent);
    const num = col(NUMBER), word = col(WORD), fmt = col(FORMAT);
    out.before = shown(num, true);
    head[num].click();
    out.first = shown(num, true);
    head[num].click();
    out.second = shown(num, true);
    head[word].click();
    out.words = shown(word, false);
    const pick = [...document.querySelectorAll('select')].find(s => s.closest('label').textContent.startsWith(FORMAT));
    pick.value = CHOSEN;
    pick.dispatchEvent(new Event('change'));
    out.filtered = shown(fmt, false);
    out.rows = t.tBodies[0].rows.length;
  } catch (e) { out.error = String(e); }
  document.body.setAttribute('data-probe', JSON.stringify(out));
});
</script></body>"""


@pytest.fixture(scope="module")
def driven(report, tmp_path_factory):
    """What the page shows in Chromium once DRIVE has clicked and filtered (the failing outputs' largest absolute
    error, their output, the format with fewest failing outputs), and that format and its count."""
    need_browser()
    out, r = report
    tmp = tmp_path_factory.mktemp("driven")
    per = r.rows[r.rows["verdict"] == "FAIL"].groupby("dtype").size()
    chosen = str(per.idxmin())
    probe = DRIVE
    for name, value in (("NUMBER", COLUMNS["max_abs"][0]), ("WORD", COLUMNS["tensor"][0]),
                        ("FORMAT", COLUMNS["dtype"][0]), ("CHOSEN", chosen)):
        probe = probe.replace(name, json.dumps(value))
    page = tmp / "r.html"
    page.write_text((out / "report.html").read_text().replace("</body>", probe))
    dom = browser(tmp, "--window-size=1400,900", "--virtual-time-budget=5000", "--dump-dom", page.as_uri())
    got = json.loads(html.unescape(re.search(r'data-probe="([^"]*)"', dom.stdout).group(1)))
    return got, chosen, int(per[chosen]), int(per.sum())


def test_the_headings_a_browser_shows_are_words(driven):
    got = driven[0]
    assert got.get("heads") and not [h for h in got["heads"] if "_" in h], got.get("heads")


def _values(v):
    return [float(x) for x in v]


def _sorted_nan_last(v, reverse):
    k = sum(not math.isnan(x) for x in v)
    return not any(math.isnan(x) for x in v[:k]) and v[:k] == sorted(v[:k], reverse=reverse)


def test_a_click_on_a_heading_sorts_the_failing_outputs_by_it(driven):
    """A number's heading: largest first (NaN last), a second click smallest first; a word's heading: its equal
    values together; the rows are reordered, none lost."""
    got, _, _, n = driven
    assert "error" not in got, got.get("error")
    assert len(got["before"]) == len(got["first"]) == len(got["second"]) == n
    before, first, second = _values(got["before"]), _values(got["first"]), _values(got["second"])
    assert _sorted_nan_last(first, reverse=True), f"not largest first, NaN last: {first}"
    assert _sorted_nan_last(second, reverse=False), f"not smallest first, NaN last: {second}"
    assert got["before"] != got["first"] and sorted(map(str, before)) == sorted(map(str, first))
    words = got["words"]
    runs = [w for k, w in enumerate(words) if k == 0 or words[k - 1] != w]
    assert len(words) == n and len(runs) == len(set(words)) > 1, runs


def test_filtering_by_format_hides_the_other_formats_rows(driven):
    got, chosen, count, n = driven
    assert "error" not in got, got.get("error")
    assert got["rows"] == n and got["filtered"] == [chosen] * count and 0 < count < n
