"""Expert compute from slot buffers: one grouped matmul per projection, no per-expert loop.

`grouped_experts` computes, for every (token n, rank j) whose `ids[n, j] >= 0`, the gated expert
held in group `ids[n, j]` of the weight tensors (`gate_up [G, 2I, H]`, `down [G, H, I]`; the
groups are cache slots on the fast tier, or experts of a host tensor), weighted by
`weights[n, j]` and summed over j in slot order exactly as transformers' `grouped_mm` experts
implementation does, so that with every expert resident the result matches the stock model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(
    torch, "_grouped_mm", None
)
# (device type, dtype) -> whether grouped_mm ran there; decided on first use
_GROUPED_OK: dict[tuple[str, torch.dtype], bool] = {}


def _mm_gather(x: torch.Tensor, w: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Fallback: x [S, K] @ w[group] [S, K, N] -> [S, N] by a gathered batched matmul."""
    return torch.bmm(x.unsqueeze(1), w.index_select(0, group)).squeeze(1)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, group: torch.Tensor):
    """x [S, K] rows sorted by group, w [G, K, N], offs int32 [G] cumulative row counts, group
    [S] the group of each row -> [S, N]. Uses torch's grouped_mm kernel where it runs."""
    key = (w.device.type, w.dtype)
    if _GROUPED_MM is not None and _GROUPED_OK.get(key, True):
        try:
            out = _GROUPED_MM(x, w, offs=offs)
            _GROUPED_OK[key] = True
            return out
        except (RuntimeError, NotImplementedError, TypeError):
            _GROUPED_OK[key] = False
    return _mm_gather(x, w, group)


def grouped_experts(
    hidden: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """hidden [N, H], ids [N, k] (group index, -1 = skip), weights [N, k] -> [N, H].

    gate_up [G, 2I, H] (gate half first), down [G, H, I]; all on the same device.
    """
    N, k = ids.shape
    H = hidden.shape[-1]
    G = gate_up.shape[0]
    flat = ids.reshape(-1)  # (S,) S = N*k
    rows = (flat >= 0).nonzero().squeeze(1)  # (S',) computed rows
    out = torch.zeros(N * k, H, dtype=hidden.dtype, device=hidden.device)
    if rows.numel() == 0:
        return out.view(N, k, H).sum(dim=1)
    group, order = torch.sort(flat.index_select(0, rows))
    rows = rows.index_select(0, order)  # (S',) sorted by group
    x = hidden.index_select(0, rows // k).to(gate_up.dtype)  # (S', H)
    counts = torch.bincount(group, minlength=G)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # (G,)
    h = grouped_mm(x, gate_up.transpose(1, 2), offs, group)  # (S', 2I)
    g, u = h.chunk(2, dim=-1)
    y = grouped_mm(act(g) * u, down.transpose(1, 2), offs, group)  # (S', H)
    y = y * weights.reshape(-1).index_select(0, rows).to(y.dtype).unsqueeze(-1)
    out.index_copy_(0, rows, y.to(out.dtype))
    return out.view(N, k, H).sum(dim=1)
