"""moesub.report: the self-contained HTML report, checked statically and in headless Chromium."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from html import unescape
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fixtures_artefacts import POLICIES, make_study

from moesub.io import write_json, write_parquet
from moesub.report import FIGURES, render_report
from moesub.report.load import AnalysisOutputs
from moesub.report.pricing import bench_lines
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


def embedded_figures(html: str) -> list[str]:
    return re.findall(r'<figure id="fig-([a-z_]+)">\s*<img src="data:image/png;base64,', html)


def test_report_is_self_contained_and_complete(rendered):
    html = Path(rendered["html"]).read_text()
    # one row per policy in the summary table
    rows = re.findall(r'<tr class="policy-row" data-policy="([^"]+)"', html)
    assert sorted(rows) == sorted(POLICIES)
    # every figure whose part ran is embedded as a PNG data URI and written next to the report
    # (the synthetic study has no regime artefact)
    names = [name for name, *_ in FIGURES]
    assert sorted(embedded_figures(html)) == sorted(n for n in names if n != "regime")
    assert "Model regime: not available — no regime artefact" in html
    for name in names:
        png = rendered["root"] / "results" / "figures" / f"{name}.png"
        assert name == "regime" or png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # nothing fetched from anywhere: no external src/href, no <link>, no @import / url()
    assert not re.search(r'(src|href)\s*=\s*"(?!data:|#)', html)
    assert "<link" not in html and "@import" not in html and "url(" not in html
    # the headline numbers, model, machine, config and provenance are shown
    lines = headline_items(html)
    assert any(line.startswith("tiny: Experiment B, matched design") for line in lines)
    assert any("Pearson r = " in line for line in lines)
    assert "test-core-0001" in html
    assert '"primary": 0.2' in unescape(html)  # the config's Experiment B rule
    for path in rendered["inputs"]["emulate"]:
        assert path in html


def test_pricing_lines_say_whether_the_criterion_is_met(rendered):
    html = unescape(Path(rendered["html"]).read_text())
    # make_study prices every engine run within 10% of its time, and at its disk's speed
    line = " ".join(re.search(r"Pricing vs engine \(tiny\): (.*?)</p>", html, re.S)[1].split())
    runs = re.match(r"n = (\d+) runs,", line)[1]
    assert f"n = {runs} runs, {runs} within 10% (what the pricing is held to) (each" in line
    # the table gives each run's interval over its streams
    table = html[html.index('id="sim-engine-table"') :].split("</table>")[0]
    assert "error's 95% CI over its streams (%)" in table
    assert len(re.findall(r"\[\+\d\.\d, \+\d\.\d\]", table)) == int(runs)
    # the fixture's streams are priced 4% either side of each run's error (about +5%)
    assert (
        "(each run's streams resampled, a 95% CI of its error: of those within, 0 reach beyond "
        "it), median |relative error|"
    ) in line
    assert f"at the disk's speed while it read, median 2.3%, max 2.3%, {runs} within;" in line
    assert (
        "and with their compute at the machine's speed while they ran (probed on their tokens "
        "that only hit, a diagnosis that holds where those tokens are priced right, "
        f"docs/pricing.md), median 1.3%, max 1.3%, {runs} within;"
    ) in line
    assert line.endswith(
        "the calibration's own runs priced at the profile fitted to them (its error on them, "
        "which a policy that does what a run does inherits): cal_admit -12.0% (beyond 10%), "
        "cal_fetch -3.1%, cal_hits -0.2%, cal_host +0.4%. Leaving each round of the engine "
        "stage out in turn, with the calibration refitted without it (a jackknife over the "
        "rounds, the calibration's own noise in it), gives each run's error a 95% CI: of those "
        f"within, {runs} reach beyond it. Refitting the calibration alone gives a median 23% of "
        "that variance."
    )
    # and the jackknife's interval (the fixture's errors with each round left out: 3% to 7%)
    assert "error's 95% CI, rounds left out, calibration refitted (%)" in table
    assert table.count("[-2.9, +13.4]") == int(runs)
    # the fixture's bench: -4% .. +4% as measured, -2% .. +2% at each run's disk, -1% .. +1% at
    # each run's speed too
    lines = re.findall(r'<p class="outcome bench-line">(.*?)</p>', html, re.S)
    (met, rounds, calibration, at_disk, at_speed) = (" ".join(line.split()) for line in lines)
    n = len(POLICIES)
    assert met.startswith(
        f"The pricing is held to 10% of the engine's time for every policy. As "
        f"measured, {n} of {n} policies are within it, largest |error| 4.0%"
    )
    assert met.endswith(": the criterion is met in this run.")
    # the fixture's rounds are priced 3% either side of the error: every interval within 10%
    assert rounds == (
        "Resampling each policy's rounds (stretches of the machine; the calibration held as "
        f"fitted) gives its error a 95% CI: of the {n} within, 0 reach beyond it."
    )
    assert calibration == (
        "The bench's calibration runs, priced at the profile fitted to them (the fit's error on "
        "its own runs; a policy that does what a run does inherits it): cal_admit -12.0% "
        "(beyond 10%), cal_fetch -3.1%, cal_hits -0.2%, cal_host +0.4%."
    )
    assert at_disk.startswith(f"At each run's disk speed, {n} of {n} are within 10%, largest")
    assert at_speed.startswith("At each run's disk and its own speed (its compute timed on")
    assert f"{n} of {n} are within 10%, largest |error| 1.0%" in at_speed


def test_bench_lines_name_the_rows_outside():
    def outputs(rows: list[dict]) -> AnalysisOutputs:
        return AnalysisOutputs(Path("."), {}, {"engine_bench": pd.DataFrame(rows)})

    rows = [
        {"policy": "fetch_every_miss", "sim_rel_error": -0.021, "sim_rel_error_at_run_disk": -0.025,
         "disk_vs_calibration": 0.99, "contended": False},
        {"policy": "host_compute", "sim_rel_error": -0.167, "sim_rel_error_at_run_disk": -0.010,
         "disk_vs_calibration": 1.32, "contended": False},
        {"policy": "speed", "sim_rel_error": 0.10, "sim_rel_error_at_run_disk": 0.02,
         "disk_vs_calibration": float("nan"), "contended": True},
    ]  # fmt: skip
    measured, at_disk, contended = bench_lines(outputs(rows))
    # 10% exactly is within; the row outside is named with its disk's drift
    assert measured == (
        "The pricing is held to 10% of the engine's time for every policy. As measured, 2 of 3 "
        "policies are within it, largest |error| 16.7% (host_compute); outside: host_compute "
        "-16.7% (its runs' disk at 1.32x the calibration's; -1.0% at it): the criterion is not "
        "met in this run."
    )
    assert at_disk.startswith(
        "At each run's disk speed, 3 of 3 are within 10%, largest |error| "
        "2.5% (fetch_every_miss): the rows outside as measured are within"
    )
    assert contended == (
        "Contended runs (less than 80% of the CPU they asked for, or other processes kept more "
        "than 0.1 cores busy beside them): speed."
    )
    # each policy's rounds against their price: their spread, the median policy's and the widest
    noisy = [{**r, "round_spread": s} for r, s in zip(rows, (0.055, 0.37, 0.9), strict=True)]
    noisy[2]["round_spread"] = float("nan")  # one round: no spread
    noise = bench_lines(outputs(noisy))[2]
    assert noise == (
        "Between rounds (each runs a share of a policy's tokens), a policy's time over its "
        "price spread by a median of 21.2% (max - min over their median; largest 37.0%, "
        "host_compute): the machine's noise and what the pricing misses in each share, more "
        "than the 10% the pricing is held to."
    )
    noisy[1]["round_spread"] = 0.06
    assert bench_lines(outputs(noisy))[2].endswith("misses in each share.")
    # outside at the run's disk too: not put down to the disk
    rows[1]["sim_rel_error_at_run_disk"] = 0.12
    _, at_disk, _ = bench_lines(outputs(rows))
    assert at_disk == (
        "At each run's disk speed, 2 of 3 are within 10%, largest |error| 12.0% (host_compute)."
    )
    # two outside, one of them at its disk too; a row without an error is left out
    rows[2]["sim_rel_error"] = 0.125
    rows.append({"policy": "quality", "sim_rel_error": float("nan")})
    measured, at_disk, _ = bench_lines(outputs(rows))
    assert "As measured, 1 of 3 policies" in measured
    assert (
        "outside: host_compute -16.7% (its runs' disk at 1.32x the calibration's; +12.0% at "
        "it); speed +12.5%: the criterion is not met" in measured
    )
    assert at_disk.endswith("largest |error| 12.0% (host_compute).")
    # at each run's speed too: the rows outside named, and those too few tokens could probe
    # (kept at their disk's speed: the bench prices them so)
    speeds = [(0.03, 1.1), (0.14, 0.95), (0.02, float("nan"))]
    probed = [{**r, "sim_rel_error_at_run_speed": e, "run_speed": v}
              for r, (e, v) in zip(rows[:3], speeds, strict=True)]  # fmt: skip
    assert bench_lines(outputs(probed))[2] == (
        "At each run's disk and its own speed (its compute timed on its tokens that only hit, "
        "which prices a policy that only hits at its own times: no error by construction), 2 "
        "of 3 are within 10%, largest |error| 14.0% (host_compute); outside: "
        "host_compute +14.0%; too few such tokens to probe: speed."
    )
    # each row's interval over its rounds: of those outside, which reach inside the 10%; of
    # those within, which reach beyond it
    # (the analysis's `with_error_intervals` flags them)
    bounds = [(-0.06, 0.01, False), (-0.21, -0.09, True), (0.11, 0.14, False), (None, None, pd.NA)]
    rounds = [{**r, "sim_rel_error_ci_lo": lo, "sim_rel_error_ci_hi": hi,
               "sim_rel_error_ci_crosses": crosses}
              for r, (lo, hi, crosses) in zip(rows, bounds, strict=True)]  # fmt: skip
    assert bench_lines(outputs(rounds))[1] == (
        "Resampling each policy's rounds (stretches of the machine; the calibration held as "
        "fitted) gives its error a 95% CI: of the 2 outside, 1 reaches inside 10% (host_compute "
        "-16.7% [-21.0, -9.0]): this run does not tell it from within; of the 1 within, 0 "
        "reach beyond it."
    )
    rounds[0]["sim_rel_error_ci_lo"], rounds[0]["sim_rel_error_ci_crosses"] = -0.12, True
    assert bench_lines(outputs(rounds))[1].endswith(
        "of the 1 within, 1 reaches beyond it (fetch_every_miss -2.1% [-12.0, +1.0])."
    )
    # the jackknife with the calibration refitted: its interval against the criterion, and how
    # much of its variance the calibration alone gives (the median over the policies)
    jk_bounds = [(-0.13, 0.09, True, 0.4), (-0.25, -0.08, True, 0.9), (0.105, 0.145, False, 1.3),
                 (None, None, pd.NA, None)]  # fmt: skip
    jk = [{**r, "sim_rel_error_jk_lo": lo, "sim_rel_error_jk_hi": hi,
           "sim_rel_error_jk_crosses": crosses, "calibration_share": share}
          for r, (lo, hi, crosses, share) in zip(rounds, jk_bounds, strict=True)]  # fmt: skip
    assert bench_lines(outputs(jk))[2] == (
        "Leaving each round out in turn, with the calibration refitted without it (a jackknife "
        "over the rounds, the calibration's own noise in it), gives the error a 95% CI: of the "
        "2 outside, 1 reaches inside 10% (host_compute -16.7% [-25.0, -8.0]): this run does not "
        "tell it from within; of the 1 within, 1 reaches beyond it (fetch_every_miss -2.1% "
        "[-13.0, +9.0]). Refitting the calibration alone gives a median 90% of that variance."
    )
    jk[0]["calibration_share"] = 2.0  # shares 2.0, 0.9, 1.3
    assert bench_lines(outputs(jk))[2].endswith(
        "a median 130% of that variance (over 100%: the calibration's noise and the rounds' "
        "offset each other)."
    )
    # a table from before the at-disk column, and none
    old = [{k: v for k, v in r.items() if k == "policy" or k == "sim_rel_error"} for r in rows]
    assert len(bench_lines(outputs(old))) == 1
    assert bench_lines(outputs([])) == []
    # the runs' torch threads, where the table has them, said first
    lines = bench_lines(outputs([{**r, "threads": 1} for r in rows]))
    assert lines[0] == (
        "The bench's runs computed with 1 torch thread (engine.bench.threads), beside the "
        "tier's I/O thread and host worker."
    )
    assert lines[1:] == bench_lines(outputs(rows))
    two = bench_lines(outputs([{**r, "threads": 2} for r in rows]))[0]
    assert two.startswith("The bench's runs computed with 2 torch threads (")
    # the calibration runs' errors, per device where the bench ran on more than one; the runs
    # beyond 10% named
    errors = {"cpu": {"cal_fetch": -0.109, "cal_host": 0.007}, "cuda": {"cal_fetch": 0.02}}
    doc = {"parts": {"engine_bench": {"calibration_run_errors": errors}}}
    with_errors = AnalysisOutputs(Path("."), doc, {"engine_bench": pd.DataFrame(old)})
    assert bench_lines(with_errors)[1] == (
        "The bench's calibration runs, priced at the profile fitted to them (the fit's error on "
        "its own runs; a policy that does what a run does inherits it): on cpu, cal_fetch "
        "-10.9% (beyond 10%), cal_host +0.7%; on cuda, cal_fetch +2.0%."
    )


def test_factorial_section(rendered):
    html = unescape(Path(rendered["html"]).read_text())
    section = html[html.index('<h3 id="expb-factorial">') : html.index('id="admission-section"')]
    lines = re.findall(r"<li>(.*?)</li>", section, re.S)
    assert lines[0].startswith("tiny: feasibility on the calibration capture: token-layers")
    assert "supporting all four cells 0.00%" in lines[0] and "32 token-layers per cell" in lines[0]
    # make_study: heavy costs 0.004 * g more at both ranks (g > 0); the rank alternates +-0.0005
    weight, rank = lines[1], lines[2]
    assert weight.startswith("tiny: heavy − light at a fixed rank (mean over the rank buckets): +")
    assert "(95% CI, t over 8 streams) ΔNLL per substituted token-layer, Holm p = " in weight
    assert re.search(r"Holm p = [0-9.e-]+ \(raw [0-9.e-]+\): supports\.$", weight)
    assert rank.startswith("tiny: high − low rank at a fixed weight")
    assert re.search(r"\(raw 1\): no detectable effect \(MDE [0-9.e-]+, a normal-approx", rank)
    # the headline quotes both, with their adjusted p
    (head,) = [x for x in headline_items(html) if "Experiment B, factorial design" in x]
    assert head.startswith("tiny: Experiment B, factorial design: heavy − light at a fixed rank")
    assert head.count("Holm p = ") == 2 and weight[6:-1] in head and rank[6:-1] in head
    tests = re.search(r'<table id="expb-factorial">(.*?)</table>', section, re.S).group(1)
    names = re.findall(r"<td>(expb\.factorial\.\w+) \((pre-registered|exploratory)\)</td>", tests)
    assert [n for n, _ in names] == [
        f"expb.factorial.{t}"
        for t in ("weight", "rank", "weight_at_low", "weight_at_high", "rank_at_light",
                  "rank_at_heavy")
    ]  # fmt: skip
    assert [f for _, f in names] == ["pre-registered"] * 2 + ["exploratory"] * 4
    assert "p adjusted (pre-registered: Holm; exploratory: BH)" in tests
    assert tests.count("<td>supports</td>") == 3  # the weight pooled and at each rank
    # and in the tests section, by family: the pooled pair pre-registered, the rest exploratory
    pre = re.search(r'<table id="tests-pre-registered">(.*?)</table>', html, re.S).group(1)
    assert pre.count('data-kind="expb_factorial_main"') == 2
    explore = re.search(r'<table id="tests-exploratory">(.*?)</table>', html, re.S).group(1)
    assert explore.count('data-kind="expb_factorial_bucket"') == 4
    cells = re.search(r'<table id="expb-factorial-cells">(.*?)</table>', section, re.S).group(1)
    assert "low rank (3), light [0.07, 0.09)" in cells and "high rank (6), heavy" in cells
    assert "expb_factorial" in embedded_figures(Path(rendered["html"]).read_text())


def test_missing_parts_render_with_messages(tmp_path):
    inputs, params = make_study(tmp_path / "r", names=["fetch_every_miss", "rule_015"])
    partial = {"simulate": inputs["simulate"], "capture_tokens": inputs["capture_tokens"]}
    run_analysis(partial, params, tmp_path / "an")
    out = render_report(tmp_path / "an", params, tmp_path / "out" / "report.html")
    html = out.read_text()
    assert html.count('class="policy-row"') == 2
    assert "Experiment B, " not in html
    assert html.count("Experiment B: not available — no Experiment B artefacts") == 1
    assert "Generation: not available — no generation artefacts" in html
    # the design space needs simulate only (Δppl where a policy is lossless or emulated)
    assert embedded_figures(html) == ["layer_hit_rates", "design_space"]
    assert (tmp_path / "out" / "figures" / "layer_hit_rates.png").is_file()


def test_render_report_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="analysis_dir"):
        render_report(tmp_path / "nothing", {}, tmp_path / "r.html")
    an = write_analysis_outputs(tmp_path / "an", models=("a",))
    with pytest.raises(ValueError, match="params must be a mapping"):
        render_report(an, [], tmp_path / "r.html")


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
    assert len(res["images"]) == len(embedded_figures(Path(rendered["html"]).read_text()))
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
    names = ["fetch_every_miss", "rule_015", "quality", "rule_015_lfu"]
    inputs_a, params = make_study(tmp_path / "results", model="a", names=names)
    inputs_b, _ = make_study(tmp_path / "results", model="b", names=names, expb_case="no_evidence")
    inputs = {k: inputs_a[k] + inputs_b[k] for k in inputs_a}
    inputs["engine_bench"] = inputs_a["engine_bench"]
    run_analysis(inputs, params, tmp_path / "an")
    html = render_report(tmp_path / "an", params, tmp_path / "report.html").read_text()
    rows = re.findall(r'<tr class="policy-row" data-policy="([^"]+)" data-model="([^"]+)"', html)
    assert sorted(rows) == sorted((n, m) for n in names for m in ("a", "b"))
    lines = headline_items(html)
    assert all(line.split(":", 1)[0] in ("a", "b") for line in lines), lines
    assert any(line.startswith("a: Experiment B, matched design") for line in lines)
    assert any(line.startswith("b: Experiment B, matched design") for line in lines)
    model_rows = re.search(r'<table id="model-meta">(.*?)</table>', html, re.S).group(1)
    assert re.findall(r"<tr><td[^>]*>([^<]*)</td>", model_rows) == ["a", "b"]


# ---- analysis outputs written directly: the report's input contract, two models ---------------

FIXTURE_POLICIES = [
    "fetch_every_miss",
    "rule_015",
    "rule_tau0.2",
    "rule_tau0.3",
    "quality",
    "quality_lfu0",
    "host_compute",
    "all_resident",
]
SEGMENTS = ("all", "first_document", "after_change", "after_change_early", "after_change_late")
MISSING_GSM8K = "GSM8K test set not found at data/gsm8k/test.jsonl (see data/README.md)"
SANDBOX_ERROR = "sandbox error: launcher failed"


def write_analysis_outputs(out_dir: Path, models=("a", "b"), ci_level: float = 0.9) -> Path:
    """analysis.json and the named Parquet tables, as the analysis rule writes them, for
    `models`; several policies share one point (mass 0, Δppl 0) to exercise label placement."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {
        k: []
        for k in (
            "summary",
            "mass_points",
            "speed_quality",
            "sim_vs_engine",
            "layer_hit_rates",
            "generation",
            "expb",
            "admission",
            "regime",
            "models",
            "per_input",
            "per_input_points",
            "engine_bench",
        )
    }
    doc = {
        "params": {
            "ci_level": ci_level,
            "baseline": "fetch_every_miss",
            "policies": {p: {} for p in FIXTURE_POLICIES},
            "expb": {"primary": 0.1, "alpha": 0.05},
        },
        "models": list(models),
        "parts": {},
        "dppl_base": {},
        "mass_hypothesis": [],
        "admission": [],
        "sim_vs_engine": [],
        "regime": [],
        "provenance": [],
    }
    for i, m in enumerate(models):
        for j, p in enumerate(FIXTURE_POLICIES):
            mass = 0.0 if j in (0, 6, 7) else 0.01 * j + 0.001 * i
            dppl = 0.0 if mass == 0 else 30 * mass
            rows["summary"].append(
                {
                    "model": m,
                    "policy": p,
                    "fraction": 0.25,
                    "rule": "threshold",
                    "tau": 0.15,
                    "eviction": "lru",
                    "beta": 0.0,
                    "hit_rate": 0.8 + 0.01 * j,
                    "sub_rate": 0.02,
                    "mass_per_token_layer": mass,
                    "dppl_pct": dppl,
                    "dppl_ci_lo": dppl - 0.5,
                    "dppl_ci_hi": dppl + 0.5,
                    "dppl_bias": 0.01,
                    "dppl_mde_pct": 0.4,
                    "time_per_token_s": 0.01 + 0.001 * j,
                    "sim_time_per_token_s": 0.011,
                    "speedup_vs_fetch_every_miss": 1.0 + 0.1 * j,
                    "completion_accuracy": 0.3,
                    "completion_ci_low": 0.2,
                    "completion_ci_high": 0.4,
                }
            )
            if mass > 0:
                rows["mass_points"].append(
                    {
                        "model": m,
                        "fraction": 0.25,
                        "group": "fetches first choice",
                        "policy": p,
                        "mass_per_token_layer": mass,
                        "dppl_pct": dppl,
                    }
                )
            rows["speed_quality"].append(
                {
                    "model": m,
                    "policy": p,
                    "fraction": 0.25,
                    "device": "cpu",
                    "source": "engine",
                    "time_per_token_s": 0.01 if j in (0, 6, 7) else 0.01 + 0.001 * j,
                    "dppl_pct": dppl,
                    "dppl_ci_lo": dppl - 0.5,
                    "dppl_ci_hi": dppl + 0.5,
                    "frontier": j in (0, 1),
                }
            )
            rows["sim_vs_engine"].append(
                {
                    "model": m,
                    "policy": p,
                    "fraction": 0.25,
                    "device": "cpu",
                    "time_mean_s": 0.01,
                    "est_time_per_token_s": 0.0105,
                    "rel_error": 0.05,
                }
            )
            for layer in range(2):
                rows["layer_hit_rates"].append(
                    {
                        "model": m,
                        "policy": p,
                        "fraction": 0.25,
                        "layer": layer,
                        "tokens": 100,
                        "hit_rate": 0.8,
                        "sub_rate": 0.01,
                    }
                )
            # gsm8k has no data: the generation part's note says so (once per task and model)
            rows["generation"].append(
                {
                    "model": m,
                    "task": "completion",
                    "policy": p,
                    "n": 118,
                    "n_missing": 2,
                    "missing_reasons": SANDBOX_ERROR,
                    "accuracy": 0.3,
                    "ci_low": 0.23,
                    "ci_high": 0.38,
                    "agreement": 0.9,
                    "agreement_ci_low": 0.85,
                    "agreement_ci_high": 0.95,
                    "accuracy_diff": -0.02,
                    "mcnemar_p": 0.5,
                    "mdd": 0.15,
                    "mass_per_token_layer": mass,
                }
            )
        doc["mass_hypothesis"].append(
            {
                "model": m,
                "fraction": 0.25,
                "group": "fetches first choice",
                "n": 5,
                "policies": FIXTURE_POLICIES[1:6],
                "r": 0.9,
                "r_ci_lo": 0.7,
                "r_ci_hi": 0.97,
                "r_bias": -0.02,
                "r_ci_method": "bca",
                "rho": 0.9,
            }
        )
        for design, valid in (("study", False), ("matched", True)):
            for target in (0.05, 0.1):
                rows["expb"].append(
                    {
                        "model": m,
                        "design": design,
                        "target_mass": target,
                        "primary": target == 0.1,
                        "valid": valid,
                        "outcome": "heavy worse" if valid else "invalid",
                        "outcome_text": "heavy worse" if valid else "invalid (light 0.002)",
                        "p_value": 0.01 if valid else None,
                        "n_streams": 24,
                        "realized_heavy": target,
                        "realized_light": target * (0.98 if valid else 0.02),
                        "support": 0.4,
                        "effect": 0.02,
                        "effect_ci_lo": 0.01,
                        "effect_ci_hi": 0.03,
                        "mean_rank_heavy": 4.1,
                        "mean_rank_light": 6.3,
                        "min_p": 6e-8,
                        "mde": 0.004,
                    }
                )
        bins = [
            ("after_change", "boundary"),
            ("after_change", "1-15"),
            ("after_change", "16-63"),
            ("first_document", "1-15"),
            ("first_document", "16-63"),
        ]
        for b, (segment, lab) in enumerate(bins):
            rows["admission"].append(
                {
                    "model": m,
                    "policy": "quality",
                    "twin": "quality_lfu0",
                    "fraction": 0.25,
                    "segment": segment,
                    "bin": b % 3,
                    "bin_label": lab,
                    "n_tokens": 500,
                    "n_streams": 24,
                    "dnll_mean": -0.01,
                    "ci_lo": -0.02,
                    "ci_hi": 0.0,
                    "bias": 0.001,
                }
            )
        for segment in SEGMENTS:
            test = {"p_value": 0.003, "min_p": 6e-8, "mde_dppl_pct": 0.2, "wilcoxon_p": 0.01,
                    "profile": "late", "early_tokens": 16}  # fmt: skip
            doc["admission"].append(
                {
                    "model": m,
                    "policy": "quality",
                    "twin": "quality_lfu0",
                    "fraction": 0.25,
                    "segment": segment,
                    "status": "ok",
                    "n_tokens": 2500,
                    "dnll_mean": math.log1p(-0.005),
                    "dnll_ci_lo": math.log1p(-0.009),
                    "dnll_ci_hi": math.log1p(-0.001),
                    "dppl_pct_vs_twin": -0.5,
                    "ci_lo": -0.9,
                    "ci_hi": -0.1,
                    "bias": 0.01,
                    **(test if segment == "all" else {}),
                }
            )
        metrics = {
            "hit_rate": 0.86,
            "belady_hit_rate": 0.93,
            "rule015_sub_rate": 0.05,
            "effective_experts": 200.0,
            "routing_entropy": 4.0,
            "heavy_lower_ranks": 0.1,
            "weight_rank1": 0.4,
            "weight_rank2": 0.2,
            "weight_rank3": 0.1,
            "reuse_1": 0.3,
            "reuse_2_4": 0.2,
            "reuse_first": 0.1,
        }
        for layer in (0, 1, -1):
            for metric, value in metrics.items():
                ref = {"hit_rate": 0.915, "rule015_sub_rate": 0.075}.get(metric)
                trace = 0.81 if metric == "hit_rate" else None
                rows["regime"].append(
                    {
                        "model": m,
                        "layer": layer,
                        "metric": metric,
                        "value": value,
                        "reference": ref if layer == -1 else None,
                        "trace_study_reference": trace if layer == -1 else None,
                    }
                )
        doc["regime"].append(
            {"model": m, "capacity": 128, "verdict": f"fetch_every_miss hits 0.86 ({m})"}
        )
        rows["models"].append(
            {"model": m, "num_experts": 512, "top_k": 10, "num_layers": 4, "heldout_ppl": 60.0 + i}
        )
        doc["dppl_base"][m] = {"0.25": "fetch_every_miss (emulated)"}
    # as the analysis merges per-model notes: "<model>: <note>"
    n_jobs = len(FIXTURE_POLICIES)
    notes = [
        f"{m}: missing data: gsm8k not evaluated ({n_jobs} jobs): {MISSING_GSM8K}" for m in models
    ]
    doc["parts"] = {
        "generation": {"status": "ok", "note": "; ".join(notes)},
        "engine_bench": {"status": "missing", "reason": "no engine benchmark artefacts"},
        "per_input": {"status": "missing", "reason": "needs emulate artefacts"},
    }
    doc["files"] = {name: f"{name}.parquet" for name in rows}
    for name, r in rows.items():
        write_parquet(pd.DataFrame(r), out_dir / f"{name}.parquet")
    write_json(doc, out_dir / "analysis.json")
    return out_dir


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_models")
    an = write_analysis_outputs(root / "analysis")
    html = render_report(an, {"title": "moesub report"}, root / "report.html").read_text()
    return {"root": root, "html": html}


def headline_items(html: str) -> list[str]:
    block = re.search(r'<ul class="headline">(.*?)</ul>', html, re.S).group(1)
    return [unescape(x).strip() for x in re.findall(r"<li>(.*?)</li>", block, re.S)]


def test_every_headline_line_names_its_model(two_models):
    lines = headline_items(two_models["html"])
    assert len(lines) >= 6
    for line in lines:
        assert line.split(":", 1)[0] in ("a", "b"), line
    for m in ("a", "b"):
        assert any(line.startswith(f"{m}: Experiment B, matched") for line in lines)
        assert any(line.startswith(f"{m}: Experiment B, study") for line in lines)


def test_model_table_has_a_row_per_model(two_models):
    table = re.search(r'<table id="model-meta">(.*?)</table>', two_models["html"], re.S).group(1)
    body = table.split("<tbody>", 1)[1]
    firsts = re.findall(r"<tr><td[^>]*>([^<]*)</td>", body)
    assert firsts == ["a", "b"]
    assert "heldout_ppl" in table


def test_intervals_follow_ci_level_and_mass_is_per_token_layer(two_models):
    html = unescape(two_models["html"])
    assert "95%" not in html
    assert "90% CI" in html
    assert "per token-layer" in html and "mass / token-layer" in html
    assert "bias" in html  # the bootstrap bias beside the intervals
    # the MDE is labelled a normal-approximation figure; a smallest reachable p of 6e-08 keeps
    # no test from passing, so it is not shown
    assert "0.004 (normal approximation)" in html
    assert "6e-08" not in html and "min p" not in html


def test_missing_data_message_appears_once(two_models):
    html = unescape(two_models["html"])
    assert html.count(MISSING_GSM8K) == 1
    assert f"({len(FIXTURE_POLICIES)} jobs): {MISSING_GSM8K} (a, b)" in html
    assert html.count(SANDBOX_ERROR) == 1  # unscored problems: the reason once, not per row


def test_policies_table_has_hit_rate_and_numbers(two_models):
    table = re.search(r'<table id="summary">(.*?)</table>', two_models["html"], re.S).group(1)
    headers = re.findall(r"<th>(.*?)</th>", table)
    assert headers[:3] == ["#", "model", "policy"]
    assert "hit rate" in headers
    rows = re.findall(r'data-policy="([^"]+)" data-model="([^"]+)"', table)
    assert sorted(rows) == sorted((p, m) for p in FIXTURE_POLICIES for m in ("a", "b"))
    assert [m for _, m in rows] == ["a"] * len(FIXTURE_POLICIES) + ["b"] * len(FIXTURE_POLICIES)
    # per model in number order, and the same number for the same policy in both models
    numbers = re.findall(r'<tr class="policy-row"[^>]*><td class="num">(\d+)</td>', table)
    assert numbers == [str(i + 1) for i in range(len(FIXTURE_POLICIES))] * 2
    assert rows[: len(FIXTURE_POLICIES)] == [(p, "a") for p, _ in rows[len(FIXTURE_POLICIES) :]]


def test_sections_for_designs_admission_generation_regime(two_models):
    html = unescape(two_models["html"])
    side = re.search(r'<table id="expb-designs">(.*?)</table>', html, re.S).group(1)
    assert re.findall(r"<th>(.*?)</th>", side)[1:] == [
        f"{m} · {d} (m* 0.1)" for m in ("a", "b") for d in ("matched", "study")
    ]
    for metric in (
        "support",
        "realized light",
        "rank confound",
        "effect heavy − light, Hodges-Lehmann [90% CI]",
        "pre-registered one-sided rule",
        "mean heavy − light [t 90% CI] (sensitivity)",
    ):
        assert metric in side
    bins = re.search(r'<table id="admission-bins">(.*?)</table>', html, re.S).group(1)
    assert "boundary" in bins and "first document (cache warm from the initial set)" in bins
    assert "cold" not in html
    gen = re.search(r'<table id="generation-table">(.*?)</table>', html, re.S).group(1)
    assert "completion" in gen and "[23.0, 38.0]" in gen
    assert "a: fetch_every_miss hits 0.86 (a)" in html
    assert '<table id="regime-table">' in html
    # per_input is missing; so are design_space, expb_factorial and degeneration (these outputs
    # have no such tables: their sections are rendered in tests/test_design_space.py, from
    # make_study and in test_degeneration.py)
    assert len(re.findall(r"<img ", html)) == len(FIGURES) - 4


def test_wide_tables_scroll_inside_the_page(two_models):
    html = two_models["html"]
    assert ".table-wrap { max-width: 100%; overflow-x: auto;" in html
    tables = re.findall(r"<table id=", html)
    wrapped = re.findall(r'<div class="table-wrap">\s*<table id=', html)
    assert len(wrapped) == len(tables)


def test_missing_columns_give_one_message(tmp_path):
    an = write_analysis_outputs(tmp_path / "an", models=("a",))
    pd.DataFrame({"model": ["a"], "design": ["matched"]}).to_parquet(an / "expb.parquet")
    (an / "regime.parquet").unlink()
    html = unescape(render_report(an, {}, tmp_path / "r.html").read_text())
    assert html.count("expb.parquet lacks column(s) target_mass") == 1
    assert "regime.parquet is missing from the analysis outputs" in html


def test_labels_of_crowded_points_do_not_overlap():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moesub.report.labels import place_labels

    rng = np.random.default_rng(0)
    x = np.r_[np.zeros(6), rng.uniform(0, 0.05, 8), rng.uniform(0, 1, 6)]
    y = np.r_[np.zeros(6), rng.uniform(0, 0.2, 8), rng.uniform(0, 5, 6)]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter(x, y)
    fig.tight_layout()
    anns = place_labels(ax, x, y, [str(i + 1) for i in range(len(x))])
    renderer = fig.canvas.get_renderer()
    fig.canvas.draw()  # positions every annotation's text
    # the text's own box (an annotation's extent also spans its leader line)
    boxes = [matplotlib.text.Text.get_window_extent(a, renderer) for a in anns]
    assert anns[0].get_text().count(",") >= 5 or any(a.get_text() == "1,2,3,4,5,6" for a in anns)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)
    plt.close(fig)


def test_summarize_reasons_collapses_repeats():
    from moesub.report.load import summarize_reasons

    text = "a: gsm8k/p1: no data; a: gsm8k/p2: no data; b: no regime artefact; a: other thing"
    assert summarize_reasons(text) == (
        "no data (a: gsm8k/p1, a: gsm8k/p2); b: no regime artefact; a: other thing"
    )
    many = "; ".join(f"m{i}: no regime artefact" for i in range(5))
    assert summarize_reasons(many) == "no regime artefact (m0, m1, m2, … (5 in all))"
    assert summarize_reasons("missing data: gsm8k not evaluated (3 jobs): x") == (
        "missing data: gsm8k not evaluated (3 jobs): x"
    )


# ---- the claims, the families, and words that fit the data ------------------------------------

VERDICTS = ("reproduces", "contradicts", "cannot decide", "not measured by this run")


def claim_items(html: str) -> list[tuple[str, str]]:
    """(verdict attribute, text) of each line of the claim-by-claim verdict."""
    block = re.search(r'<ul class="claims">(.*?)</ul>', html, re.S).group(1)
    items = re.findall(r'<li class="claim" data-verdict="([^"]+)">(.*?)</li>', block, re.S)
    return [(v, unescape(re.sub(r"<[^>]+>", "", t)).strip()) for v, t in items]


def test_headline_opens_with_the_claim_by_claim_verdict(rendered):
    html = Path(rendered["html"]).read_text()
    assert html.index('<ul class="claims">') < html.index('<ul class="headline">')
    items = claim_items(html)
    doc = json.loads((rendered["root"] / "results" / "analysis" / "analysis.json").read_text())
    assert [(v, t.split(":")[1].strip()) for v, t in items] == [
        (c["verdict"], c["label"]) for c in doc["claims"]
    ]
    for verdict, text in items:
        assert verdict in VERDICTS and text.startswith("tiny: ") and "The study:" in text
        assert text.split(":")[2].strip().startswith(verdict)
    by_label = {t.split(":")[1].strip(): (v, t) for v, t in items}
    verdict, text = by_label["the 0.15 rule"]
    assert verdict == "reproduces" and "substitute_all − rule_015" in text and "Holm p = " in text


def test_tests_by_family_with_adjusted_p_beside_raw(rendered):
    html = unescape(Path(rendered["html"]).read_text())
    tests = pd.read_parquet(rendered["root"] / "results" / "analysis" / "tests.parquet")
    for family, adjustment in (("pre-registered", "Holm"), ("exploratory", "Benjamini-Hochberg")):
        table = re.search(rf'<table id="tests-{family}">(.*?)</table>', html, re.S).group(1)
        headers = re.findall(r"<th>(.*?)</th>", table)
        assert headers.index("p (two-sided, raw)") + 1 == headers.index("p adjusted")
        assert "t interval [95% CI] (sensitivity)" in headers
        assert table.count("<tr ") == (tests["family"] == family).sum()
        assert f"{family} family: " in html and f"{adjustment} at alpha 0.05" in html
    # the headline quotes adjusted p-values
    assert all("Holm p = " in line for line in headline_items(html) if "Experiment B" in line)


def test_a_missing_twin_is_said_once(tmp_path):
    names = ["fetch_every_miss", "rule_015", "quality", "speed", "first_choice"]
    inputs_a, params = make_study(tmp_path / "results", names=names, model="a")
    inputs_b, _ = make_study(tmp_path / "results", names=names, model="b")
    inputs = {k: inputs_a[k] + inputs_b[k] for k in inputs_a}
    run_analysis(inputs, params, tmp_path / "an")
    html = unescape(render_report(tmp_path / "an", params, tmp_path / "r.html").read_text())
    for name, spec in (("quality", "rule: threshold, tau: 0.15"), ("speed", "rule: first_choice")):
        said = f"{name} has no exact no-admission twin ({{{spec}"
        assert html.count(said) == 1, name
    assert "()" not in html and "config, config" not in html
    note = re.search(r'<p class="missing">Note: (quality has [^<]*)</p>', html).group(1)
    assert "so its admission effect is not measured (a, b)" in note
    (admission,) = [t for v, t in claim_items(html) if "a: background admission" in t]
    assert "not measured by this run" in admission and "no exact" not in admission


def test_a_disabled_stage_is_said_disabled(tmp_path):
    an = write_analysis_outputs(tmp_path / "an", models=("a",))
    config = {"engine": {"bench": {"enabled": False}}}
    html = unescape(render_report(an, config, tmp_path / "r.html").read_text())
    assert "disabled in the config (engine.bench.enabled: false)" in html
    assert "no engine benchmark artefacts" not in html
    assert re.search(r"<td>engine_bench</td><td>disabled</td>", html)


def test_speedups_below_one_are_slower():
    from moesub.report.recommendation import recommendation_table

    choice = {"policy": "rule_015", "speedup_vs_fetch_every_miss": 0.96,
              "speedup_vs_fetch_every_miss_lo": 0.9, "speedup_vs_fetch_every_miss_hi": 1.01,
              "time_per_token_s": 0.02}  # fmt: skip
    doc = {"model": "m", "baseline": "fetch_every_miss", "dppl_budget_pct": 1.0,
           "rankings": [{"hardware": "h", "size": "f0.25", "capacity": 128,
                         "time_source": "simulator", "within_budget": choice,
                         "lossless": None}]}  # fmt: skip
    (row,) = recommendation_table([doc], "95% CI").rows
    assert "0.96× [0.90×, 1.01×] (slower)" in row and "faster" not in " ".join(row)


def test_models_in_the_analysis_order_everywhere(tmp_path):
    """The analysis lists b before a: every table, line and figure follows that order."""
    an = write_analysis_outputs(tmp_path / "an", models=("b", "a"))
    html = unescape(render_report(an, {}, tmp_path / "r.html").read_text())
    for table_id in ("summary", "mass-table", "admission-table", "model-meta"):
        body = re.search(rf'<table id="{table_id}">.*?<tbody>(.*?)</tbody>', html, re.S).group(1)
        models = [m for m in re.findall(r"<tr[^>]*><td[^>]*>(?:\d+</td><td[^>]*>)?([ab])<", body)]
        assert models == sorted(models, key=["b", "a"].index) and models[0] == "b", table_id
    lines = headline_items(html)
    for kind in ("mass hypothesis", "Experiment B", "admission"):  # each kind: b's, then a's
        models = [line.split(":")[0] for line in lines if kind in line]
        assert models == sorted(models, key=["b", "a"].index) and models[0] == "b", kind
    side = re.search(r'<table id="expb-designs">(.*?)</table>', html, re.S).group(1)
    assert re.findall(r"<th>([ab]) · ", side) == ["b", "b", "a", "a"]


def test_figures_leave_out_policies_the_config_does_not_define(tmp_path):
    from moesub.report.load import load_outputs
    from moesub.report.plotting import FigureData

    an = write_analysis_outputs(tmp_path / "an", models=("a",))
    out = load_outputs(an)
    shown = set(FigureData(out, {}).table("summary")["policy"])
    assert shown == set(FIXTURE_POLICIES)  # all configured (all_resident is the engine's)
    out.doc["params"]["policies"].pop("rule_tau0.3")
    assert "rule_tau0.3" not in set(FigureData(out, {}).table("summary")["policy"])


def test_smallest_reachable_p_only_where_it_matters():
    from moesub.report.claims import floor_text, statement

    base = {"direction": "no detectable effect", "mde": 0.0004, "min_p": 1 / 2000}
    # 1/2000 x 6 tests < 0.05: any test of the family can pass its first step: not shown
    assert floor_text({**base, "family_size": 6}, 0.05) == ""
    shown = floor_text({**base, "min_p": 1 / 200, "family_size": 56}, 0.05)
    assert shown == "smallest reachable p 0.005 ≥ alpha / 56, its family's first step"
    assert statement({**base, "family_size": 6}, 0.05) == (
        "no detectable effect (MDE 0.0004, a normal-approximation sensitivity figure)"
    )
    assert statement({"direction": "not tested", "measured": False}, 0.05) == (
        "not measured by this run"
    )
