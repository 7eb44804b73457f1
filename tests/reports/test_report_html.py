"""compare-precision's report.html as a person sees it, in a real browser (headless Chromium, where installed;
.ci/run installs it): at 1400 px no table is clipped or wider than its box and the page is no wider than the
window, no cell grows into a tall narrow column, the long table stays in the CSV, and the page prints on few
pages."""

import re
import shutil
import subprocess

import pytest

from bnprobe.engine.cases import stress_cases
from bnprobe.checks.compare.precision import compare_precision
from bnprobe.reports.compare import write_report

BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
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


@pytest.mark.skipif(BROWSER is None, reason="no Chromium on this machine (.ci/run installs it)")
def test_report_html_in_a_browser_at_1400px(report, tmp_path):
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
