"""A plan a runtime can load: what to run for one (model, hardware, cache size) (docs/plan.md).

`results/{model}/plan/{hardware}/{size}.json` holds the model's identity (path, SHA-256 of its
config.json, E, k, L and the decoder layer of each MoE layer), the recommended policy (its
name and fields), per MoE layer its slot count, initial resident experts (hottest first) and
pinned experts (a prefix of them), the predicted figures and where each came from.
`{size}.pins.txt` beside it holds the pinned experts in fitz-tec's pin-list form
(`moesub.traces.write_pin_list`), in the model's decoder-layer numbering (dense layers pin
nothing).

The plan takes the recommendation's within-budget choice of the simulator's ranking for that
hardware and size (every hardware has one; an engine ranking exists only where an engine ran),
else its lossless choice. `write_plan` / `read_plan` are exact inverses; `read_plan` checks the
document against `PLAN_SCHEMA` and its own consistency (slots, initial and pinned experts per
layer, the pin list beside it) and raises a ValueError naming the file and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np

from moesub.artefacts import read_expert_ranking
from moesub.io import read_metadata, write_json
from moesub.traces import read_pin_list, write_pin_list

PLAN_FORMAT, PLAN_VERSION = "moesub-plan", 1
CHOICES = ("within_budget", "lossless")
PREDICTED = (
    "time_per_token_s", "time_lo_s", "time_hi_s", "tokens_per_s", "speedup_vs_fetch_every_miss",
    "speedup_vs_fetch_every_miss_lo", "speedup_vs_fetch_every_miss_hi", "speedup_vs_host_compute",
    "speedup_vs_host_compute_lo", "speedup_vs_host_compute_hi", "hit_rate", "misses_per_token",
    "lossless", "dppl_pct", "dppl_ci_lo", "dppl_ci_hi", "report_dppl_pct", "report_dppl_ci_lo",
    "report_dppl_ci_hi", "screen_dppl_pct", "screen_dppl_ci_lo", "screen_dppl_ci_hi",
)  # fmt: skip


@dataclass(frozen=True)
class ModelIdentity:
    name: str
    path: str  # the checkpoint directory the plan was made for
    config_sha256: str  # of its config.json: a runtime checks it loads the same model
    family: str  # config.model_type
    num_experts: int  # E
    top_k: int  # k
    num_layers: int  # MoE layers L
    num_hidden_layers: int  # decoder layers: the runtime's (and the pin list's) numbering
    layer_indices: tuple[int, ...]  # decoder layer of each MoE layer, ascending


@dataclass(frozen=True)
class LayerPlan:
    layer: int  # MoE layer 0..L-1
    model_layer: int  # its decoder layer
    slots: int  # C_l experts resident
    initial: tuple[int, ...]  # the C_l experts resident at the start, hottest first
    pinned: tuple[int, ...]  # never evicted: the first pin_l of `initial`


@dataclass(frozen=True)
class Plan:
    model: ModelIdentity
    hardware: str  # the hardware profile whose pricing ranked the candidates
    size: dict[str, Any]  # the cache size: label, capacity, fraction (and a budget's bytes)
    choice: str  # within_budget | lossless: which of the recommendation's choices
    policy_name: str
    policy: dict[str, Any]  # the policy's config fields
    layers: tuple[LayerPlan, ...]
    predicted: dict[str, Any]  # `PREDICTED`
    sources: dict[str, str]  # where each predicted figure and the layout came from
    pins_file: str  # the pin list's file name, beside the plan

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["model"]["layer_indices"] = list(self.model.layer_indices)
        d["layers"] = [
            {**asdict(lp), "initial": list(lp.initial), "pinned": list(lp.pinned)}
            for lp in self.layers
        ]
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION, **d}


def pins_path(plan_path: str | os.PathLike) -> Path:
    """`{size}.pins.txt` beside `{size}.json`."""
    p = Path(plan_path)
    return p.with_name(f"{p.stem}.pins.txt")


def write_plan(plan: Plan, path: str | os.PathLike) -> Path:
    """The plan's JSON at `path` and its pin list beside it (`pins_path`), each atomically."""
    if plan.pins_file != pins_path(path).name:
        raise ValueError(f"plan: pins_file {plan.pins_file!r} is not {pins_path(path).name!r}")
    doc = plan.to_dict()
    from_dict(doc, str(path))  # a plan that would not read back is not written
    m = plan.model
    write_pin_list(
        pins_path(path),
        {lp.model_layer: lp.pinned for lp in plan.layers},
        m.num_experts,
        num_layers=m.num_hidden_layers,
        comments=[
            f"moesub plan {Path(path).name}: model {m.name}, hardware {plan.hardware}, "
            f"size {plan.size['label']}, policy {plan.policy_name}"
        ],  # fmt: skip
    )
    return write_json(doc, path)


def read_plan(path: str | os.PathLike) -> Plan:
    """The plan at `path`, checked (module doc), with its pin list beside it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"plan {str(path)!r} does not exist")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"plan {str(path)!r}: not JSON ({e})") from None
    plan = from_dict(doc, str(path))
    pins = read_pin_list(pins_path(path))
    want = {lp.model_layer: lp.pinned for lp in plan.layers}
    got = {i: p for i, p in enumerate(pins.layers) if p or i in want}
    if pins.num_experts != plan.model.num_experts or got != want:
        raise ValueError(f"plan {str(path)!r}: {pins_path(path).name} does not list its pins")
    return plan


def from_dict(doc: Any, where: str) -> Plan:
    """A plan document checked against `PLAN_SCHEMA` and for consistency."""
    try:
        jsonschema.validate(doc, PLAN_SCHEMA)
    except jsonschema.ValidationError as e:
        at = "/".join(str(p) for p in e.absolute_path) or "the document"
        raise ValueError(f"plan {where!r}: {at}: {e.message}") from None
    m = ModelIdentity(**{**doc["model"], "layer_indices": tuple(doc["model"]["layer_indices"])})
    layers = tuple(
        LayerPlan(**{**lp, "initial": tuple(lp["initial"]), "pinned": tuple(lp["pinned"])})
        for lp in doc["layers"]
    )
    _check(m, layers, where)
    rest = {k: doc[k] for k in ("hardware", "size", "choice", "policy_name", "policy",
                                "predicted", "sources", "pins_file")}  # fmt: skip
    return Plan(model=m, layers=layers, **rest)


def _check(m: ModelIdentity, layers: tuple[LayerPlan, ...], where: str) -> None:
    if len(m.layer_indices) != m.num_layers or len(layers) != m.num_layers:
        raise ValueError(f"plan {where!r}: {m.num_layers} MoE layers, but {len(layers)} layer "
                         f"entries and {len(m.layer_indices)} layer indices")  # fmt: skip
    if any(not 0 <= i < m.num_hidden_layers for i in m.layer_indices):
        raise ValueError(f"plan {where!r}: layer_indices outside the {m.num_hidden_layers} layers")
    for layer, (lp, model_layer) in enumerate(zip(layers, m.layer_indices, strict=True)):
        at = f"plan {where!r}, MoE layer {layer}"
        if lp.layer != layer or lp.model_layer != model_layer:
            raise ValueError(f"{at}: out of order, or not at decoder layer {model_layer}")
        if not m.top_k <= lp.slots <= m.num_experts or len(lp.initial) != lp.slots:
            raise ValueError(
                f"{at}: {lp.slots} slots with {len(lp.initial)} initial experts (needs "
                f"k = {m.top_k} <= slots <= E = {m.num_experts}, one initial expert per slot)"
            )
        if len(set(lp.initial)) != lp.slots or not all(0 <= e < m.num_experts for e in lp.initial):
            raise ValueError(f"{at}: initial experts must be distinct ids in [0, {m.num_experts})")
        if lp.pinned != lp.initial[: len(lp.pinned)] or len(lp.pinned) + m.top_k > lp.slots:
            raise ValueError(
                f"{at}: pinned experts must be the first of the initial ones and leave k = "
                f"{m.top_k} slots free"
            )


# ---- building a plan from the pipeline's artefacts -------------------------------------------


def model_identity(name: str, model_dir: str | os.PathLike, router_path: str) -> ModelIdentity:
    """The identity of `model_dir`'s checkpoint: its config.json (hash, decoder layers) and the
    captured router trace's metadata (family, E, k, L, the MoE layers' decoder indices)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"plan: {str(config_path)!r} does not exist")
    raw = config_path.read_bytes()
    config = json.loads(raw)
    meta = read_metadata(router_path)
    text = config.get("text_config") or {}  # multimodal configs nest the language model's
    hidden = config.get("num_hidden_layers", text.get("num_hidden_layers"))
    return ModelIdentity(
        name=name,
        path=str(Path(model_dir).resolve()),
        config_sha256=hashlib.sha256(raw).hexdigest(),
        family=str(meta.get("family") or config.get("model_type")),
        num_experts=int(meta["num_experts"]),
        top_k=int(meta["top_k"]),
        num_layers=int(meta["num_layers"]),
        num_hidden_layers=int(hidden),
        layer_indices=tuple(int(i) for i in meta["layer_indices"]),
    )


def ranking_of(doc: Mapping[str, Any], hardware: str, size: str) -> dict[str, Any]:
    """The recommendation's simulator ranking for (hardware, size); ValueError if it has none."""
    found = [
        r
        for r in doc.get("rankings") or []
        if (r["hardware"], r["size"], r["time_source"]) == (hardware, size, "simulator")
    ]
    if len(found) != 1:
        have = sorted({(r["hardware"], r["size"]) for r in doc.get("rankings") or []})
        raise ValueError(
            f"plan: the recommendation of {doc.get('model')!r} has no simulator ranking for "
            f"hardware {hardware!r} at size {size!r} (it has {have})"
        )
    return found[0]


def build_plan(
    doc: Mapping[str, Any],
    hardware: str,
    size: Mapping[str, Any],
    model: ModelIdentity,
    ranking: np.ndarray,
    plan_name: str,
) -> Plan:
    """The plan of one (hardware, size) from the recommendation `doc` (module doc): the chosen
    policy's layout is its slots and pins per layer (`slots_per_layer`, `pins_per_layer`) over
    the expert `ranking` ((L, E), hottest first: layer l starts with its first C_l experts and
    pins the first pin_l of them, as every stage's layout does, `moesub.layout`); `plan_name`:
    the plan file's name."""
    r = ranking_of(doc, hardware, size["label"])
    kind = next((k for k in CHOICES if r.get(k) is not None), None)
    if kind is None:
        raise ValueError(
            f"plan: no policy to run for {model.name!r} on {hardware!r} at {size['label']!r}: "
            f"{r.get('within_budget_reason')}"
        )
    c = r[kind]
    layers = tuple(
        LayerPlan(
            layer,
            model.layer_indices[layer],
            len(ids),
            tuple(int(e) for e in ids),
            tuple(int(e) for e in ids[:pin]),
        )  # fmt: skip
        for layer, (ids, pin) in enumerate(
            zip(
                (ranking[layer, :slots] for layer, slots in enumerate(c["slots_per_layer"])),
                c["pins_per_layer"],
                strict=True,
            )
        )
    )
    split = doc.get("selection") or {}
    sources = {
        "time": f"{r['timing']['text']}; priced for hardware {hardware!r}",
        "hit_rate": "the simulator's replay of the evaluation streams",
        "dppl": "emulated over the evaluation streams (exact where the policy is lossless by "
        f"construction): report half = streams {split.get('report_streams')}, the streams the "
        f"choice was not made on; screen half = streams {split.get('screen_streams')}",
        "layout": "initial experts: the calibration capture's selection-frequency ranking, "
        "hottest first (ties to the lower id); pinned: the policy's pin spec",
        "recommendation": f"results/{model.name}/recommendation.json, {kind} at "
        f"{doc.get('dppl_budget_pct')}% Δppl budget",
    }
    return Plan(
        model=model,
        hardware=hardware,
        size=dict(size),
        choice=kind,
        policy_name=c["policy"],
        policy=dict(c["fields"]),
        layers=layers,
        predicted={k: c.get(k) for k in PREDICTED},
        sources=sources,
        pins_file=pins_path(plan_name).name,
    )


def run_plan(
    recommendation_path: str | os.PathLike,
    model: str,
    hardware: str,
    size: Mapping[str, Any],
    model_dir: str | os.PathLike,
    router_path: str,
    ranking_path: str | os.PathLike,
    out_path: str | os.PathLike,
) -> Plan:
    """Snakemake entry point (rule plan): the plan of (`model`, `hardware`, `size`) from the
    recommendation, the model's checkpoint and capture, and its expert ranking; written with
    its pin list (`write_plan`)."""
    doc = json.loads(Path(recommendation_path).read_text())
    identity = model_identity(model, model_dir, router_path)
    ranking = read_expert_ranking(ranking_path, identity.num_layers, identity.num_experts)
    plan = build_plan(doc, hardware, size, identity, ranking, Path(out_path).name)
    write_plan(plan, out_path)
    return plan


_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_NUM = {"type": ["number", "boolean", "null"]}
PLAN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": [
        "format",
        "version",
        "model",
        "hardware",
        "size",
        "choice",
        "policy_name",
        "policy",
        "layers",
        "predicted",
        "sources",
        "pins_file",
    ],  # fmt: skip
    "properties": {
        "format": {"const": PLAN_FORMAT},
        "version": {"const": PLAN_VERSION},
        "model": {
            "type": "object",
            "additionalProperties": False,
            "required": [
                "name",
                "path",
                "config_sha256",
                "family",
                "num_experts",
                "top_k",
                "num_layers",
                "num_hidden_layers",
                "layer_indices",
            ],  # fmt: skip
            "properties": {
                "name": {"type": "string"},
                "path": {"type": "string"},
                "config_sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                "family": {"type": "string"},
                **{
                    k: {"type": "integer", "minimum": 1}
                    for k in ("num_experts", "top_k", "num_layers", "num_hidden_layers")
                },
                "layer_indices": _IDS,
            },  # fmt: skip
        },
        "hardware": {"type": "string"},
        "size": {
            "type": "object",
            "required": ["label", "capacity", "fraction"],
            "properties": {"label": {"type": "string"}, "capacity": {"type": "integer"}},
        },
        "choice": {"enum": list(CHOICES)},
        "policy_name": {"type": "string"},
        "policy": {"type": "object"},
        "layers": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["layer", "model_layer", "slots", "initial", "pinned"],
                "properties": {
                    "layer": {"type": "integer", "minimum": 0},
                    "model_layer": {"type": "integer", "minimum": 0},
                    "slots": {"type": "integer", "minimum": 1},
                    "initial": _IDS,
                    "pinned": _IDS,
                },
            },
        },
        "predicted": {
            "type": "object",
            "required": list(PREDICTED),
            "properties": {k: _NUM for k in PREDICTED},
        },
        "sources": {"type": "object", "additionalProperties": {"type": "string"}},
        "pins_file": {"type": "string", "pattern": r"^[^/]+\.pins\.txt$"},
    },
}
