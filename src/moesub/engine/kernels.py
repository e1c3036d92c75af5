"""Expert compute from slot buffers, planned on the host: no device->host round trip inside.

`expert_forward` computes, for every (token n, rank j) whose `ids[n, j] >= 0`, the gated expert
held in group `ids[n, j]` of the weight tensors (`gate_up [G, 2I, H]`, `down [G, H, I]`: the
engine's expert layout, into which each family's adapter puts its experts,
`moesub.models.MoEFamily.expert_weights`; the groups are cache slots on the fast tier, or
experts of a host tensor), weighted by `weights[n, j]` and summed over j in slot order as
transformers' experts implementations do, so that with every expert resident the result matches
the stock model. `per_rank=True` returns the weighted rows before that sum: a caller that
computes some ranks elsewhere (the host's experts) adds its rows (zeros elsewhere, so the sum is
exact) and sums once, bit for bit what one call over every rank gives.

`ids` is a host array (the engine decides on the host, so it knows them without asking the
device): which entries are computed, and with which weights, is planned there, so the kernel
needs no `nonzero` / `bincount` / `.item()` (each a device->host synchronization on a GPU).

Two paths; `choose_path` gives a tier's path for many tokens from the device and dtype, and
`path_for` the one a call takes from its token count:
- `"grouped"`: one `grouped_mm` per projection over the rows sorted by group. Torch's fast
  grouped kernel exists only for bf16 on compute capability 9.x / 10.x (Hopper, Blackwell);
  elsewhere torch runs an internal fallback that loops over all G groups, so its cost grows
  with the cache capacity. The plan's row order and group offsets are uploaded once per call.
  Taken for `GROUPED_MIN_TOKENS` tokens or more (prefill) where the tier's path is grouped.
- `"per_expert"`: per group used, one matmul per projection over that group's rows, on a view
  of the group's weights (no gather copy): every used expert's weights are read once, whatever
  the number of groups G (the cache capacity), so a decode step (one token, k experts) runs at
  the memory bandwidth (`benchmarks/bench_kernels.py` measures it). Decode everywhere, and every
  call on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
GROUPED_CAPABILITIES = (9, 10)  # major compute capabilities with torch's fast grouped kernel
PATHS = ("grouped", "per_expert")
# fewer tokens than this (decode) take the per-expert path also where grouped is fast: the
# grouped kernel's plan upload and per-group setup do not pay for k single rows
GROUPED_MIN_TOKENS = 8

Upload = Callable[[np.ndarray], torch.Tensor]  # host int64 array -> the same on the device


def choose_path(
    device: torch.device, dtype: torch.dtype, capability: tuple[int, int] | None = None
) -> str:
    """ "grouped" where torch's grouped kernel is fast (CUDA, bf16, capability 9.x / 10.x), else
    "per_expert". `capability` overrides the device's (tests choose without a GPU)."""
    if _GROUPED_MM is None or device.type != "cuda" or dtype != torch.bfloat16:
        return "per_expert"
    cap = capability if capability is not None else torch.cuda.get_device_capability(device)
    return "grouped" if cap[0] in GROUPED_CAPABILITIES else "per_expert"


def path_for(path: str, tokens: int) -> str:
    """The kernel a call of `tokens` tokens takes on a tier whose many-token path is `path`."""
    if path not in PATHS:
        raise ValueError(f"expert kernel path {path!r}: expected one of {PATHS}")
    return "grouped" if path == "grouped" and tokens >= GROUPED_MIN_TOKENS else "per_expert"


@dataclass(frozen=True)
class ExpertPlan:
    """One call's computed entries, planned on the host from `ids (N, k)`."""

    rows: np.ndarray  # int64 (S,): flat index n * k + j of every computed entry, sorted by group
    groups: np.ndarray  # int64 (S,): the group of each
    offs: np.ndarray  # int64 (G,): cumulative row count per group (grouped_mm's `offs`)

    @classmethod
    def of(cls, ids: np.ndarray, num_groups: int) -> ExpertPlan:
        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
        rows = np.flatnonzero(flat >= 0)
        order = np.argsort(flat[rows], kind="stable")
        rows = rows[order]
        groups = flat[rows]
        if len(groups) and groups[-1] >= num_groups:
            raise ValueError(f"expert ids: group {groups[-1]} >= the {num_groups} groups given")
        offs = np.cumsum(np.bincount(groups, minlength=num_groups), dtype=np.int64)
        return cls(rows, groups, offs)


def expert_forward(
    hidden: torch.Tensor,
    ids: np.ndarray,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    path: str = "per_expert",
    upload: Upload | None = None,
    per_rank: bool = False,
) -> torch.Tensor:
    """hidden [N, H], ids (N, k) host array (group index, -1 = skip), weights [N, k] -> [N, H]
    (`per_rank`: the weighted rows [N, k, H], zero where skipped, before their sum over k).

    gate_up [G, 2I, H] (gate half first), down [G, H, I], hidden and weights on their device.
    `path` is the tier's many-token path (`path_for` picks the call's); `upload` moves the
    grouped path's index arrays to the device (default: a plain copy).
    """
    ids = np.asarray(ids)
    N, k = ids.shape
    H = hidden.shape[-1]
    plan = ExpertPlan.of(ids, gate_up.shape[0])
    if path_for(path, N) == "per_expert":
        ys = hidden.new_zeros(N * k, H)
        ends = np.flatnonzero(np.diff(plan.groups, append=-1)) + 1  # end of each group's run
        start = 0
        for end in ends.tolist():
            g, rows = int(plan.groups[start]), plan.rows[start:end]
            start = end
            if len(rows) == 1:  # decode: a view, no index tensors
                r = int(rows[0])
                x, w = hidden[r // k : r // k + 1], weights[r // k, r % k : r % k + 1]
            else:
                idx = torch.from_numpy(rows).to(hidden.device)
                x = hidden.index_select(0, idx // k)
                w = weights.reshape(-1).index_select(0, idx)
            gate, up = F.linear(x.to(gate_up.dtype), gate_up[g]).chunk(2, dim=-1)
            y = F.linear(act(gate) * up, down[g])  # (rows, H)
            y = (y * w.to(y.dtype).unsqueeze(-1)).to(ys.dtype)
            if len(rows) == 1:
                ys[r] = y[0]
            else:
                ys.index_copy_(0, idx, y)
        return ys.view(N, k, H) if per_rank else ys.view(N, k, H).sum(dim=1)
    out = hidden.new_zeros(N * k, H)
    S = len(plan.rows)
    if S:
        if upload is None:
            idx = torch.from_numpy(np.concatenate([plan.rows, plan.offs])).to(hidden.device)
        else:
            idx = upload(np.concatenate([plan.rows, plan.offs]))
        rows, offs = idx[:S], idx[S:].to(torch.int32)
        x = hidden.index_select(0, rows // k).to(gate_up.dtype)  # (S, H)
        gate, up = _GROUPED_MM(x, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        y = _GROUPED_MM(act(gate) * up, down.transpose(1, 2), offs=offs)  # (S, H)
        y = y * weights.reshape(-1).index_select(0, rows).to(y.dtype).unsqueeze(-1)
        out.index_copy_(0, rows, y.to(out.dtype))
    return out.view(N, k, H) if per_rank else out.view(N, k, H).sum(dim=1)
