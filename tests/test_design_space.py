"""The design space (policy v2, issue 12): named policies and sweeps in the config, the
co-activation table artefact, the simulate stage's v2 inputs, the analysis part and the
report section."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import polars as pl
import pytest

from moesub import config as mcfg
from moesub.artefacts import router_rows, router_writer
from moesub.coactivation import coactivation, read_coactivation, write_coactivation
from moesub.grid import GridPoint, simulate
from moesub.io import read_metadata
from moesub.policy import Policy, capacity_for
from moesub.simulate import run_simulate
from moesub.slots import policy_fields
from moesub.synthetic import synthetic_logits

REPO = Path(__file__).resolve().parents[1]
L, E, K = 3, 32, 4


# ---- config ----------------------------------------------------------------------------------


def default_policies() -> tuple[dict, dict]:
    cfg = mcfg.load_config(REPO / "config.yaml")
    return cfg, mcfg.expand_policies(cfg)


def test_default_config_names_every_family_and_keeps_v1_params():
    cfg, pols = default_policies()
    assert pols["prefetch_10"]["prefetch"] == 10
    assert pols["cache_prior_0.1"]["route_bias"] == 0.1
    assert pols["hybrid_015"] == {
        **pols["rule_015"], "light_miss": "host"
    }  # fmt: skip
    assert pols["buddy_quality"] == {**pols["quality"], "substitute_by": "coactivation"}
    assert pols["quality_prefetch"] == {**pols["quality"], "prefetch": 10}
    # sweeps over lambda and n, named by the value
    assert pols["cache_prior_0.05"] == {**pols["cache_prior_0.1"], "route_bias": 0.05}
    assert pols["prefetch_20"] == {**pols["prefetch_10"], "prefetch": 20}
    # the Belady bound of a rule: the same policy with eviction belady
    assert pols["quality_belady"] == {**pols["quality"], "eviction": "belady"}
    # a v1 policy carries no v2 key, so its jobs keep their params (no rerun)
    for name in ("fetch_every_miss", "quality", "speed", "rule_tau0.08", "quality_beta1"):
        assert set(pols[name]) == set(mcfg.POLICY_KEYS), name
    # every policy is a valid Policy (its layout keys, pin spec and allocation, aside)
    for spec in pols.values():
        Policy.from_dict(policy_fields(spec))
    stages = mcfg.stage_policies(cfg, pols)
    assert set(stages["simulate"]) == set(pols)
    # emulate: the listed study and named v2 policies, never a bound
    assert not [n for n in stages["emulate"] if pols[n]["eviction"] == "belady"]
    new = set(stages["emulate"]) - set(mcfg.expand_policies({**cfg, "policies": {
        n: s for n, s in cfg["policies"].items()
        if all(s[k] == mcfg.POLICY_DEFAULTS[k] for k in mcfg.V2_POLICY_KEYS)  # v1 (all filled)
    }, "sweeps": {k: v for k, v in cfg["sweeps"].items() if k in ("tau", "beta")}}))  # fmt: skip
    assert len(new) <= 7, new  # the named v2 policies and one planned allocation
    # the emulated admission policies all have their exact twins (no parse-time warning)
    assert mcfg.missing_admission_twins(pols, stages["emulate"]) == []


def test_sweep_and_belady_expansion():
    base = {
        "policies": {
            "a": {"rule": "fetch_all", "prefetch": 4},
            "b": {"rule": "fetch_all", "route_bias": 0.1},
        },
        "sweeps": {
            "prefetch": {"base": "a", "values": [2, 8]},
            "route_bias": {"base": "b", "values": [0.3]},
            "belady": ["a", "prefetch_8"],
        },
    }
    pols = mcfg.expand_policies(base)
    assert list(pols) == ["a", "b", "cache_prior_0.3", "prefetch_2", "prefetch_8", "a_belady",
                          "prefetch_8_belady"]  # fmt: skip
    assert pols["prefetch_8_belady"]["prefetch"] == 8
    assert pols["a_belady"]["eviction"] == "belady"
    with pytest.raises(ValueError, match=r"sweeps.belady: 'zz' is not a policy"):
        mcfg.expand_policies({**base, "sweeps": {"belady": ["zz"]}})
    # belady needs the future selections, which route_bias makes depend on the cache
    with pytest.raises(ValueError, match=r"policies.b_belady.eviction: .*route_bias"):
        mcfg.expand_policies({**base, "sweeps": {"belady": ["b"]}})
    with pytest.raises(ValueError, match=r"policies.c.prefetch: must be an integer >= 0, got 1.5"):
        mcfg.normalize_policy("c", {"rule": "fetch_all", "prefetch": 1.5})
    with pytest.raises(ValueError, match=r"policies.c.beta: .*light_miss='host'.*beta must be 0"):
        mcfg.normalize_policy("c", {"rule": "threshold", "tau": 0.1, "beta": 0.5,
                                    "light_miss": "host"})  # fmt: skip


def test_offline_policies_stay_out_of_online_stages():
    pols = mcfg.expand_policies(
        {"policies": {"a": {"rule": "fetch_all"}}, "sweeps": {"belady": ["a"]}}
    )
    cfg = {"engine": {"policies": ["a"]}, "generate": {"policies": None}}
    stages = mcfg.stage_policies(cfg, pols)
    assert stages["simulate"] == ["a", "a_belady"]
    assert stages["emulate"] == stages["generate"] == ["a"]
    with pytest.raises(ValueError, match=r"emulate.policies: \['a_belady'\] use eviction 'belady'"):
        mcfg.stage_policies({**cfg, "emulate": {"policies": ["a_belady"]}}, pols)


def test_exact_twin_needs_equal_v2_fields():
    quality = mcfg.normalize_policy("q", {"rule": "threshold", "tau": 0.15, "eviction": "lfu",
                                          "beta": 0.5, "prefetch": 10})  # fmt: skip
    plain = mcfg.normalize_policy("p", {"rule": "threshold", "tau": 0.15, "eviction": "lfu"})
    assert not mcfg.is_exact_twin(quality, plain)
    assert mcfg.is_exact_twin(quality, {**plain, "prefetch": 10})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (msg,) = mcfg.missing_admission_twins({"q": quality, "p": plain})
    assert "prefetch: 10" in msg


# ---- co-activation artefact and simulate ------------------------------------------------------


def write_router(path: Path, streams: list[np.ndarray], lookahead: list[np.ndarray] | None):
    meta = {"num_experts": E, "top_k": K, "num_layers": L, "norm_topk_prob": True}
    with router_writer(path, E, meta, lookahead=lookahead is not None) as w:
        for i, z in enumerate(streams):
            w.write_table(router_rows(i, z, 0, None if lookahead is None else lookahead[i]))
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("traces")
    x = synthetic_logits(400, L, E, seed=3)
    y = synthetic_logits(400, L, E, seed=4)
    calib = [x[:150], x[150:200]]
    evals = [x[200:320], x[320:]]
    look = [y[200:320], y[320:]]
    return {
        "calib": calib,
        "eval": evals,
        "look": look,
        "calib_path": write_router(root / "calib_router.parquet", calib, None),
        "eval_path": write_router(root / "eval_router.parquet", evals, look),
        "root": root,
    }


def test_coactivation_artefact_is_the_calibration_table(traces, tmp_path):
    out = tmp_path / "m" / "coactivation.npz"
    write_coactivation(traces["calib_path"], out)
    table = read_coactivation(out, L, E)
    np.testing.assert_array_equal(table, coactivation(traces["calib"], K))
    assert not list(out.parent.glob(".*tmp"))  # the temp file was renamed away
    with pytest.raises(ValueError, match=r"does not match the trace's 4 layers"):
        read_coactivation(out, 4, E)
    with pytest.raises(FileNotFoundError, match="coactivation table"):
        read_coactivation(tmp_path / "nope.npz")


def test_simulate_stage_reads_lookahead_and_coactivation(traces, tmp_path):
    table_path = tmp_path / "coactivation.npz"
    write_coactivation(traces["calib_path"], table_path)
    A = coactivation(traces["calib"], K)
    cases = {
        "buddy": Policy(rule="threshold", tau=0.2, eviction="lfu", substitute_by="coactivation"),
        "pre": Policy(prefetch=3),
        "both": Policy(rule="threshold", tau=0.2, prefetch=2, substitute_by="coactivation"),
    }
    for name, pol in cases.items():
        out = tmp_path / f"{name}.parquet"
        run_simulate(str(traces["eval_path"]), None, name, pol.to_dict(), 0.25, str(out),
                     str(tmp_path / f"{name}.counts.parquet"),
                     coactivation_path=str(table_path))  # fmt: skip
        point = GridPoint.at_fraction(name, pol, 0.25, traces["eval"][0].shape[2])
        want = simulate(traces["eval"], K, [point], lookahead=traces["look"], coactivation=A)
        got = pl.read_parquet(out)
        assert got.equals(want), name
        meta = read_metadata(out)
        assert ("coactivation" in meta) == (pol.substitute_by == "coactivation")
    assert pl.read_parquet(tmp_path / "pre.parquet")["prefetches"][-1] > 0
    # a prefetching policy on a trace captured before v2 says what is missing
    old = write_router(tmp_path / "old.parquet", traces["eval"], None)
    with pytest.raises(ValueError, match="no lookahead logits"):
        run_simulate(str(old), None, "pre", cases["pre"].to_dict(), 0.25,
                     str(tmp_path / "x.parquet"), str(tmp_path / "x.counts.parquet"))  # fmt: skip
    with pytest.raises(ValueError, match="needs the co-activation table"):
        run_simulate(str(old), None, "buddy", cases["buddy"].to_dict(), 0.25,
                     str(tmp_path / "x.parquet"), str(tmp_path / "x.counts.parquet"))  # fmt: skip


def test_builtin_bound_only_for_demand_paging_of_v1_selections(traces):
    """The simulator's built-in Belady bound (fetch_all) is not a bound with prefetch (not
    demand paging) or route_bias (selections follow the cache): those rows carry none."""
    C = capacity_for(0.25, traces["eval"][0].shape[2])
    grid = [
        GridPoint("plain", Policy(), C),
        GridPoint("pre", Policy(prefetch=2), C),
        GridPoint("prior", Policy(route_bias=0.3), C),
    ]
    df = simulate(traces["eval"], K, grid, lookahead=traces["look"]).filter(pl.col("layer") == -1)
    bound = dict(zip(df["policy"], df["belady_hit_rate"], strict=True))
    assert bound["plain"] is not None and bound["pre"] is None and bound["prior"] is None


# ---- analysis part and report section ---------------------------------------------------------


@pytest.fixture(scope="module")
def design(tmp_path_factory):
    from fixtures_artefacts import DESIGN, DESIGN_TOKENS, N_LAYERS, add_design_space, make_study

    from moesub.stats import run_analysis

    root = tmp_path_factory.mktemp("design")
    inputs, params = make_study(root / "results")
    add_design_space(root / "results", inputs, params)
    doc = run_analysis(inputs, params, root / "analysis")
    ds = pd.read_parquet(root / "analysis" / "design_space.parquet").set_index("policy")
    fam = pd.read_parquet(root / "analysis" / "design_families.parquet").set_index("family")
    return {"root": root, "doc": doc, "ds": ds, "fam": fam, "design": DESIGN,
            "tokens": DESIGN_TOKENS, "layers": N_LAYERS}  # fmt: skip


def test_design_space_rows_known_values(design):
    ds, d = design["ds"], design["design"]
    assert design["doc"]["parts"]["design_space"] == {"status": "ok"}
    assert ds.loc["prefetch_10", "family"] == "prefetch"
    assert ds.loc["cache_prior_0.1", "family"] == "cache_prior"
    assert ds.loc["hybrid_015", "family"] == "hybrid"
    assert ds.loc["quality", "family"] == "study"
    assert ds.loc["host_compute", "family"] == "host_compute"
    assert ds.loc["fetch_every_miss_belady", "bound"] and not ds.loc["prefetch_10", "bound"]
    # misses per token: every selected expert not resident, over the layers of one token
    calls = design["tokens"] * 10 * design["layers"]
    hit = round(d["prefetch_10"][1] * calls)
    assert ds.loc["prefetch_10", "misses_per_token"] == pytest.approx(
        (calls - hit) / design["tokens"]
    )
    assert ds.loc["prefetch_10", "prefetches_per_token"] == pytest.approx(3 * design["layers"])
    assert ds.loc["prefetch_10", "est_time_per_token_s"] == d["prefetch_10"][3]
    # Δppl: emulated with its interval; lossless policies exactly 0; others unknown
    assert ds.loc["quality", "dppl_source"] == "emulated"
    assert ds.loc["quality", "dppl_ci_lo"] < ds.loc["quality", "dppl_pct"]
    assert ds.loc["hybrid_015", "dppl_pct"] == 0 and ds.loc["hybrid_015", "dppl_source"] == "exact"
    assert ds.loc["prefetch_10", "dppl_source"] == "exact"
    assert math.isnan(ds.loc["cache_prior_0.1", "dppl_pct"])  # rerouting is not lossless
    assert pd.isna(ds.loc["cache_prior_0.1", "dppl_source"])


def test_belady_gaps_pair_each_rule_with_its_bound(design):
    ds = design["ds"]
    for name, bound in (
        ("fetch_every_miss", "fetch_every_miss_belady"),
        ("rule_015", "rule_015_belady"),
        ("rule_015_lfu", "rule_015_belady"),  # the bound does not depend on the eviction
        ("prefetch_10", "prefetch_10_belady"),
    ):
        assert ds.loc[name, "belady_policy"] == bound, name
        gap = ds.loc[bound, "hit_rate"] - ds.loc[name, "hit_rate"]
        assert ds.loc[name, "belady_gap"] == pytest.approx(gap), name
    # quality (beta 0.5) has no simulated bound; a bound has no gap of its own
    assert pd.isna(ds.loc["quality", "belady_policy"])
    assert math.isnan(ds.loc["quality", "belady_gap"])
    assert math.isnan(ds.loc["rule_015_belady", "belady_gap"])


def test_pareto_fronts_and_family_bests(design):
    ds, fam = design["ds"], design["fam"]
    # hybrid_015 is lossless and faster than both lossless study policies: it dominates them
    assert ds.loc["hybrid_015", "frontier"]
    assert not ds.loc["fetch_every_miss", "frontier"] and not ds.loc["host_compute", "frontier"]
    # every front point is undominated, every other candidate with a Δppl is dominated
    cand = ds[~ds["bound"] & ds["dppl_pct"].notna()]
    for name, r in cand.iterrows():
        others = cand.drop(index=name)
        dominated = (
            (others["est_time_per_token_s"] <= r["est_time_per_token_s"])
            & (others["dppl_pct"] <= r["dppl_pct"])
            & ((others["est_time_per_token_s"] < r["est_time_per_token_s"])
               | (others["dppl_pct"] < r["dppl_pct"]))
        ).any()  # fmt: skip
        assert r["frontier"] == (not dominated), name
    assert not ds.loc[ds["bound"], "frontier"].any()  # a bound is never a candidate
    assert ds.loc["cache_prior_0.1", "frontier_mass"] == False  # noqa: E712 (numpy bool)
    # the simulate-only quality proxy counts rerouted mass with substituted mass
    assert ds.loc["cache_prior_0.1", "moved_mass_per_token_layer"] == pytest.approx(0.01)
    assert ds.loc["rule_015_belady", "moved_mass_per_token_layer"] == pytest.approx(0.04)
    assert set(fam.index) == {"study", "host_compute", "prefetch", "cache_prior", "hybrid"}
    assert fam.loc["hybrid", "best_policy"] == "hybrid_015"
    assert fam.loc["hybrid", "best_by"] == "within_quality"
    assert fam.loc["cache_prior", "best_by"] == "fastest"  # no Δppl known
    # study: the fastest within quality's Δppl
    within = ds[(ds["family"] == "study") & (ds["dppl_pct"] <= ds.loc["quality", "dppl_pct"])]
    assert fam.loc["study", "best_policy"] == within["est_time_per_token_s"].idxmin()
    assert fam.loc["study", "quality_dppl_pct"] == ds.loc["quality", "dppl_pct"]
    assert fam.loc["study", "speed_misses_per_token"] == ds.loc["speed", "misses_per_token"]
    assert fam["on_frontier"].sum() == ds["frontier"].sum()


def test_design_space_without_simulate_is_missing(tmp_path):
    from fixtures_artefacts import make_study

    from moesub.stats import run_analysis

    inputs, params = make_study(tmp_path / "r", names=["fetch_every_miss", "rule_015"])
    inputs["simulate"] = []
    doc = run_analysis(inputs, params, tmp_path / "an")
    assert doc["parts"]["design_space"]["status"] == "missing"
    assert pd.read_parquet(tmp_path / "an" / "design_families.parquet").empty


def test_report_design_section(design):
    from moesub.report import render_report

    root = design["root"]
    html = render_report(root / "analysis", {"title": "t"}, root / "report.html").read_text()
    section = html[html.index('id="design-section"') : html.index('id="generation-section"')]
    assert 'id="fig-design_space"' in section and "data:image/png;base64," in section
    assert (root / "figures" / "design_space.png").is_file()
    assert section.count("<tr data-family=") == len(design["fam"])
    assert section.count("<tr data-policy=") == len(design["ds"])
    assert "hybrid_015 (within_quality)" in section
    assert "(exact: lossless)" in section and "not emulated" in section
    gap = 100 * design["ds"].loc["fetch_every_miss", "belady_gap"]
    assert f"{gap:+.1f} pts (fetch_every_miss_belady)" in section
    assert "the time vs Δppl front holds hybrid (1), study" in section
    # the host-computing policies with and without concurrency on the study's profile
    table = section[section.index('id="concurrency-table"') :]
    table = table[: table.index("</table>")]
    assert table.count("<tr") == 1 + 2  # header, host_compute and hybrid_015
    assert "rtx3090_pcie4_ddr4" in table and "1.75x" in table and "1.25x" in table


# ---- workflow ---------------------------------------------------------------------------------


def test_dry_run_lists_the_design_space_jobs(tmp_path):
    from test_workflow import copy_workflow, planned_jobs

    wf = copy_workflow(tmp_path / "wf")
    jobs = planned_jobs(wf)
    by_rule: dict[str, set[str]] = {}
    for rule, out in jobs:
        by_rule.setdefault(rule, set()).add(out)
    assert by_rule["coactivation"] == {"results/embedded/coactivation.npz"}
    cfg, pols = default_policies()
    stages = mcfg.stage_policies(cfg, pols)
    simulated = {out.split("/")[3] for out in by_rule["simulate"]}
    assert simulated == set(pols)  # the v2 policies, both sweeps and the Belady bounds
    assert {"prefetch_10", "cache_prior_0.05", "prefetch_40", "quality_belady"} <= simulated
    emulated = {out.split("/")[3] for out in by_rule["emulate"]}
    assert emulated == set(stages["emulate"])
    assert not any(name.endswith("_belady") for name in emulated)
    assert {"quality_prefetch", "buddy_quality", "hybrid_015", "cache_prior_0.1"} <= emulated


@pytest.mark.parametrize("rule", ["simulate", "emulate"])
def test_the_table_is_an_input_only_for_coactivation_policies(tmp_path, rule):
    from test_workflow import copy_workflow, snakemake

    wf = copy_workflow(tmp_path / "wf")
    out = "results/embedded/{}/{}/f0.25.parquet"
    run = snakemake(wf, "--dry-run", out.format(rule, "buddy_quality"),
                    out.format(rule, "quality_prefetch"))  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:]
    blocks = [b for b in run.stdout.split("rule ") if b.startswith(f"{rule}:")]
    buddy = next(b for b in blocks if "/buddy_quality/" in b)
    prefetch = next(b for b in blocks if "/quality_prefetch/" in b)
    assert "results/embedded/coactivation.npz" in buddy
    assert "coactivation.npz" not in prefetch
