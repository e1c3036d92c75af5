"""moesub.report: the self-contained HTML report, checked statically and in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html import unescape
from pathlib import Path

import pytest
from fixtures_artefacts import POLICIES, make_study

from moesub.report import FIGURES, render_report
from moesub.stats import run_analysis

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
]
# Injected into a copy of the report before anything else runs: records errors (script errors,
# failed resource loads, console.error, unhandled rejections), then on load writes what the
# test checks into the DOM, which --dump-dom prints.
HARNESS = """<script>
window.__errors = [];
window.addEventListener('error', function (e) {
  var t = e.target;
  window.__errors.push('error: ' + (e.message || (t && (t.src || t.href)) || 'unknown'));
}, true);
window.addEventListener('unhandledrejection', function (e) {
  window.__errors.push('unhandled rejection: ' + e.reason);
});
['error', 'warn'].forEach(function (level) {
  var orig = console[level];
  console[level] = function () {
    window.__errors.push('console.' + level + ': ' + Array.prototype.join.call(arguments, ' '));
    return orig.apply(console, arguments);
  };
});
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var res = {
    errors: window.__errors,
    images: imgs.map(function (i) {
      return {alt: i.alt, complete: i.complete, w: i.naturalWidth, h: i.naturalHeight};
    }),
    summary_rows: Array.prototype.map.call(
      document.querySelectorAll('#summary tbody tr'), function (r) { return r.dataset.policy; }),
    resources: performance.getEntriesByType('resource').map(function (r) { return r.name; }),
    title: document.title
  };
  var pre = document.createElement('pre');
  pre.id = '__harness';
  pre.textContent = JSON.stringify(res);
  document.body.appendChild(pre);
});
</script>
"""


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    inputs, params = make_study(root / "results", noise=0.3, admission_gain=0.05)
    run_analysis(inputs, params, root / "results" / "analysis")
    out = render_report(root / "results" / "analysis", params, root / "results" / "report.html")
    return {"root": root, "html": out, "inputs": inputs, "params": params}


def test_report_is_self_contained_and_complete(rendered):
    html = Path(rendered["html"]).read_text()
    # one row per policy in the summary table
    rows = re.findall(r'<tr class="policy-row" data-policy="([^"]+)"', html)
    assert sorted(rows) == sorted(POLICIES)
    # every figure embedded as a PNG data URI, and written next to the report
    uris = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(uris) == len(FIGURES)
    for name, *_ in FIGURES:
        png = rendered["root"] / "results" / "figures" / f"{name}.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # nothing fetched from anywhere: no external src/href, no <link>, no @import / url()
    assert not re.search(r'(src|href)\s*=\s*"(?!data:|#)', html)
    assert "<link" not in html and "@import" not in html and "url(" not in html
    # the headline numbers, model, machine, config and provenance are shown
    assert "Experiment B: heavy worse" in html
    assert "Pearson r = " in html
    assert "train_summary.json" in html and "test-core-0001" in html
    assert '"primary": 0.2' in unescape(html)  # the config's Experiment B rule
    for path in rendered["inputs"]["emulate"]:
        assert path in html


def test_missing_parts_render_with_messages(tmp_path):
    inputs, params = make_study(tmp_path / "r", names=["fetch_every_miss", "rule_015"])
    partial = {"simulate": inputs["simulate"], "capture_tokens": inputs["capture_tokens"]}
    run_analysis(partial, params, tmp_path / "an")
    out = render_report(tmp_path / "an", params, tmp_path / "out" / "report.html")
    html = out.read_text()
    assert html.count('class="policy-row"') == 2
    assert "Experiment B: heavy worse" not in html
    assert "no Experiment B artefacts" in html
    assert "Generation: not available — no generation artefacts" in html
    assert "No model summary JSON" in html
    assert len(re.findall(r"<img ", html)) == 1  # only the per-layer hit rates
    assert (tmp_path / "out" / "figures" / "layer_hit_rates.png").is_file()


def test_render_report_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="analysis_dir"):
        render_report(tmp_path / "nothing", {}, {}, tmp_path / "r.html")
    run_analysis({}, {}, tmp_path / "an")
    with pytest.raises(FileNotFoundError, match="model_summary"):
        render_report(
            tmp_path / "an", {"model_summary": [tmp_path / "x.json"]}, {}, tmp_path / "r.html"
        )


def _run_chromium(chromium: str, args: list[str], user_dir: Path) -> subprocess.CompletedProcess:
    cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={user_dir}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def require_chromium() -> str:
    chromium = find_chromium()
    if chromium is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("CI is set but no chromium binary is installed (apt-get install chromium)")
        pytest.skip(
            "headless Chromium not installed (Debian package 'chromium'); set CI=true "
            "to make this a failure"
        )
    return chromium


def run_harness(chromium: str, html_path: Path, tmp_path: Path) -> dict:
    """Load a harnessed copy of `html_path` in headless Chromium; the harness's findings."""
    html = html_path.read_text()
    harnessed = html_path.with_name(html_path.stem + "_harness.html")
    harnessed.write_text(html.replace("<head>", "<head>\n" + HARNESS, 1))
    proc = _run_chromium(
        chromium,
        ["--virtual-time-budget=10000", "--dump-dom", harnessed.as_uri()],
        tmp_path / "profile_harness",
    )
    m = re.search(r'<pre id="__harness">(.*?)</pre>', proc.stdout, re.S)
    assert m, f"harness did not run; chromium rc={proc.returncode} stderr={proc.stderr[-2000:]}"
    return json.loads(unescape(m.group(1)))


@pytest.mark.browser
def test_harness_catches_broken_pages(tmp_path):
    """The browser checks can fail: a broken image, a script error and console.error show up."""
    chromium = require_chromium()
    page = tmp_path / "broken.html"
    page.write_text(
        "<!DOCTYPE html><html><head><title>t</title></head><body>"
        '<img src="data:image/png;base64,AAAA" alt="bad">'
        "<script>console.error('boom'); undefinedFunction();</script></body></html>"
    )
    res = run_harness(chromium, page, tmp_path)
    assert any("boom" in e for e in res["errors"]), res["errors"]
    assert any("undefinedFunction" in e for e in res["errors"]), res["errors"]
    assert res["images"][0]["w"] == 0


@pytest.mark.browser
def test_report_in_headless_chromium(rendered, tmp_path):
    chromium = require_chromium()
    res = run_harness(chromium, Path(rendered["html"]), tmp_path)
    assert res["errors"] == []
    assert res["title"] == "moesub report"
    assert len(res["images"]) == len(FIGURES)
    for img in res["images"]:
        assert img["complete"] and img["w"] > 0 and img["h"] > 0, img
    assert sorted(res["summary_rows"]) == sorted(POLICIES)
    external = [r for r in res["resources"] if not r.startswith("data:")]
    assert external == [], f"the report loaded external resources: {external}"

    # a screenshot of the report itself (no harness) as an artefact, for a human to look at
    shot_dir = Path(os.environ.get("MOESUB_ARTEFACTS", tmp_path))
    shot_dir.mkdir(parents=True, exist_ok=True)
    shot = shot_dir / "report_screenshot.png"
    proc = _run_chromium(
        chromium,
        ["--window-size=1280,4000", f"--screenshot={shot}", Path(rendered["html"]).as_uri()],
        tmp_path / "profile_shot",
    )
    assert shot.is_file(), proc.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000  # a rendered page


def test_two_models_render(tmp_path):
    names = ["fetch_every_miss", "rule_015", "quality"]
    inputs_a, params = make_study(tmp_path / "results", model="a", names=names)
    inputs_b, _ = make_study(tmp_path / "results", model="b", names=names, expb_case="no_evidence")
    inputs = {k: inputs_a[k] + inputs_b[k] for k in inputs_a}
    inputs["engine_bench"] = inputs_a["engine_bench"]
    run_analysis(inputs, params, tmp_path / "an")
    html = render_report(tmp_path / "an", params, tmp_path / "report.html").read_text()
    rows = re.findall(r'<tr class="policy-row" data-policy="([^"]+)" data-model="([^"]+)"', html)
    assert sorted(rows) == sorted((n, m) for n in names for m in ("a", "b"))
    assert "Outcome (a): heavy worse" in html and "Outcome (b): no evidence" in html
    assert len(re.findall(r"<img ", html)) == len(FIGURES)
