"""Generation statistics: accuracy and agreement per (task, policy, fraction).

CIs are Wilson score intervals; r(mass, agreement) is Spearman over problems (agreement =
fraction of tokens before the first divergence).

Entry point: `generation_part(ctx)` fills `ctx.tables["generation"]`, `ctx.parts["generation"]`.
"""

from __future__ import annotations

import pandas as pd

from moesub.stats.intervals import correlation, wilson_ci
from moesub.stats.load import Context, missing, sql_list


def generation_part(ctx: Context) -> None:
    ctx.tables["generation"] = pd.DataFrame()
    if not ctx.inputs["generate"]:
        ctx.parts["generation"] = missing("no generation artefacts")
        return
    gen = ctx.con.execute(
        f"""
        SELECT task, policy, fraction, problem_id, correct, agree_exact,
               agree_prefix_frac, mass_mean, n_tokens
        FROM read_parquet({sql_list(ctx.inputs["generate"])}, union_by_name=true)
        ORDER BY task, policy, fraction, problem_id
        """
    ).df()
    missing_data = {
        (str(i.meta.get("task")), str(i.meta.get("name"))): str(i.meta["missing_data"])
        for i in ctx.infos["generate"]
        if i.meta.get("missing_data")
    }
    notes = [f"{t}/{n}: {m}" for (t, n), m in sorted(missing_data.items())]
    if gen.empty:
        why = "; ".join(sorted(set(missing_data.values())))
        ctx.parts["generation"] = missing(
            "generation artefacts hold no problems" + (f" ({why})" if why else "")
        )
        return
    rows = []
    level = ctx.p.ci_level
    for (task, name, frac), g in gen.groupby(["task", "policy", "fraction"], sort=True):
        n = len(g)
        k = int(g["correct"].sum())
        a = int(g["agree_exact"].sum())
        row = {
            "task": task,
            "policy": name,
            "fraction": float(frac),
            "n": n,
            "n_correct": k,
            "accuracy": k / n,
            "n_agree": a,
            "agree_exact": a / n,
            "agree_prefix_mean": float(g["agree_prefix_frac"].mean()),
            "mass_mean": float(g["mass_mean"].mean()),
            "tokens_mean": float(g["n_tokens"].mean()),
        }
        row["acc_ci_lo"], row["acc_ci_hi"] = wilson_ci(k, n, level)
        row["agree_ci_lo"], row["agree_ci_hi"] = wilson_ci(a, n, level)
        corr = correlation(g["mass_mean"], g["agree_prefix_frac"])
        row.update(
            {
                "mass_agree_n": corr["n"],
                "mass_agree_rho": corr["rho"],
                "mass_agree_p": corr["rho_p"],
                "mass_agree_reason": corr["reason"],
            }
        )
        rows.append(row)
    ctx.tables["generation"] = pd.DataFrame(rows)
    ctx.parts["generation"] = {"status": "ok"}
    if notes:
        ctx.parts["generation"]["note"] = "missing data: " + "; ".join(notes)
