"""moesub.expb: the study design's selection rules and its forced-substitution run (the matched
design: tests/test_expb_matched.py)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch
from fixtures_artefacts import write_ranking
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import random_streams, tiny_qwen3_next

from moesub.expb import (
    ExpBParams,
    ForcedRouter,
    StudyRule,
    expb_streams,
    run_expb,
    select_heavy,
    select_light,
    select_substitutions,
)
from moesub.io import read_metadata, write_parquet
from moesub.models import stream_nll
from moesub.policy import forced_substitution

VOCAB, E, K, L, C = 97, 16, 4, 3, 8

# Binary fractions, so that sums are exact in float64.
W = np.array([[0.5, 0.1875, 0.125, 0.125, 0.0625]])


# --------------------------------------------------------------------------- selection rules
def test_heavy_on_hand_made_weights():
    assert select_heavy(W, 0.125).tolist() == [[False, False, True, False, False]]  # tie: rank 3
    assert select_heavy(W, 0.2).tolist() == [[False, True, False, False, False]]
    assert select_heavy(W, 0.1).tolist() == [[False, False, False, False, True]]
    assert not select_heavy(W, 0.05).any()  # no weight <= m*
    # the first choice is never substituted, even when its weight is the largest <= m*
    uniform = np.full((1, 4), 0.25)
    assert select_heavy(uniform, 0.3).tolist() == [[False, True, False, False]]
    assert not select_heavy(np.ones((2, 1)), 1.0).any()  # k = 1: nothing but the first choice


def test_light_on_hand_made_weights():
    # ascending: 0.0625 (rank 5), 0.125 (rank 4, the worse of the tie), 0.125 (rank 3), ...
    assert select_light(W, 0.25).tolist() == [[False, False, False, True, True]]
    assert select_light(W, 0.1875).tolist() == [[False, False, False, True, True]]  # sum == m*
    assert select_light(W, 0.3125).tolist() == [[False, False, True, True, True]]
    assert not select_light(W, 0.1).any()  # a run of one expert is rejected
    assert not select_light(W, 0.05).any()  # none eligible
    uniform = np.full((1, 4), 0.25)
    assert select_light(uniform, 1.0).tolist() == [[False, True, True, True]]  # never rank 1
    assert select_light(uniform, 0.5).tolist() == [[False, False, True, True]]
    assert not select_light(np.full((1, 2), 0.5), 1.0).any()  # k = 2: at most one candidate


def test_selection_rejects_bad_arguments():
    with pytest.raises(ValueError, match="condition"):
        select_substitutions(W, "medium", 0.1)
    with pytest.raises(ValueError, match="target_mass"):
        select_heavy(W, -0.1)
    with pytest.raises(ValueError, match="weights"):
        select_light(np.ones(4), 0.1)


@st.composite
def weight_rows(draw):
    k = draw(st.integers(2, 10))
    n = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    alpha = draw(st.sampled_from([0.2, 1.0, 5.0]))
    w = -np.sort(-rng.dirichlet(np.full(k, alpha), size=n), axis=1)  # rank order: descending
    if draw(st.booleans()):  # force ties
        w = np.round(w * 8) / 8
    return w, draw(st.floats(0.0, 0.6))


@settings(max_examples=200, deadline=None)
@given(weight_rows())
def test_selection_properties(case):
    w, m = case
    heavy, light = select_heavy(w, m), select_light(w, m)
    assert not heavy[:, 0].any() and not light[:, 0].any()
    tail = w[:, 1:]
    for i in range(len(w)):
        h = heavy[i, 1:]
        assert h.sum() <= 1
        eligible = tail[i][tail[i] <= m]
        assert h.sum() == (eligible.size > 0)
        if h.any():
            assert tail[i][h][0] == eligible.max()
        s = light[i, 1:]
        assert s.sum() != 1 and tail[i][s].sum() <= m
        if s.any():  # the lowest weights, and a maximal run
            assert tail[i][s].max() <= tail[i][~s].min(initial=np.inf)
            rest = np.sort(tail[i][~s])
            assert rest.size == 0 or tail[i][s].sum() + rest[0] > m
        else:  # the two lowest weights already exceed m*
            assert np.sort(tail[i])[:2].sum() > m or tail.shape[1] < 2


# --------------------------------------------------------------------------- forced emulation
def tiny_model(seed: int = 0):
    return tiny_qwen3_next(
        vocab=VOCAB, layers=L, experts=E, k=K, special_tokens=False, gate_std=0.3,
        layer_types=["linear_attention", "linear_attention", "full_attention"], expert_std=0.4,
        seed=seed,
    )  # fmt: skip


def tokens(lengths, seed=0) -> pl.DataFrame:
    return random_streams(lengths, VOCAB, seed)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def resident():
    rng = np.random.default_rng(4)
    return np.stack([rng.permutation(E)[:C] for _ in range(L)]).astype(np.int32)


@pytest.mark.parametrize("condition", ["heavy", "light"])
def test_router_decisions(condition, resident):
    rng = np.random.default_rng(0)
    z = (rng.normal(size=(400, E)) * 1.5).astype(np.float32)
    m = 0.2
    router = ForcedRouter(resident, StudyRule(condition, m), K)
    ids, selected, realized, n_sub, rank_sum, planned = router.decide(0, z)
    assert (ids[:, 0] == selected[:, 0]).all()  # the first choice is never substituted
    assert (realized <= m + 1e-12).all() and realized.max() > 0
    assert np.array_equal(n_sub, (ids != selected).sum(1))
    changed = ids != selected
    assert np.isin(ids[changed], resident[0]).all()  # substitutes come from the resident set
    for row in ids:  # a token never computes one expert twice
        assert len(set(row.tolist())) == K
    if condition == "heavy":
        assert n_sub.max() == 1
    else:
        assert set(np.unique(n_sub).tolist()) <= {0, 2, 3}
    # every selected rank is really substituted, also when its expert is resident (a resident
    # expert must not be its own substitute), so the realized mass is the selected weight
    _, w, sel = forced_substitution(z, K, resident[0], np.zeros((len(z), K), bool))
    mask = select_substitutions(w, condition, m)
    np.testing.assert_array_equal(ids != selected, mask)
    np.testing.assert_allclose(realized, (w * mask).sum(1), rtol=0, atol=0)
    np.testing.assert_array_equal(rank_sum, (mask * np.arange(1, K + 1)).sum(1))
    np.testing.assert_array_equal(planned, n_sub)
    assert (mask & np.isin(sel, resident[0])).any()  # the case occurs in this sample


def test_expb_streams_realized_mass_and_nll(model, resident):
    tt = tokens([40, 24], seed=2)
    out, realized = expb_streams(model, tt, "light", resident, target_mass=0.25, progress=False)
    cols = ["stream", "pos", "doc_id", "doc_start", "nll", "mass", "layer_mass", "n_sub"]
    cols += ["rank_sum", "n_planned"]
    assert out.columns == cols
    np.testing.assert_array_equal(np.stack(out["layer_mass"].to_list()), realized)
    assert realized.shape == (64, L) and (realized <= 0.25 + 1e-12).all()
    np.testing.assert_allclose(out["mass"].to_numpy(), realized.mean(1))  # per token-layer
    assert out["n_sub"].sum() > 0 and (out["n_planned"] == out["n_sub"]).all()
    exact = np.concatenate(
        [
            stream_nll(model, torch.as_tensor(g["token_id"].to_numpy().astype(np.int64))[None])[0]
            for _, g in tt.group_by("stream", maintain_order=True)
        ]
    )
    got = out["nll"].fill_null(np.nan).to_numpy()
    assert np.isnan(got).sum() == 2
    assert np.nanmax(np.abs(got - exact)) > 1e-4  # substitution changed the model
    # a target below every eligible weight changes nothing: the run is exactly the exact model
    none, zero = expb_streams(model, tt, "heavy", resident, target_mass=1e-9, progress=False)
    assert (zero == 0).all() and np.array_equal(
        none["nll"].fill_null(np.nan).to_numpy(), exact, equal_nan=True
    )
    with pytest.raises(ValueError, match="too small"):  # C < 2k - 1: a rank could lack a candidate
        expb_streams(model, tt, "light", resident[:, : 2 * K - 2], target_mass=0.25)
    with pytest.raises(ValueError, match="resident set"):
        expb_streams(model, tt, "light", resident[:2], target_mass=0.25)
    with pytest.raises(ValueError, match="not both"):
        expb_streams(model, tt, "light", resident)


@pytest.fixture(scope="module")
def stage(tmp_path_factory, model, resident):
    root = tmp_path_factory.mktemp("expb")
    model.save_pretrained(root / "model")
    write_parquet(tokens([30, 20], seed=5), root / "tokens.parquet")
    write_ranking(root / "ranking.parquet", resident, E)  # fraction 0.5: the prefix C
    return root


def test_run_expb(stage, model, resident):
    out = run_expb(
        stage / "model", stage / "tokens.parquet", stage / "ranking.parquet", "study",
        "heavy", 0.1, stage / "out" / "heavy.parquet", {"fraction": 0.5, "progress": False},
    )  # fmt: skip
    df = pl.read_parquet(out)
    meta = read_metadata(out)
    assert meta["design"] == "study" and meta["condition"] == "heavy" and meta["target_mass"] == 0.1
    assert meta["mass_unit"] == "per token-layer"
    assert meta["capacity"] == C and meta["resident"] == "initial"
    ref, realized = expb_streams(
        model, pl.read_parquet(stage / "tokens.parquet"), "heavy", resident, target_mass=0.1
    )
    assert df.equals(ref)
    assert meta["realized_mass_mean"] == pytest.approx(realized.mean())
    assert 0 < meta["realized_mass_mean"] <= 0.1
    assert (df["n_sub"] <= L).all()


def test_run_expb_rejects_bad_input(stage):
    args = (stage / "model", stage / "tokens.parquet", stage / "ranking.parquet")
    out = stage / "bad.parquet"
    with pytest.raises(ValueError, match="condition"):
        run_expb(*args, "study", "medium", 0.1, out, {"fraction": 0.5})
    with pytest.raises(ValueError, match="design"):
        run_expb(*args, "other", "heavy", 0.1, out, {"fraction": 0.5})
    with pytest.raises(ValueError, match="heavy_mass is required"):
        run_expb(*args, "matched", "heavy", 0.1, out, {"fraction": 0.5})
    with pytest.raises(ValueError, match="target_mass"):
        run_expb(*args, "study", "heavy", 1.5, out, {"fraction": 0.5})
    with pytest.raises(ValueError, match=r"C_l=2, outside \[k="):
        run_expb(*args, "study", "heavy", 0.1, out, {"fraction": 0.1})  # fewer slots than k
    with pytest.raises(ValueError, match="resident"):
        run_expb(*args, "study", "heavy", 0.1, out, {"resident": "some"})
    with pytest.raises(FileNotFoundError, match="tokens_path"):
        run_expb(args[0], stage / "none.parquet", args[2], "study", "heavy", 0.1, out)
    assert not out.exists()
    assert ExpBParams.from_dict(None).fraction == 0.25
