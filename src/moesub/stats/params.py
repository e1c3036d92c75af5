"""What the analysis needs from the config, checked before any work: `AnalysisParams` (the
config's `analysis:` plus the policies) and `ExpBRule` (Experiment B's pre-registered decision
rules, config `expb:`; the factorial design's is `FactorialRule`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from moesub.config import normalize_policy, schema_defaults

_DEFAULTS = schema_defaults("analysis")  # workflow/schemas/config.schema.yaml


def number(value: Any, where: str) -> float:
    """A config number (bools refused), or a ValueError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}={value!r} must be a number")
    return float(value)


@dataclass(frozen=True)
class DesignRule:
    """One design's pre-registered decision rule (config `expb.designs.<design>`)."""

    design: str
    primary: float  # m*: the primary target mass per token-layer
    max_gap: float  # |m_h - m_l| <= max_gap * min(m_h, m_l)
    min_heavy_fraction: float | None = None  # study: m_h >= this * m*
    min_realized_fraction: float | None = None  # matched: min(m_h, m_l) >= this * m*
    heavy_mass: float | None = None  # matched: the heavy expert's weight (for the labels)


# each design's decision-rule keys and their defaults (workflow/schemas/config.schema.yaml)
_RULE_KEYS = {"study": ("max_gap", "min_heavy_fraction"),
              "matched": ("max_gap", "min_realized_fraction")}  # fmt: skip
_RULE_DEFAULTS = {
    design: {key: schema_defaults(f"expb.designs.{design}")[key] for key in keys}
    for design, keys in _RULE_KEYS.items()
}


@dataclass(frozen=True)
class FactorialRule:
    """The factorial design's validity rule (config `expb.designs.factorial`): a rank contrast
    is valid only if its two cells' realized mean weights differ by <= `max_weight_gap`
    (relative to the smaller)."""

    max_weight_gap: float = schema_defaults("expb.designs.factorial")["max_weight_gap"]

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any], where: str) -> FactorialRule:
        if not isinstance(spec, Mapping) or set(spec) - {"max_weight_gap"}:
            raise ValueError(f"{where} must be a mapping with at most the key 'max_weight_gap'")
        gap = number(spec.get("max_weight_gap", cls.max_weight_gap), f"{where}['max_weight_gap']")
        if gap < 0:
            raise ValueError(f"{where}['max_weight_gap']={gap} must be >= 0")
        return cls(max_weight_gap=gap)


@dataclass(frozen=True)
class ExpBRule:
    """Experiment B's pre-registered decision rules (config `expb:`): the level of the tests,
    one `DesignRule` per configured target-mass design and the factorial design's rule (None:
    not configured)."""

    alpha: float = schema_defaults("expb")["alpha"]
    designs: dict[str, DesignRule] = field(default_factory=dict)
    factorial: FactorialRule | None = None

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any]) -> ExpBRule:
        where = "params['expb']"
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where} must be a mapping, got {type(spec).__name__}")
        alpha = number(spec.get("alpha", cls.alpha), f"{where}['alpha']")
        if not 0 < alpha < 1:
            raise ValueError(f"{where}['alpha']={alpha} must be in (0, 1)")
        designs = spec.get("designs")
        if not isinstance(designs, Mapping) or not designs:
            raise ValueError(f"{where}['designs'] must map design names (study, matched) to rules")
        factorial = designs.get("factorial")
        if factorial is not None:
            factorial = FactorialRule.from_mapping(factorial, f"{where}['designs']['factorial']")
        designs = {name: d for name, d in designs.items() if name != "factorial"}
        rules = {}
        for name, d in designs.items():
            w = f"{where}['designs'][{name!r}]"
            if name not in _RULE_DEFAULTS:
                raise ValueError(f"{w}: unknown design; expected one of {sorted(_RULE_DEFAULTS)}")
            if not isinstance(d, Mapping) or "primary" not in d:
                raise ValueError(f"{w}['primary'] (the primary target mass m*) is required")
            known = {"primary", "heavy_mass", *_RULE_DEFAULTS[name]}
            unknown = sorted(set(d) - known)
            if unknown:
                raise ValueError(f"{w}: unknown key(s) {unknown}; known {sorted(known)}")
            values = {
                k: number(d.get(k, v), f"{w}[{k!r}]") for k, v in _RULE_DEFAULTS[name].items()
            }
            primary = number(d["primary"], f"{w}['primary']")
            if not 0 < primary < 1 or values["max_gap"] < 0:
                raise ValueError(f"{w}: primary must be in (0, 1) and max_gap >= 0")
            for k in ("min_heavy_fraction", "min_realized_fraction"):
                if k in values and not 0 <= values[k] <= 1:
                    raise ValueError(f"{w}[{k!r}]={values[k]} must be in [0, 1]")
            hm = d.get("heavy_mass")
            heavy_mass = None if hm is None else number(hm, f"{w}['heavy_mass']")
            rules[name] = DesignRule(name, primary, heavy_mass=heavy_mass, **values)
        return cls(alpha=alpha, designs=rules, factorial=factorial)


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
    are dropped so that no bin is always empty); `admission_early_tokens`: the admission
    profile's early part after a topic change; `mass_min_points` / `mass_cluster_gap`: the
    mass hypothesis' smallest point set and its cluster rule (`moesub.stats.mass`).
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
    admission_early_tokens: int = _DEFAULTS["admission_early_tokens"]
    mass_min_points: int = _DEFAULTS["mass_min_points"]
    mass_cluster_gap: float = _DEFAULTS["mass_cluster_gap"]

    def policy(self, name: str, meta: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """The policy called `name`: the config's, else the one an artefact's metadata `meta`
        records; None when neither knows it."""
        if name in self.policies:
            return self.policies[name]
        recorded = meta.get("policy") if meta is not None else None
        if isinstance(recorded, Mapping):
            return normalize_policy(name, dict(recorded))
        return None

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
        counts = {}
        for key, least in (("admission_early_tokens", 1), ("mass_min_points", 3)):
            value = params.get(key, _DEFAULTS[key])
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"params[{key!r}]={value!r} must be an integer >= {least}")
            counts[key] = value
        gap = number(
            params.get("mass_cluster_gap", _DEFAULTS["mass_cluster_gap"]),
            "params['mass_cluster_gap']",
        )
        if not 0 < gap <= 1:
            raise ValueError(f"params['mass_cluster_gap']={gap} must be in (0, 1]")
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
            mass_cluster_gap=gap,
            **counts,
        )
