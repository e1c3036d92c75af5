"""The cost fit (moesub.calibration): known constants recovered from synthetic timed runs priced
by the pricing itself, with noise and slowed tokens; a host reading over the link fitted through
the pricing; non-negativity; degenerate fits named."""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np
import pytest

from moesub.calibration import (
    FIT_TERMS,
    CostFit,
    TimedTokens,
    fit_unit_costs,
    host_terms_by_pricing,
    run_errors,
    term_by_pricing,
    unit_costs_from_fit,
)
from moesub.hardware import ModelBytes, UnitCosts, measured_profile
from moesub.pricing import price_stream_reference
from moesub.run_speed import AtRunDisk, DiskClock, copy_at_disk, reference_clock
from moesub.vocabulary import TOKEN_LAYER_FIELDS

K, L = 4, 3
F = {name: i for i, name in enumerate(TOKEN_LAYER_FIELDS)}
TRUE = UnitCosts(
    copy_s=400e-6,
    expert_s=30e-6,
    host_expert_s=250e-6,
    dense_layer_s=500e-6,
    token_overhead_s=2e-3,
    install_s=40e-6,
    concurrent_host=False,
    sync_step_s=150e-6,
    host_step_s=100e-6,
)


def mechanism_counts(kind: str, T: int, layers: int, rng: np.random.Generator) -> np.ndarray:
    """(T, layers, F) counts of one calibration mechanism (every layer computes K experts)."""
    c = np.zeros((T, layers, len(TOKEN_LAYER_FIELDS)), np.int64)
    c[..., F["hit"]] = K
    if kind == "fetch":
        n = rng.integers(0, K + 1, (T, layers))
        c[..., F["fetch"]], c[..., F["hit"]] = n, K - n
    elif kind == "host":
        n = rng.integers(0, K + 1, (T, layers))
        c[..., F["host"]], c[..., F["hit"]] = n, K - n
    elif kind == "admit":  # rank-1 misses fetched, the others substituted, a few admissions
        fetch = rng.integers(0, 2, (T, layers))
        sub = rng.integers(0, 3, (T, layers))
        c[..., F["fetch"]], c[..., F["sub"]] = fetch, sub
        c[..., F["hit"]] = K - fetch - sub
        requests = (rng.random((T, layers)) < 0.3).astype(np.int64)
        c[..., F["admission_requests"]] = requests
        c[1:, :, F["admissions"]] = requests[:-1]  # landed one token later (delay 1)
    return c


def timed_runs(seed: int, noise: float, slowed: float, costs: UnitCosts = TRUE):
    """Interleaved rounds of every mechanism, wall times = the pricing's + noise; a share
    `slowed` of the tokens 3x slower (another process took the CPU)."""
    rng = np.random.default_rng(seed)
    parts = []
    for _round in range(3):
        for kind, layers in (("hits", L), ("hits", 1), ("fetch", L), ("host", L), ("admit", L)):
            c = mechanism_counts(kind, 300, layers, rng)
            wall = price_stream_reference(c, 1, costs).token_s
            wall = wall * (1 + noise * rng.standard_normal(len(wall)))
            wall = np.where(rng.random(len(wall)) < slowed, 3 * wall, wall)
            parts.append(TimedTokens.from_counts(wall, c))
    return TimedTokens.concat(parts)


def test_the_fit_recovers_known_constants_despite_noise_and_slowed_tokens():
    fit = fit_unit_costs(timed_runs(seed=1, noise=0.03, slowed=0.03))
    assert fit.layers_identified and fit.kept < fit.tokens  # the slowed tokens left out
    seconds = unit_costs_from_fit(fit, k=K, layers=L, expert_s=TRUE.expert_s)
    assert seconds["host_read_s"] == seconds["copy_s"]  # no host runs on a disk: a copy
    for key, value in seconds.items():
        if key == "host_read_s":
            continue
        # an install (40 us) and a step's wait (150 us, on a third of the steps) are small
        # beside the noise (3% of a ~4 ms token): looser
        rel = {"install_s": 0.3, "sync_step_s": 0.1, "host_step_s": 0.1}.get(key, 0.02)
        assert value == pytest.approx(getattr(TRUE, key), rel=rel), key
    # as a profile, priced for the same experts, it gives the seconds back
    u = measured_profile(seconds, 1e6, "fit").price(ModelBytes(1e6))
    assert u.copy_s == pytest.approx(seconds["copy_s"], rel=1e-12)
    assert u.host_expert_s == pytest.approx(seconds["host_expert_s"], rel=1e-12)


def test_the_fit_is_exact_without_noise():
    fit = fit_unit_costs(timed_runs(seed=2, noise=0.0, slowed=0.0))
    seconds = unit_costs_from_fit(fit, k=K, layers=L, expert_s=TRUE.expert_s)
    # the admissions' copies can delay a later fetch on the link (a wait the linear terms do
    # not have), so the copy absorbs a little of it; the rest is exact
    assert seconds["copy_s"] == pytest.approx(TRUE.copy_s, rel=0.02)
    for key in ("token_overhead_s", "dense_layer_s", "host_expert_s", "install_s", "sync_step_s",
                "host_step_s"):  # fmt: skip
        assert seconds[key] == pytest.approx(getattr(TRUE, key), rel=0.02), key


def top1(counts: np.ndarray, field: str) -> np.ndarray:
    """The counts with each step's `field` experts cut to one, the rest hits (top-1 routing)."""
    c = counts.copy()
    c[..., F["hit"]] += c[..., F[field]] - np.minimum(c[..., F[field]], 1)
    c[..., F[field]] = np.minimum(c[..., F[field]], 1)
    return c


@pytest.mark.parametrize(
    ("field", "each", "step", "carried"),
    [
        ("fetch", "copy_s", "sync_step_s", TRUE.copy_s + TRUE.sync_step_s),
        ("host", "host_extra_s", "host_step_s",
         TRUE.host_expert_s - TRUE.expert_s + TRUE.host_step_s),
    ],
)  # fmt: skip
def test_steps_of_one_expert_leave_the_step_to_the_expert(field, each, step, carried):
    # top-1 routing: a step that copies (computes on the host) has one expert, so the step's
    # cost and its expert's are one term
    rng = np.random.default_rng(5)
    runs = []
    for kind in ("hits", "fetch", "host", "admit"):
        c = top1(mechanism_counts(kind, 200, L, rng), field)
        runs.append(TimedTokens.from_counts(price_stream_reference(c, 1, TRUE).token_s, c))
    fit = fit_unit_costs(TimedTokens.concat(runs))
    assert fit.coef[step] == 0.0 and step not in fit.at_zero
    assert fit.coef[each] == pytest.approx(carried, rel=0.02)


def test_terms_are_never_negative():
    # host experts faster than fast ones: the host's excess is bounded at 0, not negative
    fast_host = UnitCosts(**{**TRUE.__dict__, "host_expert_s": 10e-6})
    fit = fit_unit_costs(timed_runs(seed=3, noise=0.01, slowed=0.0, costs=fast_host))
    assert all(v >= 0 for v in fit.coef.values())
    assert "host_extra_s" in fit.at_zero
    seconds = unit_costs_from_fit(fit, k=K, layers=L, expert_s=TRUE.expert_s)
    assert all(v >= 0 for v in seconds.values())
    # a microbenchmark slower than the whole per-layer constant is lowered to it
    capped = unit_costs_from_fit(fit, k=K, layers=L, expert_s=1.0)
    assert capped["dense_layer_s"] == 0.0 and capped["expert_s"] > 0
    # ... also where 10 x (layer / 10) rounds above the layer (a bench's fit did: -8.7e-19 s)
    layer = 0.006459721981904619
    assert layer - 10 * (layer / 10) < 0
    odd = CostFit({**fit.coef, "token_s": 0.0, "layer_s": layer}, True, 10, 10, [], 0.0)
    seconds = unit_costs_from_fit(odd, k=10, layers=2, expert_s=1.0)
    assert seconds["dense_layer_s"] == 0.0
    measured_profile(seconds, 1e6, "a capped fit")  # a valid profile


def test_one_layer_count_spreads_the_token_constant_over_the_layers():
    rng = np.random.default_rng(4)
    runs = []
    for kind in ("hits", "fetch", "host", "admit"):
        c = mechanism_counts(kind, 200, L, rng)
        runs.append(TimedTokens.from_counts(price_stream_reference(c, 1, TRUE).token_s, c))
    fit = fit_unit_costs(TimedTokens.concat(runs))
    assert not fit.layers_identified and fit.coef["layer_s"] == 0.0
    seconds = unit_costs_from_fit(fit, k=K, layers=L, expert_s=TRUE.expert_s)
    assert seconds["token_overhead_s"] == 0.0
    per_token = TRUE.token_overhead_s + L * TRUE.dense_layer_s
    assert L * seconds["dense_layer_s"] == pytest.approx(per_token, rel=0.02)


def test_degenerate_fits_are_named():
    rng = np.random.default_rng(5)
    hits = mechanism_counts("hits", 50, L, rng)
    fetch = mechanism_counts("fetch", 50, L, rng)
    no_host = TimedTokens.concat(
        [TimedTokens.from_counts(np.full(50, 1e-3), c) for c in (hits, fetch)]
    )
    with pytest.raises(ValueError, match="no timed token has any expert computed by the host"):
        fit_unit_costs(no_host)
    # every fetch paired with a host expert: the two terms cannot be told apart
    both = fetch.copy()
    both[..., F["host"]] = both[..., F["fetch"]]
    both[..., F["hit"]] = K - 2 * both[..., F["fetch"]]
    both[..., F["admissions"]] = both[..., F["fetch"]]
    tied = TimedTokens.from_counts(np.linspace(1e-3, 2e-3, 50), both)
    with pytest.raises(ValueError, match="cannot be told apart"):
        fit_unit_costs(tied)
    with pytest.raises(ValueError, match="timed tokens, need at least"):
        fit_unit_costs(TimedTokens.from_counts(np.ones(3), both[:3]))
    with pytest.raises(ValueError, match="do not match"):
        TimedTokens.from_counts(np.ones(4), both)
    assert FIT_TERMS[0] == "token_s"


def fit_priced_runs(costs: UnitCosts, seed: int):
    """One run of every mechanism priced under `costs` (no noise): their fit, and the host and
    admission runs' `(wall_s, counts)` (one each)."""
    rng = np.random.default_rng(seed)
    parts, priced = [], {"host": [], "admit": []}
    for kind, layers in (("hits", L), ("hits", 1), ("fetch", L), ("host", L), ("admit", L)):
        c = mechanism_counts(kind, 300, layers, rng)
        wall = price_stream_reference(c, 1, costs).token_s
        parts.append(TimedTokens.from_counts(wall, c))
        if kind in priced:
            priced[kind].append((wall, c))
    return fit_unit_costs(TimedTokens.concat(parts)), priced["host"], priced["admit"]


def test_a_host_reading_over_the_link_is_fitted_through_the_pricing():
    """The disk tier: the host's reads are copies on the link beside the fast path, its term the
    compute alone, which no linear term over the host's count can say; from runs priced so, the
    compute comes back through the pricing."""
    link = replace(TRUE, host_expert_s=60e-6, host_reads_link=True)
    fit, host_runs, _admit = fit_priced_runs(link, seed=6)
    rng = np.random.default_rng(6)
    seconds = unit_costs_from_fit(fit, k=K, layers=L, expert_s=TRUE.expert_s, host_runs=host_runs)
    assert seconds["host_expert_s"] == pytest.approx(link.host_expert_s, rel=0.05)
    assert seconds["host_step_s"] == pytest.approx(link.host_step_s, rel=0.05)
    # the linear fit cannot split them where the reads hide behind the fast path
    assert fit.coef["host_step_s"] < 0.5 * link.host_step_s
    # by construction the host runs are priced at their measured mean
    u = replace(link, **seconds)
    priced = price_stream_reference(host_runs[0][1], 1, u).token_s.mean()
    assert priced == pytest.approx(host_runs[0][0].mean(), rel=1e-9)
    # a host faster than free (measured under the price of its reads alone): 0, not negative
    fast = [(w * 0.5, c) for w, c in host_runs]
    assert term_by_pricing(seconds, "host_expert_s", fast) == 0.0
    with pytest.raises(ValueError, match="host_expert_s by pricing: no runs"):
        term_by_pricing(seconds, "host_expert_s", [])
    none = mechanism_counts("hits", 20, L, rng)
    with pytest.raises(ValueError, match="host_expert_s by pricing: the runs do not exercise it"):
        term_by_pricing(seconds, "host_expert_s", [(np.ones(20), none)])


def test_a_host_step_is_found_through_the_pricing_despite_noise_unless_steps_have_one_expert():
    """Host runs on the link with noise and a few tokens 3x slower: the step and the compute
    come back; where every step with host experts has one (top-1), the step is 0 and the expert
    carries it, priced at the runs' mean."""
    link = replace(TRUE, host_expert_s=60e-6, host_reads_link=True, host_step_s=300e-6)
    seconds = {f.name: getattr(link, f.name) for f in fields(link)
               if f.name not in ("concurrent_host", "host_reads_link", "host_read_s")}  # fmt: skip
    rng = np.random.default_rng(11)
    runs, single = [], []
    for _ in range(3):
        c = mechanism_counts("host", 300, L, rng)
        wall = price_stream_reference(c, 1, link).token_s
        wall = wall * (1 + 0.02 * rng.standard_normal(len(wall)))
        runs.append((np.where(rng.random(len(wall)) < 0.02, 3 * wall, wall), c))
        one = top1(c, "host")
        single.append((price_stream_reference(one, 1, link).token_s, one))
    step, expert = host_terms_by_pricing(seconds, runs)
    assert step == pytest.approx(300e-6, rel=0.1) and expert == pytest.approx(60e-6, rel=0.25)
    step, expert = host_terms_by_pricing(seconds, single)
    assert step == 0.0 and expert == pytest.approx(360e-6, rel=1e-6)


def test_the_host_term_is_fitted_beside_the_drag_and_the_install_timed_apart():
    """While the link reads (the host's reads, the admissions' copies), the fast tier works
    slower (`host_read_drag`, `background_read_drag`, measured apart): fitted with them, the host
    runs give the host's compute and step back; without them, the fast path's lost time lands
    in the host's terms. The linear fit's install is off by over half (the admissions' drag
    falls into its terms wherever the least squares puts it), so the install is timed apart:
    given it, the admission runs are priced at what they took."""
    # a fast path as long as a read: a layer with one host expert hides it (no step's wait: the
    # drags, which no linear term has, then move the copy's time between copy_s and it)
    dragged = replace(
        TRUE, expert_s=150e-6, host_expert_s=60e-6, host_reads_link=True, host_read_drag=0.5,
        background_read_drag=0.25, sync_step_s=0.0,
    )  # fmt: skip
    fit, host_runs, admit_runs = fit_priced_runs(dragged, seed=7)
    common = {"k": K, "layers": L, "expert_s": dragged.expert_s, "host_runs": host_runs}
    drags = {"host_read_drag": 0.5, "background_read_drag": 0.25}
    seconds = unit_costs_from_fit(fit, **common, **drags, install_s=dragged.install_s)
    assert {d: seconds[d] for d in drags} == drags
    assert seconds["host_expert_s"] == pytest.approx(dragged.host_expert_s, rel=0.05)
    assert seconds["host_step_s"] == pytest.approx(dragged.host_step_s, rel=0.05)
    assert seconds["install_s"] == dragged.install_s
    assert abs(fit.coef["install_s"] - dragged.install_s) > 0.5 * dragged.install_s
    (wall, counts), u = admit_runs[0], replace(dragged, **seconds)
    assert price_stream_reference(counts, 1, u).token_s.mean() == pytest.approx(
        wall.mean(), rel=0.02
    )
    undragged = unit_costs_from_fit(fit, **common)
    assert (undragged["host_read_drag"], undragged["background_read_drag"]) == (0.0, 0.0)

    def half_step(c: dict) -> float:  # the host's time for a step of k/2 experts
        return c["host_step_s"] + K / 2 * c["host_expert_s"]

    assert half_step(undragged) > 1.2 * half_step(dragged.__dict__)
    assert undragged["install_s"] == fit.coef["install_s"]  # none timed apart: the linear term
    assert unit_costs_from_fit(fit, **common, install_s=-1e-6)["install_s"] == 0.0


def test_the_background_lanes_start_is_found_through_the_admission_runs_pricing():
    """Runs priced with a start of the idle background lane (`background_start_s`), a cost per
    batch of requests that depends on when the earlier copies end, which no linear term over
    the counts says: the admission runs' pricing gives it back, at their own disk speed; none
    given, it is 0; runs faster than the rest of their price give 0, not a negative."""
    started = replace(TRUE, host_expert_s=60e-6, host_reads_link=True, background_start_s=300e-6)
    fit, host_runs, admit_runs = fit_priced_runs(started, seed=9)
    common = {"k": K, "layers": L, "expert_s": started.expert_s, "host_runs": host_runs,
              "install_s": started.install_s}  # fmt: skip
    seconds = unit_costs_from_fit(fit, **common, admission_runs=admit_runs)
    assert seconds["background_start_s"] == pytest.approx(300e-6, rel=0.05)
    assert unit_costs_from_fit(fit, **common)["background_start_s"] == 0.0
    fast = [(0.5 * w, c) for w, c in admit_runs]
    assert unit_costs_from_fit(fit, **common, admission_runs=fast)["background_start_s"] == 0.0
    # one run read at half the disk's speed: priced at its own copies, the start comes back
    slow = replace(started, copy_s=2 * started.copy_s)
    (_, c), ref = admit_runs[0], DiskClock(100, 100 * started.copy_s)
    runs = [admit_runs[0], (price_stream_reference(c, 1, slow).token_s, c)]
    clocks = [ref, DiskClock(100, 200 * started.copy_s)]
    at_disk = {**seconds, "copy_s": started.copy_s, "background_start_s": 0.0}
    copies = [copy_at_disk(started.copy_s, ref, clk) for clk in clocks]
    found = term_by_pricing(at_disk, "background_start_s", runs, copies)
    assert found == pytest.approx(300e-6, rel=0.05)


def test_host_runs_priced_at_their_own_disk_speed():
    """Two host runs, one while the disk read at half its speed: priced each at its own copy
    time, the compute comes back; priced at one copy time, the slow run's reads land in it."""
    link = replace(TRUE, host_expert_s=60e-6, host_reads_link=True)
    slow = replace(link, copy_s=2 * link.copy_s)
    rng = np.random.default_rng(8)
    runs = []
    for costs in (link, slow):
        c = mechanism_counts("host", 300, L, rng)
        runs.append((price_stream_reference(c, 1, costs).token_s, c))
    seconds = {f: getattr(link, f) for f in ("copy_s", "expert_s", "host_expert_s",
               "dense_layer_s", "token_overhead_s", "install_s", "host_step_s")}  # fmt: skip
    own = term_by_pricing(seconds, "host_expert_s", runs, run_copy_s=[link.copy_s, slow.copy_s])
    assert own == pytest.approx(link.host_expert_s, rel=1e-6)
    assert term_by_pricing(seconds, "host_expert_s", runs) > 1.2 * link.host_expert_s
    with pytest.raises(ValueError, match="1 copy times for 2 runs"):
        term_by_pricing(seconds, "host_expert_s", runs, run_copy_s=[link.copy_s])


def test_runs_on_a_drifting_disk_are_fitted_at_their_own_read_speed():
    """Each run reads at its own disk speed (timed: `DiskClock`): a copy is the copy's other
    work plus a read. Fitted with every token's reads at its run's speed, the other work, the
    host's compute and the median run's speed come back; fitted at one copy time, the host runs'
    slow disk lands in the host's term."""
    beyond, host_s = 100e-6, 60e-6
    link = replace(TRUE, host_expert_s=host_s, host_reads_link=True)
    rng = np.random.default_rng(9)
    timed, untimed, clocks, host_runs, host_clocks = [], [], [], [], []
    reads_at = {"fetch": (300e-6, 450e-6, 320e-6), "host": (600e-6, 640e-6, 580e-6)}
    for r in range(3):
        for kind, layers in (("hits", L), ("hits", 1), ("fetch", L), ("host", L), ("admit", L)):
            c = mechanism_counts(kind, 300, layers, rng)
            read = reads_at.get(kind, (300e-6,) * 3)[r]
            wall = price_stream_reference(c, 1, replace(link, copy_s=beyond + read)).token_s
            n = int(c[..., [F["fetch"], F["host"], F["admission_requests"]]].sum())
            clock = DiskClock(n, n * read)
            clocks.append(clock)
            timed.append(TimedTokens.from_counts(wall, c, clock))
            untimed.append(TimedTokens.from_counts(wall, c))
            if kind == "host":
                host_runs.append((wall, c))
                host_clocks.append(clock)
    reference = reference_clock(clocks)
    assert reference.per_read_s == pytest.approx(320e-6)  # the median of the 9 that read
    seconds = unit_costs_from_fit(
        fit_unit_costs(TimedTokens.concat(timed)), k=K, layers=L, expert_s=TRUE.expert_s,
        host_runs=host_runs, reference=reference, host_clocks=host_clocks,
    )  # fmt: skip
    assert seconds["copy_s"] == pytest.approx(beyond + 320e-6, rel=0.03)
    assert seconds["host_expert_s"] == pytest.approx(host_s, rel=0.05)
    # the host's reads at the host runs' pooled speed, not the copies': the runs come back
    assert seconds["host_read_s"] == pytest.approx(beyond + 610e-6, rel=0.03)
    u = UnitCosts(**seconds, concurrent_host=False, host_reads_link=True)
    for wall, c in host_runs:
        priced = price_stream_reference(c, 1, u).token_s.mean()
        assert priced == pytest.approx(wall.mean(), rel=0.04)
        at_a_copy = price_stream_reference(c, 1, replace(u, host_read_s=None)).token_s.mean()
        assert at_a_copy < 0.95 * wall.mean()
    at_one_copy = unit_costs_from_fit(
        fit_unit_costs(TimedTokens.concat(untimed)), k=K, layers=L, expert_s=TRUE.expert_s,
        host_runs=host_runs,
    )  # fmt: skip
    assert at_one_copy["host_expert_s"] > 2 * host_s
    with pytest.raises(ValueError, match="wall times must be finite"):
        fit_unit_costs(replace(timed[0], wall_s=-timed[0].wall_s))


def test_a_run_at_its_disk_reads_everything_at_its_speed():
    """At a run's disk speed its copies and the host's reads both move to the run's time per
    read, each keeping the copy's other work (50); a run that read nothing keeps the costs."""
    u = replace(TRUE, copy_s=350.0, host_read_s=250.0, host_reads_link=True)
    at = AtRunDisk(DiskClock(10, 3000.0))  # the reference: 300 a read
    moved = at.costs(u, DiskClock(4, 1600.0))  # 400 a read
    assert (moved.copy_s, moved.host_read_s) == (450.0, 450.0)
    assert at.costs(u, DiskClock(0, 0.0)) == u


def test_the_reference_run_is_the_median_reader():
    def clock(per_read: float, reads: int = 10) -> DiskClock:
        return DiskClock(reads, reads * per_read)

    assert reference_clock([clock(3.0), clock(1.0), clock(2.0), clock(0.0, 0)]) == clock(2.0)
    assert reference_clock([clock(3.0), clock(1.0)]) == clock(1.0)  # the lower of two
    assert reference_clock([clock(0.0, 0)]) is None and reference_clock([]) is None


def test_each_mechanisms_error_is_its_runs_price_against_their_time():
    """`run_errors`: a mechanism's runs priced at the costs, pooled over their tokens, against
    their measured time: 0 where the wall times are the price, the ratio where one mechanism
    ran slower than priced, each at its own admission delay."""
    rng = np.random.default_rng(3)
    runs = {}
    for kind, slower in (("hits", 1.0), ("fetch", 1.25), ("admit", 1.0)):
        parts = []
        for _run in range(2):
            c = mechanism_counts(kind, 40, L, rng)
            parts.append((price_stream_reference(c, 1, TRUE).token_s * slower, c))
        runs[kind] = parts
    errors = run_errors(runs, TRUE)
    assert errors["hits"] == pytest.approx(0.0, abs=1e-12)
    assert errors["fetch"] == pytest.approx(1 / 1.25 - 1, rel=1e-12)
    assert errors["admit"] == pytest.approx(0.0, abs=1e-12)
    # copies slower than a token: at delay 1 the landings wait for them, at delay 3 less
    slow = replace(TRUE, copy_s=50e-3)
    admit = [(price_stream_reference(c, 1, slow).token_s, c) for _w, c in runs["admit"]]
    assert run_errors({"admit": admit}, slow)["admit"] == pytest.approx(0.0, abs=1e-12)
    assert run_errors({"admit": admit}, slow, {"admit": 3})["admit"] < -1e-4
    with pytest.raises(ValueError, match="run errors: no runs of host"):
        run_errors({"host": []}, TRUE)
