"""A model given as a router trace (`models: {name: {trace: PATH, ...}}`): its parse-time
checks, the policies it can run, its import into the pipeline's capture artefacts, and the
export of a captured model's trace as RTRACE01 / MBLT (docs/traces.md, "A model given as a
trace").

The import turns one trace (or a trace and a separate calibration trace) into the two router
tables every downstream stage reads (`capture/{calib,eval}_router.parquet`):
- **streams**: each of the trace's streams (one for a runtime's file) is cut into consecutive
  streams of `stream_len` tokens, the remainder a last, shorter one (caches restart at each,
  as at each captured stream); nothing is shuffled or drawn, so the import is deterministic;
- **split**: with `calib_trace`, that file's streams are the calibration split and every
  stream of `trace` is evaluated; without, the first `calib_streams` streams are the
  calibration split and the rest the evaluation (at least one each, else a named error);
- **logits**: a trace with probabilities gives `log p` (`moesub.traces.base`); a trace of ids
  only gives `rank_logits` (rank r gets k - r, every other expert 0), which select exactly the
  ids, so only policies `logits_needed` passes run on it (`trace_policies`).

The router tables have no lookahead logits (no trace records them): a prefetch policy never
runs on a trace model.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moesub.artefacts import load_trace, router_rows, router_writer
from moesub.hardware import THIS_MACHINE
from moesub.io import write_json
from moesub.policy import Policy
from moesub.slots import policy_fields
from moesub.traces.base import RouterTrace, logits_needed, rank_logits
from moesub.traces.formats import FORMATS, TraceWriter, detect_format, read_trace

# A trace the pipeline itself writes (the export rule): checked by the import job, not at parse
# time (it does not exist yet); its geometry is its source model's.
EXPORTED = re.compile(
    r"^results/(?P<model>[^/]+)/capture/(?P<split>calib|eval)\.(?P<fmt>rtrace01|mblt)$"
)
EXPORT_FORMATS = ("rtrace01", "mblt")


@dataclass(frozen=True)
class TraceModel:
    """A trace model's settings (config `models.<name>`, schema defaults filled)."""

    name: str
    trace: str
    format: str | None
    top_k: int | None
    num_experts: int | None
    incomplete: str
    calib_trace: str | None
    stream_len: int
    calib_streams: int
    policies: tuple[str, ...] | None

    @classmethod
    def from_config(cls, name: str, spec: Mapping[str, Any]) -> TraceModel:
        policies = spec.get("policies")
        return cls(
            name=name,
            trace=str(spec["trace"]),
            format=spec.get("format"),
            top_k=spec.get("top_k"),
            num_experts=spec.get("num_experts"),
            incomplete=spec.get("incomplete", "error"),
            calib_trace=spec.get("calib_trace"),
            stream_len=int(spec.get("stream_len", 1024)),
            calib_streams=int(spec.get("calib_streams", 1)),
            policies=None if policies is None else tuple(policies),
        )

    def files(self) -> dict[str, str]:
        """ "trace" (and "calib_trace") -> path."""
        out = {"trace": self.trace}
        if self.calib_trace:
            out["calib_trace"] = self.calib_trace
        return out


@dataclass(frozen=True)
class TraceGeometry:
    """What the config needs of a trace before any job: E, k, whether it holds logits."""

    num_experts: int
    top_k: int
    has_logits: bool
    num_layers: int | None  # None: a trace the pipeline writes (read by the import job)


def is_trace_model(spec: Mapping[str, Any]) -> bool:
    return bool(spec.get("trace"))


def exported_source(path: str) -> tuple[str, str, str] | None:
    """(model, split, format) when `path` is a trace the export rule writes, else None."""
    m = EXPORTED.match(Path(path).as_posix().removeprefix("./"))
    return None if m is None else (m["model"], m["split"], m["fmt"])


def _file_format(tm: TraceModel, path: str) -> str:
    source = exported_source(path)
    fmt = tm.format or (source[2] if source else detect_format(path))
    if fmt not in FORMATS:
        raise ValueError(f"models.{tm.name}.format: {fmt!r} is not one of {FORMATS}")
    return fmt


def trace_geometry(
    config: Mapping[str, Any], name: str, source_geometry: Any = None
) -> TraceGeometry:
    """Check trace model `name`'s files and read their geometry; errors name the key.

    A file on disk is checked whole (`open_trace`: every named format error, before any job);
    an exported one (`EXPORTED`) must come from a captured model of this config and takes
    that model's (E, k) (`source_geometry(config, model)`)."""
    tm = TraceModel.from_config(name, config["models"][name])
    found = []
    for key, path in tm.files().items():
        where = f"models.{name}.{key}"
        source = exported_source(path)
        if source is None and not Path(path).is_file():
            raise FileNotFoundError(
                f"{where}: trace {path!r} does not exist (relative paths are relative to the "
                f"directory Snakemake runs in, {str(Path.cwd())!r})"
            )
        fmt = _file_format(tm, path)
        if source is not None:
            model = source[0]
            spec = (config["models"] or {}).get(model)
            if spec is None or is_trace_model(spec):
                raise ValueError(
                    f"{where}: {path!r} is what the export rule writes for model {model!r}, "
                    "which is not a captured model of this config"
                )
            E, k = source_geometry(config, model)
            found.append((key, TraceGeometry(E, k, fmt == "rtrace01", None)))
            continue
        st = os.stat(path)
        found.append((key, _file_geometry(tm, path, fmt, st.st_size, st.st_mtime_ns)))
    (_, first), *rest = found
    for key, g in rest:
        if (
            (g.num_experts, g.top_k, g.has_logits)
            != (
                first.num_experts,
                first.top_k,
                first.has_logits,
            )
            or None not in (g.num_layers, first.num_layers)
            and g.num_layers != first.num_layers
        ):
            raise ValueError(
                f"models.{name}.{key}: geometry {g} differs from models.{name}.trace's {first}"
            )
    return first


@functools.lru_cache(maxsize=64)
def _file_geometry(tm: TraceModel, path: str, fmt: str, size: int, mtime_ns: int) -> TraceGeometry:
    """A file's checked geometry, once per (settings, file version): the config is checked
    several times per Snakemake run."""
    tr = read_model_trace(tm, path, fmt)
    return TraceGeometry(tr.num_experts, tr.top_k, tr.has_logits, tr.num_layers)


def read_model_trace(tm: TraceModel, path: str, fmt: str | None = None) -> RouterTrace:
    """One of a trace model's files, checked whole, in memory."""
    top_k, num_experts = tm.top_k, tm.num_experts
    if fmt == "rtrace01" and top_k is None:
        raise ValueError(
            f"models.{tm.name}.top_k: required for an RTRACE01 trace ({path!r}), which does "
            "not record how many experts each token selects"
        )
    return read_trace(path, fmt, top_k=top_k, num_experts=num_experts, incomplete=tm.incomplete)


# --------------------------------------------------------------------------------------------
# policies


def trace_lacks(spec: Mapping[str, Any], has_logits: bool) -> str | None:
    """What a config policy needs that a trace model lacks (None: it runs on the trace)."""
    fields = {k: v for k, v in policy_fields(spec).items() if k != "pin"}
    policy = Policy.from_dict(fields)
    if policy.prefetch > 0:
        return "prefetch reads lookahead logits, which no trace records"
    if not has_logits:
        why = logits_needed(policy)
        if why:
            return f"{why}; the trace holds expert ids only"
    return None


def trace_policies(
    config: Mapping[str, Any],
    name: str,
    configured: list[str],
    policies: Mapping[str, Mapping[str, Any]],
    has_logits: bool,
) -> tuple[list[str], dict[str, str]]:
    """(the policies trace model `name` simulates, policy -> why it skips the others).

    `models.<name>.policies` lists them explicitly: each must run on the trace (a listed policy
    it cannot run is a config error naming the policy and what the trace lacks). Without it
    the model runs `configured` (the simulate list) less the policies it cannot run, each
    skipped with its reason (the report shows them)."""
    tm = TraceModel.from_config(name, config["models"][name])
    if tm.policies is not None:
        unknown = [p for p in tm.policies if p not in policies]
        if unknown:
            raise ValueError(
                f"models.{name}.policies: unknown policy name(s) {unknown}; known: "
                f"{sorted(policies)}"
            )
        for p in tm.policies:
            why = trace_lacks(policies[p], has_logits)
            if why:
                raise ValueError(f"models.{name}.policies: policy {p!r} cannot run: {why}")
        return list(tm.policies), {}
    run, skipped = [], {}
    for p in configured:
        why = trace_lacks(policies[p], has_logits)
        if why:
            skipped[p] = why
        else:
            run.append(p)
    return run, skipped


# --------------------------------------------------------------------------------------------
# hardware

# why a trace model is not priced on this_machine (its trace.json and the models table say so)
NO_ENGINE = "fitted to the engine's timed runs of the model; a trace model has no weights to run"


def trace_hardware(name: str, priced: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the hardware profiles trace model `name` is priced on, profile -> why not the
    others): every profile of `priced` (`hardware.price`) but this_machine; none left is a
    config error."""
    run = [h for h in priced if h != THIS_MACHINE]
    if not run:
        raise ValueError(
            f"models.{name}: a trace model is priced on the profiles of hardware.price other "
            f"than {THIS_MACHINE} ({NO_ENGINE}), and hardware.price lists {priced}"
        )
    return run, {THIS_MACHINE: NO_ENGINE} if THIS_MACHINE in priced else {}


# --------------------------------------------------------------------------------------------
# import


def cut_streams(lengths: tuple[int, ...], stream_len: int) -> list[tuple[int, int]]:
    """(start, stop) token spans: each stream cut into pieces of `stream_len`, the remainder
    a last shorter piece."""
    spans, s0 = [], 0
    for n in lengths:
        spans += [(t, min(t + stream_len, s0 + n)) for t in range(s0, s0 + n, stream_len)]
        s0 += n
    return spans


def _write_router(
    tr: RouterTrace, spans: list[tuple[int, int]], out_path: str, meta: dict[str, Any]
) -> int:
    """The router table of `spans` of `tr` (stream i = span i); returns its token count."""
    with router_writer(out_path, tr.num_experts, meta, lookahead=False) as w:
        for i, (a, b) in enumerate(spans):
            z = (
                tr.logits[a:b]
                if tr.logits is not None
                else rank_logits(tr.ids[a:b], tr.num_experts)
            )
            w.write_table(router_rows(i, np.ascontiguousarray(z, dtype=np.float32)))
    return sum(b - a for a, b in spans)


def import_trace(
    name: str,
    spec: Mapping[str, Any],
    calib_out: str | os.PathLike,
    eval_out: str | os.PathLike,
    summary_out: str | os.PathLike,
    skipped_policies: Mapping[str, str] | None = None,
    skipped_stages: str | None = None,
    skipped_hardware: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Trace model `name` (its config entry `spec`) -> the calibration and evaluation router
    tables and the model summary (results/{model}/trace.json, which also records the policies,
    stages and hardware profiles the pipeline skips for it and why); every file checked before
    anything is written."""
    tm = TraceModel.from_config(name, spec)
    tr = read_model_trace(tm, tm.trace, _file_format(tm, tm.trace))
    spans = cut_streams(tr.streams, tm.stream_len)
    if tm.calib_trace:
        cal = read_model_trace(tm, tm.calib_trace, _file_format(tm, tm.calib_trace))
        if (cal.num_experts, cal.top_k, cal.num_layers, cal.has_logits) != (
            tr.num_experts, tr.top_k, tr.num_layers, tr.has_logits,
        ):  # fmt: skip
            raise ValueError(
                f"models.{name}.calib_trace: E {cal.num_experts}, k {cal.top_k}, "
                f"{cal.num_layers} layers, logits {cal.has_logits}; models.{name}.trace has "
                f"{tr.num_experts}, {tr.top_k}, {tr.num_layers}, {tr.has_logits}"
            )
        cal_spans, eval_spans = cut_streams(cal.streams, tm.stream_len), spans
    else:
        cal, n = tr, tm.calib_streams
        if len(spans) <= n:
            raise ValueError(
                f"models.{name}: the trace's {tr.num_tokens} tokens make {len(spans)} stream(s) "
                f"of stream_len={tm.stream_len}, but calib_streams={n} leaves none to evaluate "
                "(lower stream_len or calib_streams, or give calib_trace)"
            )
        cal_spans, eval_spans = spans[:n], spans[n:]
    meta = {
        "num_experts": tr.num_experts,
        "top_k": tr.top_k,
        "num_layers": tr.num_layers,
        "norm_topk_prob": None,  # not recorded by a trace; only the emulator reads it
        "model": name,
        "family": f"trace:{tr.format}",
        "layer_indices": list(tr.layers),
        "trace_logits": "log_probabilities" if tr.has_logits else "rank_logits",
    }
    calib_tokens = _write_router(cal, cal_spans, str(calib_out), {**meta, "split": "calib"})
    eval_tokens = _write_router(tr, eval_spans, str(eval_out), {**meta, "split": "eval"})
    summary = {
        **meta,
        "source": "trace",
        "path": tm.trace,
        "format": tr.format,
        "calib_trace": tm.calib_trace,
        "has_logits": tr.has_logits,
        "dropped_tokens": tr.dropped_tokens + (cal.dropped_tokens if cal is not tr else 0),
        "stream_len": tm.stream_len,
        "calib_streams": len(cal_spans),
        "eval_streams": len(eval_spans),
        "calib_tokens": calib_tokens,
        "eval_tokens": eval_tokens,
        "skipped_policies": dict(skipped_policies or {}),
        "skipped_stages": skipped_stages,
        "skipped_hardware": dict(skipped_hardware or {}),
    }
    write_json(summary, summary_out)
    return summary


# --------------------------------------------------------------------------------------------
# export


def export_trace(
    router_path: str | os.PathLike, out_paths: Mapping[str, str | os.PathLike]
) -> None:
    """A captured router table written as each format of `out_paths` (format -> path): the
    streams concatenated in order (the files hold one token sequence: docs/traces.md)."""
    unknown = set(out_paths) - set(EXPORT_FORMATS)
    if unknown:
        raise ValueError(f"export_trace: cannot write {sorted(unknown)}; only {EXPORT_FORMATS}")
    trace = load_trace(router_path)
    for fmt, path in out_paths.items():
        with TraceWriter(path, fmt, trace.num_experts, trace.top_k) as w:
            for z in trace.logits:  # (T_s, L, E)
                w.write(logits=z)
