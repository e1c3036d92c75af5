"""The real-size benchmark's parts that need no timing: the captured-trace mapping onto the
benchmark's shape, the expert kernel's choice by token count, and the order of the runs. (The
cost fit is tests/test_calibration.py; the 10% agreement of the fitted profile with the engine
is a benchmark figure, `results/engine_bench/{device}.parquet`, not tested.)"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moesub.artefacts import router_rows, router_writer
from moesub.engine.bench_inputs import bench_logits, map_trace
from moesub.engine.bench_runs import (
    BenchRun,
    at_run_disk,
    disk_drift,
    jackknife_errors,
    policy_row,
    round_part,
    round_spread,
    round_sums,
)
from moesub.engine.calibrate import round_order, spread
from moesub.engine.kernels import GROUPED_MIN_TOKENS, expert_forward, path_for
from moesub.hardware import UnitCosts
from moesub.policy import ALL_RESIDENT, TOKEN_LAYER_DTYPE, TOKEN_LAYER_FIELDS
from moesub.pricing import price_stream
from moesub.run_speed import (
    SPEED_PROBE_TOKENS,
    AtRunDisk,
    DiskClock,
    engine_jackknife,
    part_sums,
    priced_at_speed,
    reference_clock,
)


def test_map_trace_layers_and_experts():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(5, 3, 8)).astype(np.float32)
    same = map_trace(z, 3, 8)
    np.testing.assert_array_equal(same, z)
    m = map_trace(z, 5, 3)  # layers 0 1 2 0 1; experts e <- max(z[e], z[e + 3], z[e + 6])
    assert m.shape == (5, 5, 3) and m.dtype == np.float32
    for layer, src in enumerate([0, 1, 2, 0, 1]):
        for e in range(3):
            want = z[:, src, [i for i in range(8) if i % 3 == e]].max(axis=1)
            np.testing.assert_array_equal(m[:, layer, e], want)
    assert np.isfinite(m).all()
    with pytest.raises(ValueError, match="never be routed"):
        map_trace(z, 2, 9)


def _write(path, streams):
    E, L = streams[0].shape[2], streams[0].shape[1]
    meta = {"num_experts": E, "top_k": 2, "num_layers": L, "norm_topk_prob": True}
    with router_writer(path, E, meta, lookahead=False) as w:
        for i, z in enumerate(streams):
            w.write_table(router_rows(i, z))


def test_bench_logits_from_a_capture(tmp_path):
    rng = np.random.default_rng(1)
    calib = [rng.normal(size=(6, 2, 8)).astype(np.float32) for _ in range(2)]
    evals = [rng.normal(size=(7, 2, 8)).astype(np.float32) for _ in range(3)]
    _write(tmp_path / "calib_router.parquet", calib)
    _write(tmp_path / "eval_router.parquet", evals)
    b = bench_logits("trace", 3, 4, 10, 9, 8, 0, tmp_path)
    cat_c, cat_e = np.concatenate(calib), np.concatenate(evals)  # streams in order
    np.testing.assert_array_equal(b.initial, map_trace(cat_c[:10], 3, 4))
    np.testing.assert_array_equal(b.validation, map_trace(cat_e[:9], 3, 4))
    np.testing.assert_array_equal(b.calibration, map_trace(cat_e[9:17], 3, 4))
    with pytest.raises(ValueError, match="evaluation tokens"):
        bench_logits("trace", 3, 4, 10, 15, 8, 0, tmp_path)
    with pytest.raises(FileNotFoundError, match="calib_router"):
        bench_logits("trace", 3, 4, 10, 9, 8, 0, tmp_path / "nowhere")
    s = bench_logits("synthetic", 2, 8, 10, 9, 8, 0)
    assert (s.initial.shape, s.validation.shape, s.calibration.shape) == (
        (10, 2, 8), (9, 2, 8), (8, 2, 8),
    )  # fmt: skip
    with pytest.raises(ValueError, match="routing"):
        bench_logits("replay", 2, 8, 10, 9, 8, 0)


def test_kernel_path_by_token_count():
    assert path_for("grouped", 1) == "per_expert"
    assert path_for("grouped", GROUPED_MIN_TOKENS) == "grouped"
    assert path_for("per_expert", 1000) == "per_expert"
    with pytest.raises(ValueError, match="expert kernel path"):
        path_for("gathered", 1)


@pytest.mark.parametrize("N", [1, 5])
def test_per_expert_kernel_matches_the_reference(N):
    g = torch.Generator().manual_seed(0)
    G, H, I, k = 6, 16, 8, 3
    gate_up, down = torch.randn(G, 2 * I, H, generator=g), torch.randn(G, H, I, generator=g)
    x, w = torch.randn(N, H, generator=g), torch.rand(N, k, generator=g)
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(G, size=k, replace=False) for _ in range(N)])
    ids[0, 1] = -1  # skipped
    want = torch.zeros(N, H)
    for n in range(N):
        for j in range(k):
            if ids[n, j] >= 0:
                gate, up = (gate_up[ids[n, j]] @ x[n]).chunk(2)
                want[n] += w[n, j] * (down[ids[n, j]] @ (F.silu(gate) * up))
    got = expert_forward(x, ids, w, gate_up, down, F.silu, "per_expert")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("n", "rounds"), [(15, 3), (15, 5), (4, 3), (3, 4), (2, 3), (1, 2)])
def test_rounds_run_every_name_once_and_never_one_twice_in_a_row(n, rounds):
    names = [f"run{i}" for i in range(n)]
    order = round_order(names, rounds)
    for r in range(rounds):
        assert sorted(order[r * n : (r + 1) * n]) == sorted(names)
    if n > 1:  # one slow stretch of the machine takes one of a name's runs, not two
        assert all(a != b for a, b in itertools.pairwise(order))
    if n >= 3 and rounds > 1:  # and the order changes from round to round
        assert order[:n] != order[n : 2 * n]


def test_rounds_spread_every_name_over_a_rounds_start_middle_and_end():
    names = [f"run{i}" for i in range(15)]
    order = round_order(names, 5)
    positions = {x: [i % 15 for i, y in enumerate(order) if y == x] for x in names}
    # rotated by 3 every round: each name once in every fifth of a round
    assert all(sorted(p // 3 for p in ps) == [0, 1, 2, 3, 4] for ps in positions.values())


def test_calibration_runs_are_spread_among_the_policies():
    policies = [f"p{i}" for i in range(10)]
    cal = ["c0", "c1", "c2", "c3", "c4"]
    out = spread(cal, policies)
    assert out == ["p0", "p1", "c0", "p2", "p3", "c1", "p4", "p5", "c2", "p6", "p7", "c3",
                   "p8", "p9", "c4"]  # fmt: skip
    assert spread(cal[:1], policies[:3]) == ["p0", "p1", "p2", "c0"]
    assert spread(cal[:2], []) == cal[:2] and spread([], policies[:2]) == policies[:2]


def _run(wall: np.ndarray, counts: np.ndarray, reads: int, busy_s: float) -> BenchRun:
    T = len(wall)
    zeros = np.zeros(T)
    return BenchRun(wall, zeros, zeros, zeros, np.zeros((T, 5)), counts, zeros, zeros, 0, 0, 1.0,
                    0.0, DiskClock(reads, busy_s))  # fmt: skip


def test_round_spread_is_the_rounds_ratios_to_their_price_max_minus_min_over_their_median():
    """Each round's time over its price (the rounds run different tokens, so their times alone
    would differ by their work), (max - min) / median of those ratios; NaN with one round."""
    c = np.zeros((3, 2, len(TOKEN_LAYER_FIELDS)), TOKEN_LAYER_DTYPE)
    c[..., 0] = 4
    walls = [np.array([0.01, 0.03, 0.02]), np.array([0.03, 0.03]), np.array([0.025] * 4)]
    runs = [_run(w, c[: len(w)], 0, 0.0) for w in walls]  # 60, 60 and 100 ms in all
    priced = np.array([0.02, 0.02, 0.02, 0.03, 0.03, 0.02, 0.02, 0.02, 0.02])  # 60, 60, 80 ms
    assert round_spread(runs, priced) == pytest.approx((1.25 - 1.0) / 1.0, rel=1e-12)
    assert math.isnan(round_spread(runs[:1], priced[:3]))


def test_a_policys_round_sums_are_its_rounds_time_and_price_and_give_its_error():
    """`policy_row` keeps each round's time and price (as measured) in all: they partition its
    tokens, and their sums' ratio less 1 is its `sim_rel_error` (the analysis resamples them)."""
    fields = {name: i for i, name in enumerate(TOKEN_LAYER_FIELDS)}
    costs = UnitCosts(copy_s=3e-3, expert_s=0.5e-3, host_expert_s=1e-3, dense_layer_s=0.6e-3,
                      token_overhead_s=0.2e-3, install_s=0.1e-3, concurrent_host=False,
                      host_reads_link=False)  # fmt: skip
    rng = np.random.default_rng(7)
    runs = []
    for T in (5, 4, 6):
        c = np.zeros((T, 2, len(TOKEN_LAYER_FIELDS)), TOKEN_LAYER_DTYPE)
        fetched = rng.integers(0, 3, (T, 2))
        c[..., fields["hit"]], c[..., fields["fetch"]] = 4 - fetched, fetched
        runs.append(_run(price_stream(c, 1, costs).token_s * rng.uniform(0.8, 1.3, T), c, 0, 0.0))
    row = policy_row(runs, 1, costs, [costs] * 3, None)
    priced = np.concatenate([price_stream(r.layer_counts, 1, costs).token_s for r in runs])
    time_s, priced_s = round_sums(runs, priced)
    assert row["round_time_s"] == pytest.approx([r.wall_s.sum() for r in runs], rel=1e-12)
    assert row["round_priced_s"] == pytest.approx(priced_s.tolist(), rel=1e-12)
    assert time_s.sum() == pytest.approx(sum(r.wall_s.sum() for r in runs), rel=1e-12)
    assert sum(row["round_priced_s"]) / sum(row["round_time_s"]) - 1 == pytest.approx(
        row["sim_rel_error"], rel=1e-12
    )
    with pytest.raises(ValueError, match="parts of 14 tokens in all for 15 tokens"):
        part_sums(priced, [5, 4, 5])


def test_each_round_left_out_with_the_calibration_refitted_without_it():
    """`jackknife_errors`: with each round r left out, the policy's other rounds priced at the
    profile refitted without r against their time (the joint error), and all its rounds so
    (the calibration's part alone); one refit per round, else an error; none without refits,
    and `policy_row` carries both lists."""
    fields = {name: i for i, name in enumerate(TOKEN_LAYER_FIELDS)}
    costs = UnitCosts(copy_s=3e-3, expert_s=0.5e-3, host_expert_s=1e-3, dense_layer_s=0.6e-3,
                      token_overhead_s=0.2e-3, install_s=0.1e-3, concurrent_host=False,
                      host_reads_link=False)  # fmt: skip
    rng = np.random.default_rng(11)
    runs, over = [], (1.1, 0.9, 1.2, 1.0)  # each round's time over its price at `costs`
    for T, f in zip((5, 4, 6, 5), over, strict=True):
        c = np.zeros((T, 2, len(TOKEN_LAYER_FIELDS)), TOKEN_LAYER_DTYPE)
        fetched = rng.integers(0, 3, (T, 2))
        c[..., fields["hit"]], c[..., fields["fetch"]] = 4 - fetched, fetched
        runs.append(_run(price_stream(c, 1, costs).token_s * f, c, 0, 0.0))
    price = [price_stream(r.layer_counts, 1, costs).token_s.sum() for r in runs]
    wall = [r.wall_s.sum() for r in runs]
    # every refit the same profile: the calibration's part alone is the error itself
    joint, calibration = jackknife_errors(runs, 1, [costs] * 4)
    error = sum(price) / sum(wall) - 1
    assert calibration == pytest.approx([error] * 4, rel=1e-12)
    for r in range(4):
        rest = (sum(price) - price[r]) / (sum(wall) - wall[r]) - 1
        assert joint[r] == pytest.approx(rest, rel=1e-12)
    # a refit without round 2 whose copies are dearer prices every round higher there
    dear = replace(costs, copy_s=6e-3)
    joint, calibration = jackknife_errors(runs, 1, [costs, costs, dear, costs])
    priced_dear = [price_stream(r.layer_counts, 1, dear).token_s.sum() for r in runs]
    assert calibration[2] == pytest.approx(sum(priced_dear) / sum(wall) - 1, rel=1e-12)
    assert joint[2] == pytest.approx(
        (sum(priced_dear) - priced_dear[2]) / (sum(wall) - wall[2]) - 1, rel=1e-12
    )
    assert calibration[2] > calibration[0]
    assert jackknife_errors(runs, 1, []) == ([], [])
    with pytest.raises(ValueError, match="jackknife: 3 refits for 4 rounds"):
        jackknife_errors(runs, 1, [costs] * 3)
    row = policy_row(runs, 1, costs, [costs] * 4, None, [costs, costs, dear, costs])
    assert (row["jackknife_rel_error"], row["calibration_jackknife_rel_error"]) == (
        joint, calibration,
    )  # fmt: skip


def test_engine_runs_jackknife_over_the_stage_rounds():
    """`engine_jackknife`: an engine run's streams grouped by the engine stage's round each was
    decoded in, each round left out with the calibration refitted without it (a round with no
    stream of the run prices its refit alone); nothing without refits, under 3 rounds, or where
    the rounds are not the refits'."""
    fields = {name: i for i, name in enumerate(TOKEN_LAYER_FIELDS)}
    costs = UnitCosts(copy_s=3e-3, expert_s=0.5e-3, host_expert_s=1e-3, dense_layer_s=0.6e-3,
                      token_overhead_s=0.2e-3, install_s=0.1e-3, concurrent_host=False,
                      host_reads_link=False)  # fmt: skip
    dear = replace(costs, copy_s=6e-3)
    rng = np.random.default_rng(5)
    streams = []
    for T in (5, 4, 6, 3):
        c = np.zeros((T, 2, len(TOKEN_LAYER_FIELDS)), TOKEN_LAYER_DTYPE)
        fetched = rng.integers(0, 3, (T, 2))
        c[..., fields["hit"]], c[..., fields["fetch"]] = 4 - fetched, fetched
        streams.append(c)
    over = (1.1, 0.9, 1.2, 1.0)  # each stream's time over its price at `costs`
    wall = np.concatenate([price_stream(c, 1, costs).token_s * f
                           for c, f in zip(streams, over, strict=True)])  # fmt: skip
    rounds, refits = [0, 0, 1, 3], [costs, dear, costs, costs]  # round 2: none of its streams
    joint, alone = engine_jackknife(wall, streams, 1, refits, rounds)
    time_s = np.split(wall, np.cumsum([5, 4, 6]))  # per stream
    by_round = np.array([time_s[0].sum() + time_s[1].sum(), time_s[2].sum(), 0.0,
                         time_s[3].sum()])  # fmt: skip
    for r, refit in enumerate(refits):
        priced = [price_stream(c, 1, refit).token_s.sum() for c in streams]
        p_round = np.array([priced[0] + priced[1], priced[2], 0.0, priced[3]])
        assert alone[r] == pytest.approx(p_round.sum() / by_round.sum() - 1, rel=1e-12)
        rest = (p_round.sum() - p_round[r]) / (by_round.sum() - by_round[r]) - 1
        assert joint[r] == pytest.approx(rest, rel=1e-12)
    assert joint[2] == pytest.approx(alone[2], rel=1e-12) and alone[1] > alone[0]
    assert engine_jackknife(wall, streams, 1, [], rounds) == ([], [])
    assert engine_jackknife(wall, streams, 1, refits[:2], [0, 0, 1, 1]) == ([], [])
    assert engine_jackknife(wall, streams, 1, refits, None) == ([], [])  # outside the stage
    assert engine_jackknife(wall, streams, 1, refits, [0, 1, 2]) == ([], [])
    assert engine_jackknife(wall, streams, 1, refits, [0, 1, 2, 4]) == ([], [])


def test_round_part_shares_the_measured_tokens_out_and_runs_the_warmup_before_each():
    """Round r of R runs the r-th of R contiguous shares of the measured tokens (the first ones
    one longer where they do not divide), each after the `warmup` rows just before it: the
    shares' measured rows partition the measured rows, in order."""
    warmup, tokens, rounds = 4, 11, 3
    rows = np.arange(warmup + tokens)
    parts = [rows[round_part(tokens, warmup, rounds, r)] for r in range(rounds)]
    assert [len(part) - warmup for part in parts] == [4, 4, 3]
    assert np.array_equal(np.concatenate([part[warmup:] for part in parts]), rows[warmup:])
    assert [part[0] for part in parts] == [0, 4, 8]  # each share's warmup: the rows before it
    assert len(rows[round_part(tokens, 0, 1, 0)]) == tokens


def test_pricing_at_the_disk_speed_each_run_read_at():
    """A copy is a read plus the copy's other work: priced at the disk's speed while each run
    read (its reads' time per expert against the calibration's), a run on a slower disk and a
    host run on another are priced at their measured means exactly."""
    K, T, L = 4, 60, 2
    fields = {name: i for i, name in enumerate(TOKEN_LAYER_FIELDS)}
    rng = np.random.default_rng(3)
    overhead, ref_read = 0.4e-3, 3e-3  # per copy: the copy's other work; the calibration's read
    costs = UnitCosts(copy_s=overhead + ref_read, expert_s=30e-6, host_expert_s=0.5e-3,
                      dense_layer_s=0.5e-3, token_overhead_s=1e-3, install_s=40e-6,
                      concurrent_host=False, host_reads_link=True)  # fmt: skip

    def counts(kind: str) -> np.ndarray:
        c = np.zeros((T, L, len(TOKEN_LAYER_FIELDS)), TOKEN_LAYER_DTYPE)
        n = rng.integers(0, K + 1, (T, L))
        c[..., fields["hit"]] = K - (0 if kind == "hits" else n)
        if kind != "hits":
            c[..., fields[kind]] = n
        return c

    def run(kind: str, read: float) -> BenchRun:  # timed as the pricing at that disk speed
        c = counts(kind)
        u = replace(costs, copy_s=overhead + read)
        reads = int(c[..., fields["fetch"]].sum() + c[..., fields["host"]].sum())
        return _run(price_stream(c, 1, u).token_s, c, reads, reads * read if reads else 0.0)

    runs = {
        "cal_fetch": [run("fetch", ref_read)], "cal_admit": [run("hits", 0.0)],
        "cal_host": [run("host", 5e-3)], "fetch_every_miss": [run("fetch", 4.5e-3)],
        "host_compute": [run("host", 2e-3)], ALL_RESIDENT: [run("hits", 0.0)],
    }  # fmt: skip
    reference = reference_clock([r.disk for r in runs["cal_fetch"]])  # the copy run's
    assert reference.per_read_s == pytest.approx(ref_read, rel=1e-12)
    assert AtRunDisk.from_dict(AtRunDisk(reference).to_dict()) == AtRunDisk(reference)
    at_disk = at_run_disk(runs, reference, costs)
    for name in ("fetch_every_miss", "host_compute", ALL_RESIDENT, "cal_host"):
        (r,), (u,) = runs[name], at_disk[name]
        priced = price_stream(r.layer_counts, 1, u).token_s.mean()
        assert priced == pytest.approx(r.wall_s.mean(), rel=1e-9), name
    assert at_disk["fetch_every_miss"][0].copy_s == pytest.approx(overhead + 4.5e-3, rel=1e-12)
    # without reads (the CUDA tier) there is no reference and every run keeps the costs
    no_reads = {n: [_run(r.wall_s, r.layer_counts, 0, 0.0) for r in rs] for n, rs in runs.items()}
    none = reference_clock([r.disk for rs in no_reads.values() for r in rs])
    kept = at_run_disk(no_reads, none, costs)
    assert none is None and all(u == costs for us in kept.values() for u in us)


def test_pricing_at_the_speed_each_run_computed_at():
    """A run timed on a machine 1.25x slower at compute (and its disk as the calibration's) is
    priced at its mean exactly once its compute terms take the speed probed on its own tokens
    that only hit; its copies are not scaled. Too few such tokens: no probe, the costs kept."""
    K, T, L, slow = 4, 80, 2, 1.25
    fields = {name: i for i, name in enumerate(TOKEN_LAYER_FIELDS)}
    costs = UnitCosts(copy_s=3e-3, expert_s=0.5e-3, host_expert_s=1e-3, dense_layer_s=0.6e-3,
                      token_overhead_s=0.2e-3, install_s=0.1e-3, concurrent_host=False,
                      host_reads_link=True)  # fmt: skip
    slower = replace(costs, **{t: getattr(costs, t) * slow for t in
                               ("expert_s", "dense_layer_s", "token_overhead_s", "host_expert_s",
                                "install_s")})  # fmt: skip
    rng = np.random.default_rng(5)
    c = np.zeros((T, L, len(TOKEN_LAYER_FIELDS)), TOKEN_LAYER_DTYPE)
    fetched = rng.integers(0, 3, (T, L)) * (rng.random((T, 1)) < 0.5)  # half the tokens hit only
    c[..., fields["hit"]], c[..., fields["fetch"]] = K - fetched, fetched
    wall = price_stream(c, 1, slower).token_s
    plain, speed, est = priced_at_speed(wall, [c], 1, costs)
    assert speed == pytest.approx(slow, rel=1e-9)
    assert est.mean() == pytest.approx(wall.mean(), rel=1e-9)
    # unprobed: under
    assert np.array_equal(plain, price_stream(c, 1, costs).token_s)
    assert plain.mean() < 0.9 * wall.mean()
    # a policy's rounds (parts of its tokens, each from an idle link), the second read at a
    # slower disk: each priced at its own costs, one speed over all
    slower_disk = replace(costs, copy_s=5e-3)
    parts = [c[:30], c[30:]]
    timed_at = [slower, replace(slower, copy_s=5e-3)]
    wall = np.concatenate(
        [price_stream(p, 1, u).token_s for p, u in zip(parts, timed_at, strict=True)]
    )
    _, speed, est = priced_at_speed(wall, parts, 1, [costs, slower_disk])
    assert speed == pytest.approx(slow, rel=1e-9)
    assert est == pytest.approx(wall, rel=1e-9)
    few = c.copy()
    few[SPEED_PROBE_TOKENS - 1 :, :, fields["fetch"]] = 1  # 9 tokens hit only
    few[SPEED_PROBE_TOKENS - 1 :, :, fields["hit"]] = K - 1
    plain, speed, est = priced_at_speed(price_stream(few, 1, slower).token_s, [few], 1, costs)
    assert math.isnan(speed) and est is plain


def test_disk_drift_against_the_reference_run():
    runs = [_run(np.ones(2), np.zeros((2, 1, len(TOKEN_LAYER_FIELDS))), n, n * t)
            for n, t in ((10, 4e-3), (10, 3e-3), (0, 0.0))]  # fmt: skip
    d = disk_drift(runs, DiskClock(10, 10 * 3e-3))
    assert d == {"disk_read_s": pytest.approx(3.5e-3), "disk_drifted": True,
                 "disk_vs_calibration": pytest.approx(3.5 / 3)}  # fmt: skip
    d = disk_drift(runs[2:], None)
    assert math.isnan(d["disk_read_s"]) and math.isnan(d["disk_vs_calibration"])
    assert d["disk_drifted"] is False
