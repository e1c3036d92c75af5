"""Each model's routing geometry (E, k) and every capacity rule the config must satisfy.

C = `moesub.vocabulary.capacity_for(fraction, E)`; `check_capacities` checks every cache fraction
of the config against every model at parse time, naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moesub.config.inputs import check_checkpoint_dir
from moesub.config.names import check_name
from moesub.config.schema import schema_defaults
from moesub.vocabulary import capacity_for

# The cache fraction at which the study gives its regime figures (moesub.regime): 25% resident.
REGIME_FRACTION = 0.25
# HF config.json keys holding the number of routed experts / experts per token, by family.
_E_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_K_KEYS = ("num_experts_per_tok", "moe_top_k", "top_k")


def read_checkpoint_geometry(path: str | Path, where: str) -> tuple[int, int]:
    """(E, k) from a Hugging Face checkpoint's config.json (text_config for multimodal ones)."""
    cfg_path = check_checkpoint_dir(path, where) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg = cfg.get("text_config", cfg) if not any(k in cfg for k in _E_KEYS) else cfg
    num_experts = next((cfg[k] for k in _E_KEYS if cfg.get(k)), None)
    top_k = next((cfg[k] for k in _K_KEYS if cfg.get(k)), None)
    if num_experts is None or top_k is None:
        raise ValueError(
            f"{where}: {str(cfg_path)!r} has no expert count ({'/'.join(_E_KEYS)}) or top-k "
            f"({'/'.join(_K_KEYS)}): not a Mixture-of-Experts model"
        )
    return int(num_experts), int(top_k)


def model_geometry(config: Mapping[str, Any], name: str) -> tuple[int, int]:
    """(E, k) of model `name`: from the `embedded:` section or from the checkpoint's config.json."""
    spec = config["models"][name]
    if spec.get("embedded"):
        emb = {**schema_defaults("embedded"), **(config.get("embedded") or {})}
        return int(emb["num_experts"]), int(emb["num_experts_per_tok"])
    return read_checkpoint_geometry(spec["path"], f"models.{name}.path")


def expb_min_capacity(top_k: int) -> int:
    """The smallest resident set Experiment B can draw substitutes from: a token may have k - 1
    substituted ranks, each needing a resident not among its k computed experts (C >= 2k - 1)."""
    return 2 * top_k - 1


def check_capacities(config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Every capacity rule of the pipeline, per model, naming the key; returns model -> (E, k).

    C = `moesub.vocabulary.capacity_for(fraction, E)`. Every cache fraction (`fractions`,
    `expb.fraction` and the regime's fixed 25%) must give k <= C <= E; Experiment B's substitute
    pool (`expb.fraction`'s C, or E with `expb.resident: all`) must hold 2k - 1 experts and its
    factorial design's ranks must be <= k; the engine benchmark's own geometry
    (`engine.bench`) must give k <= C <= E.
    """
    geometry = {}
    fractions = [(f"fractions[{i}]", f) for i, f in enumerate(config["fractions"])]
    expb = config.get("expb") or {}
    if expb.get("fraction") is not None:
        fractions.append(("expb.fraction", expb["fraction"]))
    fractions.append(("the regime's fixed fraction (moesub.regime)", REGIME_FRACTION))
    for name in config["models"]:
        check_name(name, f"models.{name}")
        num_experts, top_k = model_geometry(config, name)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"model {name!r}: top-k {top_k} must be in [1, E={num_experts}]")
        source = (
            "embedded.num_experts / embedded.num_experts_per_tok"
            if config["models"][name].get("embedded")
            else f"config.json of models.{name}.path"
        )
        model = f"model {name!r} (E={num_experts}, k={top_k} from {source})"
        for label, fraction in fractions:
            cap = capacity_for(fraction, num_experts)
            if cap < top_k:
                raise ValueError(
                    f"{label}={fraction} gives capacity C={cap} < k={top_k} for {model}: "
                    "C = floor(fraction * E + 0.5) must be >= k"
                )
            if cap > num_experts:
                raise ValueError(f"{label}={fraction} gives C={cap} > E={num_experts}")
        if expb:
            every_expert = expb.get("resident") == "all"
            fraction = expb.get("fraction", schema_defaults("expb")["fraction"])
            pool = num_experts if every_expert else capacity_for(fraction, num_experts)
            need = expb_min_capacity(top_k)
            if pool < need:
                key = "expb.resident: all" if every_expert else f"expb.fraction={fraction}"
                raise ValueError(
                    f"{key} gives Experiment B a substitute pool of {pool} experts per layer for "
                    f"{model}; it needs C >= 2k - 1 = {need} (a token may have k - 1 substituted "
                    f"ranks, each replaced by a resident outside its k computed experts): raise "
                    f"expb.fraction to >= {need / num_experts:.3g}"
                )
            factorial = {**schema_defaults("expb.designs.factorial"),
                         **((expb.get("designs") or {}).get("factorial") or {})}  # fmt: skip
            if factorial["enabled"] and factorial["high_ranks"][1] > top_k:
                raise ValueError(
                    f"expb.designs.factorial.high_ranks={factorial['high_ranks']} reaches past "
                    f"the router's top-k for {model}: ranks run 2..k (or set enabled: false)"
                )
        geometry[name] = (num_experts, top_k)
    b = {**schema_defaults("engine.bench"), **((config.get("engine") or {}).get("bench") or {})}
    if b["enabled"]:
        cap = capacity_for(b["fraction"], b["num_experts"])
        if not b["top_k"] <= cap <= b["num_experts"]:
            raise ValueError(
                f"engine.bench.fraction={b['fraction']} gives the benchmark capacity C={cap} "
                f"outside [k={b['top_k']}, E={b['num_experts']}] (engine.bench.top_k, "
                "engine.bench.num_experts)"
            )
    return geometry
