"""Timing: simulate tables, engine tables, the speed/quality frontier, simulator vs engine.

Engine time per token is the median of per-token `wall_s` (CI: distribution-free order
statistics); speedups are ratios of medians on the same device and fraction. The simulator's
estimate is compared with the engine's mean (an expected time per token).

Entry points: `simulate_part(ctx)`, `engine_part(ctx)` (engine, speed_quality, sim_vs_engine),
`engine_bench(paths)` (the shared benchmark, not per model).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import duckdb
import numpy as np
import pandas as pd

from moesub.metrics import speedup
from moesub.stats.intervals import correlation, median_ci
from moesub.stats.load import PROVENANCE_KEYS, Context, file_info, missing, sql_list


def pareto_front(cost: Sequence[float], loss: Sequence[float]) -> np.ndarray:
    """bool mask: points no other point beats on both (<= both, < one); NaN points never are."""
    c = np.asarray(cost, dtype=float)
    q = np.asarray(loss, dtype=float)
    ok = np.isfinite(c) & np.isfinite(q)
    front = ok.copy()
    for i in np.flatnonzero(ok):
        dominated = ok & (c <= c[i]) & (q <= q[i]) & ((c < c[i]) | (q < q[i]))
        front[i] = not dominated.any()
    return front


def simulate_part(ctx: Context) -> None:
    ctx.tables["sim_total"] = ctx.tables["layer_hit_rates"] = pd.DataFrame()
    if not ctx.inputs["simulate"]:
        ctx.parts["simulate"] = missing("no simulate artefacts")
        return
    files = ctx.register_files("simulate")
    sim = ctx.con.execute(
        f"""
        SELECT f.name AS policy, f.fraction, t.* EXCLUDE (policy, fraction)
        FROM read_parquet({sql_list(ctx.inputs["simulate"])}, filename=true,
                          union_by_name=true) t
        JOIN {files} f USING (filename) ORDER BY policy, fraction, layer
        """
    ).df()
    ctx.tables["sim_total"] = sim[sim["layer"] == -1].reset_index(drop=True)
    # simulate's per-layer mass_mean is already a mean over that layer's token-layers
    ctx.tables["layer_hit_rates"] = (
        sim[sim["layer"] >= 0][
            ["policy", "fraction", "layer", "tokens", "hit_rate", "sub_rate", "mass_mean"]
        ]
        .rename(columns={"mass_mean": "mass_per_token_layer"})
        .reset_index(drop=True)
    )
    ctx.parts["simulate"] = {"status": "ok"}


def engine_part(ctx: Context) -> None:
    ctx.tables["engine"] = ctx.tables["sim_vs_engine"] = pd.DataFrame()
    if not ctx.inputs["engine"]:
        ctx.parts["engine"] = missing("no engine artefacts")
    else:
        _engine_per_run(ctx)
    _speed_quality(ctx)
    _sim_vs_engine(ctx)


def _engine_per_run(ctx: Context) -> None:
    files = ctx.register_files("engine")
    tok = ctx.con.execute(
        f"""
        SELECT f.name, f.fraction, f.device, t.wall_s, t.fetch_wait_s, t.nll
        FROM read_parquet({sql_list(ctx.inputs["engine"])}, filename=true,
                          union_by_name=true) t
        JOIN {files} f USING (filename) ORDER BY f.name, f.fraction, f.device
        """
    ).df()
    tiers = {(i.name, i.fraction, i.device): i.meta.get("tier") for i in ctx.infos["engine"]}
    rows = []
    for (name, frac, dev), g in tok.groupby(["name", "fraction", "device"], sort=True):
        wall = g["wall_s"].to_numpy(float)
        lo, hi = median_ci(wall, ctx.p.ci_level)
        nll = g["nll"].dropna().to_numpy(float)
        rows.append(
            {
                "policy": name,
                "fraction": float(frac),
                "device": dev,
                "tier": tiers.get((name, frac, dev)),
                "n_tokens": len(wall),
                "time_per_token_s": float(np.median(wall)),
                "time_ci_lo": lo,
                "time_ci_hi": hi,
                "time_mean_s": float(wall.mean()),
                "time_p90_s": float(np.quantile(wall, 0.9)),
                "fetch_wait_mean_s": float(g["fetch_wait_s"].mean()),
                "engine_ppl": float(math.exp(nll.mean())) if nll.size else None,
            }
        )
    eng = pd.DataFrame(rows)
    for ref, col in (
        (ctx.p.baseline, "speedup_vs_fetch_every_miss"),
        (ctx.p.host_baseline, "speedup_vs_host_compute"),
    ):
        base = eng[eng["policy"] == ref].set_index(["fraction", "device"])["time_per_token_s"]
        keys = list(zip(eng["fraction"], eng["device"], strict=True))
        eng[col] = speedup([base.get(k, np.nan) for k in keys], eng["time_per_token_s"])
    ctx.tables["engine"] = eng
    ctx.parts["engine"] = {"status": "ok"}


def _speed_quality(ctx: Context) -> None:
    q = ctx.tables["quality"]
    eng, sim = ctx.tables["engine"], ctx.tables["sim_total"]
    frames = []
    if not eng.empty:
        frames.append(
            eng.assign(source="engine")[
                [
                    "policy",
                    "fraction",
                    "device",
                    "source",
                    "time_per_token_s",
                    "time_ci_lo",
                    "time_ci_hi",
                    "speedup_vs_fetch_every_miss",
                    "speedup_vs_host_compute",
                ]
            ]
        )
    if not sim.empty:
        s = sim.assign(
            device="simulated", source="simulate", time_per_token_s=sim["est_time_per_token_s"]
        )
        for ref, col in (
            (ctx.p.baseline, "speedup_vs_fetch_every_miss"),
            (ctx.p.host_baseline, "speedup_vs_host_compute"),
        ):
            base = s[s["policy"] == ref].set_index("fraction")["time_per_token_s"]
            s[col] = speedup(s["fraction"].map(base), s["time_per_token_s"])
        frames.append(
            s[
                [
                    "policy",
                    "fraction",
                    "device",
                    "source",
                    "time_per_token_s",
                    "speedup_vs_fetch_every_miss",
                    "speedup_vs_host_compute",
                ]
            ]
        )
    if not frames or q.empty:
        ctx.tables["speed_quality"] = pd.DataFrame()
        ctx.parts["speed_quality"] = missing(
            "needs emulate (Δppl) and engine or simulate (time per token)"
        )
        return
    sq = pd.concat(frames, ignore_index=True).merge(
        q[["policy", "fraction", "dppl_pct", "dppl_ci_lo", "dppl_ci_hi", "dppl_bias"]],
        on=["policy", "fraction"],
        how="inner",
    )
    sq["frontier"] = False
    for _, idx in sq.groupby(["fraction", "device"]).groups.items():
        sq.loc[idx, "frontier"] = pareto_front(
            sq.loc[idx, "time_per_token_s"], sq.loc[idx, "dppl_pct"]
        )
    ctx.tables["speed_quality"] = sq.sort_values(
        ["source", "device", "fraction", "time_per_token_s"], ignore_index=True
    )
    ctx.parts["speed_quality"] = {"status": "ok"}


def _sim_vs_engine(ctx: Context) -> None:
    eng, sim = ctx.tables["engine"], ctx.tables["sim_total"]
    ctx.results["sim_vs_engine"] = None
    if eng.empty or sim.empty:
        ctx.tables["sim_vs_engine"] = pd.DataFrame()
        ctx.parts["sim_vs_engine"] = missing("needs both simulate and engine artefacts")
        return
    j = eng[["policy", "fraction", "device", "n_tokens", "time_mean_s", "time_per_token_s"]]
    j = j.merge(sim[["policy", "fraction", "est_time_per_token_s"]], on=["policy", "fraction"])
    j["rel_error"] = j["est_time_per_token_s"] / j["time_mean_s"] - 1.0
    ctx.tables["sim_vs_engine"] = j
    if j.empty:
        ctx.parts["sim_vs_engine"] = missing("no policy/fraction run in both simulate and engine")
        return
    err = j["rel_error"].abs().to_numpy()
    ctx.results["sim_vs_engine"] = {
        "n": len(j),
        "median_abs_rel_error": float(np.median(err)),
        "max_abs_rel_error": float(err.max()),
        "r": correlation(j["est_time_per_token_s"], j["time_mean_s"], parametric=False)["r"],
    }
    ctx.parts["sim_vs_engine"] = {"status": "ok"}


def engine_bench(paths: list[str]) -> tuple[pd.DataFrame, dict[str, Any], list[dict]]:
    if not paths:
        return pd.DataFrame(), missing("no engine benchmark artefacts"), []
    con = duckdb.connect()
    try:
        df = con.execute(
            f"SELECT * FROM read_parquet({sql_list(paths)}, union_by_name=true) ORDER BY ALL"
        ).df()
    finally:
        con.close()
    prov = []
    for path in paths:
        info = file_info(path, "engine_bench")
        meta = {k: info.meta[k] for k in PROVENANCE_KEYS if k in info.meta}
        prov.append({"kind": "engine_bench", "path": path, "rows": info.rows, "metadata": meta})
    return df, {"status": "ok"}, prov
