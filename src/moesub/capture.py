"""Exact capture (token table + router-logit table) and the calibration's expert ranking.

Capture runs the exact model (every expert resident) over the streams with teacher forcing:
streams of equal length go through `moesub.models.stream_nll` (the same call the emulator
makes) in batches of at most `batch_tokens` tokens (`moesub.models.stream_batches`; recorded in
the token table's metadata so that replays batch identically), with a `RouterHook` recording
every MoE layer's router logits and lookahead logits (the layer's router applied one MoE layer
earlier: what prefetch predicts from; docs/policy-semantics.md, v2).

Router table rows are written in (stream, pos, layer) order, two rows of E float32 logits each
(logits, lookahead; `moesub.artefacts.logits_type`), in row groups of about `row_group_mb`, by
a background thread. Memory is bounded by one batch's logits and lookahead (2 x B x T x L x E
float32) plus two pending row groups.

`run_expert_ranking` counts the calibration capture's top-k selections into each layer's
expert ranking, whose prefixes are every cache's initial experts (`moesub.layout`). The
artefacts' schemas, readers and writers are `moesub.artefacts`.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from tqdm.auto import tqdm

from moesub.artefacts import (
    load_trace,
    read_streams,
    router_rows,
    router_writer,
    selection_counts,
    write_expert_ranking,
)
from moesub.config import schema_defaults
from moesub.io import ParquetStreamWriter, write_parquet
from moesub.models import ModelLoading
from moesub.params import options_from, torch_device, torch_dtype

_DEFAULTS = schema_defaults("capture")  # workflow/schemas/config.schema.yaml


@dataclass(frozen=True)
class CaptureParams:
    """Config `capture:` section (all optional)."""

    dtype: str = _DEFAULTS["dtype"]  # model dtype: float32 | bfloat16 | float16
    device: str = _DEFAULTS["device"]  # torch device, or "auto" (cuda if available)
    row_group_mb: float = _DEFAULTS["row_group_mb"]  # router-table row-group size
    # tokens per teacher-forced forward (equal-length streams batched)
    batch_tokens: int = _DEFAULTS["batch_tokens"]
    name: str | None = None  # recorded as metadata `model` (default: the model directory)
    # the model's placement (config `models.<name>.loading`, added by the workflow)
    loading: ModelLoading | Mapping[str, Any] | None = field(default_factory=ModelLoading)

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | None) -> CaptureParams:
        p = options_from(cls, params, "capture", section="capture")
        return replace(p, loading=ModelLoading.from_dict(p.loading))


# --------------------------------------------------------------------------------------------
# capture


class _Recorder:
    """RouterHook callback (lookahead on) keeping each MoE layer's logits and lookahead logits
    [N, E] of the current forward, and their sums: a finite sum means every logit is finite
    (a NaN or an infinity makes the sum NaN or infinite), checked while the logits are in
    cache rather than in a pass over the whole batch."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.logits: list[torch.Tensor | None] = [None] * num_layers
        self.lookahead: list[torch.Tensor | None] = [None] * num_layers
        self.sums: list[torch.Tensor] = []

    def __call__(self, layer: int, logits: torch.Tensor, weights, ids, lookahead) -> None:
        if self.logits[layer] is not None:
            raise RuntimeError(f"router of MoE layer {layer} ran twice in one forward")
        self.logits[layer] = logits.detach()
        self.lookahead[layer] = lookahead.detach()
        self.sums += [logits.sum(), lookahead.sum()]  # on the logits' device: no sync here
        return None

    def all_finite(self) -> bool:
        """True if every recorded logit is finite; False if some may not be (a NaN, an
        infinity, or a sum that overflowed: check the logits themselves)."""
        return all(bool(torch.isfinite(z)) for z in self.sums)

    @staticmethod
    def _stack(rows: list[torch.Tensor | None]) -> np.ndarray:
        if any(z is None for z in rows):
            raise RuntimeError("not every MoE layer's router ran in the forward")
        # one device for the stack: a placed model's layers may run on different devices
        device = rows[0].device  # type: ignore[union-attr]
        return torch.stack([z.to(device) for z in rows], dim=1).cpu().numpy()  # type: ignore[union-attr]

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """(logits, lookahead), each (N, L, E) float32, of the last forward (N = B*T rows,
        batch-major); resets."""
        out = self._stack(self.logits), self._stack(self.lookahead)
        self.logits = [None] * self.num_layers
        self.lookahead = [None] * self.num_layers
        self.sums = []
        return out


def capture_batch(
    model: torch.nn.Module,
    writer: ParquetStreamWriter | BackgroundWriter,
    stream_ids: list[int],
    token_ids: np.ndarray,
    rows_per_group: int,
) -> np.ndarray:
    """Capture B equal-length streams in one teacher-forced forward, recording every router
    and its lookahead logits.

    `token_ids` (B, T). Writes each stream's router rows to `writer` (`rows_per_group`
    positions per row group) and returns the NLL `(B, T)` float64 (NaN at position 0).
    """
    from moesub.models import RouterHook, moe_blocks, stream_nll

    recorder = _Recorder(len(moe_blocks(model)))
    ids = torch.from_numpy(np.asarray(token_ids, dtype=np.int64))  # (B, T)
    B, T = ids.shape
    with RouterHook(model, recorder, lookahead=True):
        nll = stream_nll(model, ids)  # (B, T)
    finite = recorder.all_finite()
    logits, ahead = recorder.take()  # (B*T, L, E) float32 each
    logits = logits.reshape(B, T, *logits.shape[1:])  # (B, T, L, E)
    ahead = ahead.reshape(logits.shape)
    for b, stream_id in enumerate(stream_ids):
        if not finite and not (np.isfinite(logits[b]).all() and np.isfinite(ahead[b]).all()):
            raise ValueError(
                f"stream {stream_id}: the model produced NaN or infinite router logits"
            )
        for p in range(0, T, rows_per_group):
            rows = slice(p, p + rows_per_group)
            writer.write_table(router_rows(stream_id, logits[b, rows], p, ahead[b, rows]))
    return nll


class BackgroundWriter:
    """Runs `writer.write_table` on a worker thread so Parquet I/O overlaps the next forward.

    At most `max_pending` tables wait in the queue (bounded memory). An error on the worker is
    re-raised by the next `write_table` or by `close`. Use as a context manager.
    """

    def __init__(self, writer: Any, max_pending: int = 2):
        self._writer = writer
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="router-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (table := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._writer.write_table(table)
                except BaseException as e:  # re-raised on the caller's thread
                    self._error = e

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def write_table(self, table: pa.Table) -> None:
        self._check()
        self._queue.put(table)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._check()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_capture(
    model_dir: str | os.PathLike,
    streams_path: str | os.PathLike,
    out_tokens: str | os.PathLike,
    out_router: str | os.PathLike,
    params: Mapping[str, Any] | None = None,
) -> None:
    """Capture NLL and router logits of the exact model over every stream (see module doc)."""
    from moesub.models import load_model, moe_info, stream_batches

    opts = CaptureParams.from_dict(params)
    table, streams_meta = read_streams(streams_path)
    device = torch_device(opts.device)
    model, _ = load_model(
        model_dir, dtype=torch_dtype(opts.dtype), device=device, loading=opts.loading
    )
    info = moe_info(model)
    token_ids = table.column("token_id").to_numpy()
    if token_ids.min() < 0 or token_ids.max() >= info.vocab_size:
        raise ValueError(
            f"streams file {str(streams_path)!r}: token ids span [{token_ids.min()}, "
            f"{token_ids.max()}], outside the model's vocabulary of {info.vocab_size}"
        )
    L, E = info.num_layers, info.num_experts
    meta = {
        "num_experts": E,
        "top_k": info.top_k,
        "num_layers": L,
        "norm_topk_prob": info.norm_topk_prob,
        "model": opts.name if opts.name is not None else str(model_dir),
        "family": info.family,
        "layer_indices": list(info.layer_indices),
        "dtype": opts.dtype,
        "batch_tokens": opts.batch_tokens,
    }
    # positions per row group: two rows of E float32 per (position, layer)
    rows_per_group = max(1, int(opts.row_group_mb * 2**20 // (2 * 4 * E * L)))
    stream = table.column("stream").to_numpy()
    starts = np.flatnonzero(np.r_[True, stream[1:] != stream[:-1]])
    lengths = np.diff(np.r_[starts, len(stream)])
    batches = stream_batches(lengths.tolist(), opts.batch_tokens)
    nll = np.full(len(stream), np.nan)
    with router_writer(out_router, E, meta) as file_writer, BackgroundWriter(file_writer) as writer:
        for batch in tqdm(batches, desc="capture", unit="batch"):
            T = int(lengths[batch[0]])
            rows = starts[batch][:, None] + np.arange(T)  # (B, T) row indices
            ids = [int(stream[starts[i]]) for i in batch]
            nll[rows] = capture_batch(model, writer, ids, token_ids[rows], rows_per_group)
    pos = table.column("pos").to_numpy()
    tokens = table.append_column("nll", pa.array(nll, type=pa.float64(), mask=pos == 0))
    write_parquet(tokens, out_tokens, metadata={**streams_meta, **meta})


# --------------------------------------------------------------------------------------------
# expert ranking


def run_expert_ranking(calib_router_path: str | os.PathLike, out_path: str | os.PathLike) -> None:
    """Per layer every expert ranked by its top-k selections on a calibration capture (most
    selected first, ties to the lower id), with the counts (`moesub.artefacts.RANKING_COLUMNS`)."""
    trace = load_trace(calib_router_path)
    meta = {
        "num_experts": trace.num_experts,
        "top_k": trace.top_k,
        "num_layers": trace.num_layers,
        "source": str(calib_router_path),
        "tokens": trace.num_tokens,
    }
    write_expert_ranking(selection_counts(trace), out_path, meta)
