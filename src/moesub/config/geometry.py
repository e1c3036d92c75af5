"""Each model's routing geometry (E, k) and pricing geometry (what its experts weigh), read
from the `embedded:` section or a checkpoint's config.json. The capacity rules built on them are
`moesub.config.sizes`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moesub.config.inputs import check_checkpoint_dir
from moesub.config.schema import schema_defaults
from moesub.slots import REFERENCE_GEOMETRY, PricingGeometry

# HF config.json keys holding the number of routed experts / experts per token / an expert's
# intermediate width, by family.
_E_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_K_KEYS = ("num_experts_per_tok", "moe_top_k", "top_k")
_WIDTH_KEYS = ("moe_intermediate_size", "intermediate_size")


def _checkpoint_config(path: str | Path, where: str) -> tuple[Path, dict[str, Any]]:
    """A checkpoint's config.json path and its (text) config (text_config for multimodal)."""
    cfg_path = check_checkpoint_dir(path, where) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    return cfg_path, cfg.get("text_config", cfg) if not any(k in cfg for k in _E_KEYS) else cfg


def read_checkpoint_geometry(path: str | Path, where: str) -> tuple[int, int]:
    """(E, k) from a Hugging Face checkpoint's config.json (text_config for multimodal ones)."""
    cfg_path, cfg = _checkpoint_config(path, where)
    num_experts = next((cfg[k] for k in _E_KEYS if cfg.get(k)), None)
    top_k = next((cfg[k] for k in _K_KEYS if cfg.get(k)), None)
    if num_experts is None or top_k is None:
        raise ValueError(
            f"{where}: {str(cfg_path)!r} has no expert count ({'/'.join(_E_KEYS)}) or top-k "
            f"({'/'.join(_K_KEYS)}): not a Mixture-of-Experts model"
        )
    return int(num_experts), int(top_k)


def read_pricing_geometry(path: str | Path, where: str) -> PricingGeometry:
    """What a checkpoint's experts weigh, from its config.json: MoE layers (the decoder layers
    less `mlp_only_layers`, those off `decoder_sparse_step` and the first `first_k_dense_replace`),
    E, hidden_size and the expert width (moe_intermediate_size, else intermediate_size)."""
    cfg_path, cfg = _checkpoint_config(path, where)
    num_experts, _ = read_checkpoint_geometry(path, where)
    width = next((cfg[k] for k in _WIDTH_KEYS if cfg.get(k)), None)
    if not cfg.get("num_hidden_layers") or not cfg.get("hidden_size") or width is None:
        raise ValueError(
            f"{where}: {str(cfg_path)!r} lacks num_hidden_layers, hidden_size or an expert width "
            f"({'/'.join(_WIDTH_KEYS)}): its experts cannot be priced for a budget"
        )
    dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    first = int(cfg.get("first_k_dense_replace") or 0)
    layers = [
        i for i in range(int(cfg["num_hidden_layers"]))
        if i not in dense and (i + 1) % step == 0 and i >= first
    ]  # fmt: skip
    return PricingGeometry(
        moe_layers=len(layers),
        num_experts=num_experts,
        hidden=int(cfg["hidden_size"]),
        width=int(width),
        source=f"config.json of {where} ({len(layers)} MoE layers, {num_experts} experts, "
        f"hidden {int(cfg['hidden_size'])}, expert width {int(width)})",
    )


def read_head_weights(path: str | Path, where: str) -> int:
    """Weights of a checkpoint's LM head: vocab_size x hidden_size, from its config.json."""
    cfg_path, cfg = _checkpoint_config(path, where)
    if not cfg.get("vocab_size") or not cfg.get("hidden_size"):
        raise ValueError(
            f"{where}: {str(cfg_path)!r} lacks vocab_size or hidden_size: its LM head cannot be "
            "priced"
        )
    return int(cfg["vocab_size"]) * int(cfg["hidden_size"])


def pricing_geometry(config: Mapping[str, Any], name: str) -> PricingGeometry:
    """Model `name`'s pricing geometry: a checkpoint's own config.json; the embedded model at
    the reference geometry (`moesub.layout.REFERENCE_GEOMETRY`), whose routing it copies."""
    spec = config["models"][name]
    if spec.get("embedded"):
        return REFERENCE_GEOMETRY
    return read_pricing_geometry(spec["path"], f"models.{name}.path")


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
