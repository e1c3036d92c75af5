"""What the analysis needs from the config (`AnalysisParams`), checked before any work."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from moesub.config import normalize_policy, schema_defaults
from moesub.stats.expb import ExpBRule
from moesub.stats.load import number

_DEFAULTS = schema_defaults("analysis")  # workflow/schemas/config.schema.yaml


@dataclass(frozen=True)
class AnalysisParams:
    """What `run_analysis` needs from the config.

    `policies`: name -> policy dict (config `policies:` after sweep expansion); `expb`: the
    Experiment B rule (None: that part is reported missing); `n_boot` bootstrap resamples over
    streams; `seed`; `ci_level`; `baseline` / `host_baseline`: the names speedups and Δppl are
    relative to; `alpha` / `power`: the level of the analysis' own tests (admission) and the
    power at which minimum detectable effects are stated; `admission_bins`: left edges of the
    bins of tokens since the document start, from 1 (the document's first token, predicted from
    the previous document, is its own `boundary` bin; edges past the largest observed distance
    are dropped so that no bin is always empty).
    """

    policies: dict[str, dict[str, Any]] = field(default_factory=dict)
    expb: ExpBRule | None = None
    n_boot: int = _DEFAULTS["n_boot"]
    seed: int = _DEFAULTS["seed"]
    ci_level: float = _DEFAULTS["ci_level"]
    baseline: str = _DEFAULTS["baseline"]
    host_baseline: str = _DEFAULTS["host_baseline"]
    alpha: float = _DEFAULTS["alpha"]
    power: float = _DEFAULTS["power"]
    admission_bins: tuple[int, ...] = tuple(_DEFAULTS["admission_bins"])

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any]) -> AnalysisParams:
        if not isinstance(params, Mapping):
            raise ValueError(f"params must be a mapping, got {type(params).__name__}")
        policies = params.get("policies") or {}
        if not isinstance(policies, Mapping):
            raise ValueError("params['policies'] must map policy names to policy dicts")
        table = {str(n): normalize_policy(str(n), dict(p)) for n, p in policies.items()}
        expb = params.get("expb")
        n_boot = params.get("n_boot", _DEFAULTS["n_boot"])
        if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 10:
            raise ValueError(f"params['n_boot']={n_boot!r} must be an integer >= 10")
        seed = params.get("seed", _DEFAULTS["seed"])
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"params['seed']={seed!r} must be an integer >= 0")
        ci_level = number(params.get("ci_level", _DEFAULTS["ci_level"]), "params['ci_level']")
        if not 0 < ci_level < 1:
            raise ValueError(f"params['ci_level']={ci_level} must be in (0, 1)")
        alpha = number(params.get("alpha", _DEFAULTS["alpha"]), "params['alpha']")
        power = number(params.get("power", _DEFAULTS["power"]), "params['power']")
        if not 0 < alpha < 1 or not 0 < power < 1:
            raise ValueError(f"params['alpha']={alpha}, params['power']={power}: must be in (0, 1)")
        bins = tuple(int(b) for b in params.get("admission_bins", _DEFAULTS["admission_bins"]))
        if not bins or bins[0] != 1 or any(b >= c for b, c in pairwise(bins)):
            raise ValueError(
                f"params['admission_bins']={list(bins)} must start at 1 and strictly increase "
                "(the document's first token is its own bin)"
            )
        return cls(
            policies=table,
            expb=ExpBRule.from_mapping(expb) if expb is not None else None,
            n_boot=n_boot,
            seed=seed,
            ci_level=ci_level,
            baseline=str(params.get("baseline", _DEFAULTS["baseline"])),
            host_baseline=str(params.get("host_baseline", _DEFAULTS["host_baseline"])),
            alpha=alpha,
            power=power,
            admission_bins=bins,
        )
