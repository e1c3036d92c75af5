"""moesub.expb, matched design: `matched_masks`, the hash, feasibility, the plan and the run."""

from __future__ import annotations

import itertools

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesub.artefacts import Trace, load_trace
from moesub.expb import (
    ForcedRouter,
    PlannedIds,
    check_targets,
    feasibility_table,
    gate_weights,
    matched_masks,
    matched_plan,
    run_expb,
    run_feasibility,
    token_layer_hash,
)
from moesub.io import read_metadata
from moesub.policy import forced_substitution

E, K, L = 24, 8, 3


# --------------------------------------------------------------------------- matched_masks
def valid_pairs(w: np.ndarray, hm: float) -> list[tuple[int, tuple[int, ...]]]:
    """Every (heavy rank index, light index set) the matched rules allow in row w (brute force)."""
    k = w.size
    out = []
    for h in range(1, k):
        if abs(w[h] - hm) > 0.1 * hm:
            continue
        others = [j for j in range(1, k) if j != h and w[j] <= 0.5 * w[h]]
        for r in range(3, len(others) + 1):
            for s in itertools.combinations(others, r):
                if abs(w[list(s)].sum() - w[h]) <= 0.05 * w[h]:
                    out.append((h, s))
    return out


@st.composite
def gate_rows(draw):
    """Rows in rank order, many of them eligible: a heavy weight near heavy_mass, a few light
    ones summing near it, the rest spread; ties and exact boundaries included."""
    k = draw(st.integers(2, 10))
    n = draw(st.integers(1, 6))
    hm = draw(st.sampled_from([0.05, 0.1, 0.125, 0.2]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    rows = []
    for _ in range(n):
        kind = draw(st.sampled_from(["dirichlet", "planted", "boundary"]))
        if kind == "dirichlet":
            w = rng.dirichlet(np.full(k, draw(st.sampled_from([0.3, 1.0, 4.0]))))
        else:
            wh = hm * (1.1 if kind == "boundary" else rng.uniform(0.9, 1.1))
            n_light = min(max(k - 2, 0), int(rng.integers(3, 6)))
            light = rng.dirichlet(np.ones(max(n_light, 1)))[:n_light] * wh * rng.uniform(0.95, 1.05)
            rest = [1.0 - wh - light.sum()]
            w = np.r_[rest, wh, light, np.zeros(max(k - 2 - n_light, 0))][:k]
            w = np.abs(w)
        if draw(st.booleans()):
            w = np.round(w * 64) / 64  # ties
        rows.append(-np.sort(-w))
    return np.array(rows), hm


@settings(max_examples=300, deadline=None)
@given(gate_rows())
def test_matched_masks_properties(case):
    w, hm = case
    heavy, light = matched_masks(w, hm)
    assert heavy.shape == light.shape == w.shape and heavy.dtype == light.dtype == bool
    assert not heavy[:, 0].any() and not light[:, 0].any()  # rank 1 never marked
    assert not (heavy & light).any()
    for i, row in enumerate(w):
        pairs = valid_pairs(row, hm)
        eligible = heavy[i].any()
        assert eligible == light[i].any()  # both or neither
        assert eligible == bool(pairs)  # every eligible row is marked, nothing else
        if not eligible:
            continue
        (h,) = np.flatnonzero(heavy[i])  # exactly one heavy expert
        s = np.flatnonzero(light[i])
        assert abs(row[h] - hm) <= 0.1 * hm
        assert s.size >= 3 and (row[s] <= 0.5 * row[h]).all()
        assert abs(row[s].sum() - row[h]) <= 0.05 * row[h]
        # the documented choice: heavy closest to heavy_mass (then the better rank), light sum
        # closest to w_H (then the smallest bit mask)
        best_h = min({p[0] for p in pairs}, key=lambda j: (abs(row[j] - hm), j))
        assert h == best_h
        sets = [p[1] for p in pairs if p[0] == h]
        best_s = min(
            sets,
            key=lambda t: (
                round(abs(row[list(t)].sum() - row[h]) / row[h], 9),
                sum(1 << (j - 1) for j in t),
            ),
        )
        assert tuple(s) == best_s


def test_matched_masks_hand_made():
    w = np.array(
        [
            [0.5, 0.125, 0.0625, 0.03125, 0.03125, 0.0],  # 0.0625+0.03125+0.03125 = 0.125
            [0.5, 0.125, 0.125, 0.0625, 0.0625, 0.0625],  # light: 2 too few, 3 too heavy
            [0.125, 0.125, 0.0625, 0.03125, 0.03125, 0.0],  # rank 1 would be heavy: rank 2 is
        ]
    )
    heavy, light = matched_masks(w, 0.125)
    assert heavy.tolist()[0] == [False, True, False, False, False, False]
    assert light.tolist()[0] == [False, False, True, True, True, False]
    assert not heavy[1].any() and not light[1].any()
    assert heavy[2, 1] and not heavy[2, 0]
    assert not matched_masks(w[:, :4], 0.125)[0].any()  # k = 4: no room for 1 + 3 tail experts
    with pytest.raises(ValueError, match="rank order"):
        matched_masks(w[:, ::-1], 0.125)
    with pytest.raises(ValueError, match="heavy_mass"):
        matched_masks(w, 0.0)
    with pytest.raises(ValueError, match="weights"):
        matched_masks(np.ones(4), 0.1)


# --------------------------------------------------------------------------- hash, feasibility
def test_token_layer_hash():
    u = token_layer_hash(0, 3, 500, 4)
    assert u.shape == (500, 4) and ((u >= 0) & (u < 1)).all()
    np.testing.assert_array_equal(u, token_layer_hash(0, 3, 500, 4))
    np.testing.assert_array_equal(u[:100], token_layer_hash(0, 3, 100, 4))  # prefix-stable
    assert not np.array_equal(u, token_layer_hash(1, 3, 500, 4))
    assert not np.array_equal(u, token_layer_hash(0, 4, 500, 4))
    assert abs(u.mean() - 0.5) < 0.03 and len(np.unique(u)) == u.size
    with pytest.raises(ValueError, match="seed"):
        token_layer_hash(-1, 0, 2, 2)


def synthetic_trace(n_streams=3, T=60, seed=0, scale=2.0) -> Trace:
    rng = np.random.default_rng(seed)
    logits = [(rng.normal(size=(T, L, E)) * scale).astype(np.float32) for _ in range(n_streams)]
    meta = {"num_experts": E, "top_k": K, "num_layers": L, "norm_topk_prob": True}
    return Trace(list(range(n_streams)), logits, meta)


def test_feasibility_and_target_check():
    trace = synthetic_trace()
    table = feasibility_table(trace, [0.05, 0.1], configured=0.08)
    assert table["heavy_mass"].to_list() == [0.05, 0.08, 0.1]
    assert table["configured"].to_list() == [False, True, False]
    w = np.concatenate([gate_weights(z, K)[0].reshape(-1, K) for z in trace.logits])
    heavy, light = matched_masks(w, 0.08)
    row = table.row(1, named=True)
    assert row["token_layers"] == w.shape[0] and row["eligible"] == heavy.any(1).sum() > 0
    mean_mass = 0.5 * ((w * heavy).sum() + (w * light).sum()) / w.shape[0]
    assert row["max_target"] == pytest.approx(mean_mass)
    assert row["mean_rank_light"] > row["mean_rank_heavy"]  # the rank confound
    assert check_targets(table, 0.08, [row["max_target"]], "key") == row["max_target"]
    with pytest.raises(ValueError, match=r"expb\.x: target mass\(es\) \[0\.5\].*reachable range"):
        check_targets(table, 0.08, [0.001, 0.5], "expb.x")
    zero = feasibility_table(synthetic_trace(scale=0.01), [0.3])  # near-uniform: no support
    with pytest.raises(ValueError, match="no token-layer is eligible at heavy_mass 0.3"):
        check_targets(zero, 0.3, [0.01], "k")


def test_matched_plan_hits_the_target_at_the_same_token_layers():
    trace = synthetic_trace()
    top = check_targets(feasibility_table(trace, [0.1]), 0.1, [], "k")
    plans = [matched_plan(trace, 0.1, m, seed=0) for m in (0.3 * top, 0.6 * top)]
    for plan, m in zip(plans, (0.3 * top, 0.6 * top), strict=True):
        mean = 0.5 * (plan.planned_heavy + plan.planned_light)
        assert m <= mean <= m + 0.2 / (3 * 60 * L)  # one token-layer's mass at most past m*
        assert abs(plan.planned_heavy - plan.planned_light) <= 0.05 * plan.planned_heavy
        for h, light in zip(plan.ids["heavy"], plan.ids["light"], strict=True):
            at_h, at_l = (h >= 0).any(axis=2), (light >= 0).any(axis=2)
            np.testing.assert_array_equal(at_h, at_l)  # the same token-layers
            assert ((h >= 0).sum(axis=2) <= 1).all() and ((light >= 0).sum(axis=2)[at_l] >= 3).all()
            assert (h[..., 0] < 0).all() and (light[..., 0] < 0).all()
    small, large = plans
    for a, b in zip(small.ids["heavy"], large.ids["heavy"], strict=True):
        assert ((a >= 0) <= (b >= 0)).all()  # nested: a larger target adds token-layers
    again = matched_plan(trace, 0.1, 0.3 * top, seed=0)
    assert all(
        np.array_equal(a, b) for a, b in zip(again.ids["light"], small.ids["light"], strict=True)
    )
    other = matched_plan(trace, 0.1, 0.3 * top, seed=1)
    assert not all(
        np.array_equal(a, b) for a, b in zip(other.ids["heavy"], small.ids["heavy"], strict=True)
    )
    whole = matched_plan(trace, 0.1, 2 * top, seed=0)  # unreachable: every eligible token-layer
    assert whole.share == 1.0 and 0.5 * (
        whole.planned_heavy + whole.planned_light
    ) == pytest.approx(top)


def test_planned_ids_substitute_exactly_the_plan():
    rng = np.random.default_rng(1)
    z = (rng.normal(size=(200, E)) * 2).astype(np.float32)
    _, w, sel = forced_substitution(z, K, np.arange(E), np.zeros((200, K), bool))
    heavy, light = matched_masks(w, 0.1)
    assert heavy.any()
    resident = np.stack([np.arange(16)] * L).astype(np.int32)
    for mask in (heavy, light):
        planned = np.where(mask, sel, -1)[:, None, :].repeat(L, axis=1)  # (T, L, k)
        router = ForcedRouter(resident, PlannedIds(planned), K)
        ids, selected, realized, n_sub, rank_sum, planned = router.decide(1, z)
        np.testing.assert_array_equal(ids != selected, mask)
        np.testing.assert_allclose(realized, (w * mask).sum(1), rtol=0, atol=0)
        np.testing.assert_array_equal(rank_sum, (mask * np.arange(1, K + 1)).sum(1))
        np.testing.assert_array_equal(planned, mask.sum(1))


# --------------------------------------------------------------------------- the stage
def test_run_feasibility_refuses_an_unreachable_target(expb_stage):
    out = expb_stage / "feasibility.parquet"
    with pytest.raises(ValueError, match=r"expb\.designs\.matched\.masses.*reachable range"):
        run_feasibility(expb_stage / "calib_router.parquet", out, 0.1, [0.9])
    assert not out.exists()
    run_feasibility(expb_stage / "calib_router.parquet", out, 0.1, [0.002])
    table = pl.read_parquet(out)
    assert table.filter(pl.col("configured"))["heavy_mass"].to_list() == [0.1]
    assert read_metadata(out)["mass_unit"] == "per token-layer"


def test_run_expb_matched(expb_stage):
    feas = expb_stage / "feasibility.parquet"
    run_feasibility(expb_stage / "calib_router.parquet", feas, 0.1, [0.002])
    top = pl.read_parquet(feas).filter(pl.col("configured"))["max_target"][0]
    target = round(0.5 * top, 4)
    params = {"fraction": 0.75, "progress": False, "heavy_mass": 0.1}
    args = tuple(expb_stage / name for name in ("model", "eval_tokens.parquet", "ranking.parquet"))
    kw = {"router_path": expb_stage / "eval_router.parquet", "feasibility_path": feas}
    out = {
        c: pl.read_parquet(
            run_expb(*args, "matched", c, target, expb_stage / f"{c}.parquet", params, **kw)
        )
        for c in ("heavy", "light")
    }
    meta = read_metadata(expb_stage / "heavy.parquet")
    assert meta["design"] == "matched" and meta["heavy_mass"] == 0.1 and 0 < meta["plan_share"] <= 1
    plan = matched_plan(load_trace(expb_stage / "eval_router.parquet"), 0.1, target, 0)
    assert meta["plan_token_layers"] == plan.planned_token_layers
    planned = np.concatenate([(h >= 0).any(axis=2) for h in plan.ids["heavy"]])  # (N, L)
    for c, df in out.items():
        lm = np.stack(df["layer_mass"].to_list())
        assert ((lm > 0) <= planned).all()  # substitutions only at planned token-layers
        assert (df["n_sub"] <= df["n_planned"]).all()
        assert df["n_planned"].sum() == sum((i >= 0).sum() for i in plan.ids[c])
        assert lm.mean() == pytest.approx(target, rel=0.25)  # live weights near the plan's
    h, light = (np.stack(out[c]["layer_mass"].to_list()) > 0 for c in ("heavy", "light"))
    assert (h & light).sum() >= 0.8 * (h | light).sum()  # mostly the same token-layers
    assert out["light"]["rank_sum"].sum() / out["light"]["n_sub"].sum() > (
        out["heavy"]["rank_sum"].sum() / out["heavy"]["n_sub"].sum()
    )
    with pytest.raises(ValueError, match="reachable range"):  # checked before the model runs
        run_expb(*args, "matched", "heavy", 0.9, expb_stage / "x.parquet", params, **kw)


def test_workflow_plans_the_matched_design(tmp_path):
    """With targets, the matched design's jobs follow its feasibility pass (a dry run: the test
    config's top-4 model has no matched support, so its full run leaves the targets empty)."""
    import yaml
    from test_workflow import copy_workflow, load_test_config, planned_jobs, snakemake

    wf = copy_workflow(tmp_path / "wf")
    cfg = load_test_config()
    cfg["expb"]["designs"]["matched"]["masses"] = [0.01, 0.02]
    (wf / "matched.yaml").write_text(yaml.safe_dump(cfg))
    jobs = planned_jobs(wf, "--configfile", "matched.yaml")
    assert ("expb_feasibility", "results/embedded/expb/feasibility.parquet") in jobs
    expb = {out for rule, out in jobs if rule == "expb"}
    assert expb == {
        f"results/embedded/expb/{design}/{c}/m{m}.parquet"
        for design, masses in (("study", ["0.1"]), ("matched", ["0.01", "0.02"]))
        for m in masses
        for c in ("heavy", "light")
    }
    run = snakemake(wf, "--dry-run", "--configfile", "matched.yaml", "--printshellcmds")
    block = run.stdout.split("output: results/embedded/expb/matched/heavy/m0.01.parquet")[0]
    inputs = block.rsplit("rule expb:", 1)[1]
    assert "expb/feasibility.parquet" in inputs and "capture/eval_router.parquet" in inputs
