"""Done-when figure (issue 13 item 1): prefetch reduces fetch_every_miss's time blocked on
synchronous fetches on the disk tier. Real Qwen3-Next expert shapes (H=2048, I=512, bf16, 6 MiB
per expert), E experts x L layers in an O_DIRECT expert store, synthetic routing (top-10, C =
25%), lookahead logits = the router logits + Gaussian noise (a lookahead that foresees most, not
all, of the top-k). Drives OffloadEngine in the model's call order (layer l+1's prefetch issued
before layer l's step), interleaving the policies round by round.

    .venv/bin/python scripts/engine_prefetch_figure.py --experts 128 --layers 2 --tokens 40 \
        --warmup 8 --rounds 2 --prefetch 0 4 10     # ~20 s after a one-off 1.5 GiB store write

Prints JSON: per prefetch n, median wall time per token, mean time blocked on synchronous
fetches and on late prefetches, fetches and MiB moved per token, share of prefetch copies that
landed before their layer's step."""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from moesub.engine.runtime import OffloadEngine
from moesub.engine.store import ExpertStore, StoreLayout, random_experts, write_store
from moesub.engine.tiers import DiskTier
from moesub.policy import Policy, capacity_for
from moesub.synthetic import synthetic_logits

ap = argparse.ArgumentParser()
ap.add_argument("--store", default="/tmp/moesub-prefetch-figure/experts.bin")
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--experts", type=int, default=128)
ap.add_argument("--tokens", type=int, default=40)
ap.add_argument("--warmup", type=int, default=8)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--noise", type=float, default=0.5)
ap.add_argument("--prefetch", type=int, nargs="+", default=[0, 4, 10])
ap.add_argument("--admission", default="completion")
a = ap.parse_args()

torch.set_num_threads(1)
lay = StoreLayout(a.layers, a.experts, 2048, 512, "bfloat16", fingerprint=f"h12-{a.experts}")
path = Path(a.store)
path.parent.mkdir(parents=True, exist_ok=True)
if not path.exists():
    write_store(path, lay, random_experts(lay, 0), progress=False)
store = ExpertStore(path, expected=lay)
K, E, L = 10, a.experts, a.layers
C = capacity_for(0.25, E)
if C < K:
    ap.error(f"--experts {E}: a 25% cache holds {C} experts, fewer than top-{K} (give >= 40)")
T = a.warmup + a.tokens
z = synthetic_logits(T, L, E, seed=1)
rng = np.random.default_rng(2)
y = (z + a.noise * z.std() * rng.standard_normal(z.shape)).astype(np.float32)
top = np.argsort(-z, axis=-1, kind="stable")[..., :K]
act = torch.nn.functional.silu
hidden = torch.randn(T, 1, lay.hidden).to(torch.bfloat16)
rows = {n: [] for n in a.prefetch}
for _round in range(a.rounds):
    for n in a.prefetch:
        pol = Policy(rule="fetch_all", prefetch=n)
        tier = DiskTier(store, C, K, act, staging_buffers=4 + 2 * n)
        eng = OffloadEngine(tier, E, K, C, pol, None, act, admission=a.admission)
        try:
            for t in range(T):
                t0 = time.perf_counter()
                eng.begin_token()
                if n:
                    eng.prefetch(0, y[t, 0][None])
                for layer in range(L):
                    if n and layer + 1 < L:
                        eng.prefetch(layer + 1, y[t, layer + 1][None])
                    s = eng.route(layer, z[t, layer][None])
                    slot, _ = eng.step_ids(s)
                    w = torch.from_numpy(s.weights).to(torch.bfloat16)
                    eng.compute(layer, hidden[t], slot, w)
                st = eng.end_token()
                if t >= a.warmup:
                    rows[n].append(
                        (
                            time.perf_counter() - t0,
                            st.fetch_wait_s,
                            st.prefetch_wait_s,
                            st.bytes_sync,
                            st.bytes_prefetch,
                            st.prefetches,
                            st.prefetch_in_time,
                            int(st.counts[1]),
                        )
                    )
        finally:
            eng.close()
out = {}
for n, r in rows.items():
    r = np.array(r)
    out[f"prefetch={n}"] = {
        "tokens": len(r),
        "wall_median_ms": 1e3 * float(np.median(r[:, 0])),
        "fetch_wait_mean_ms": 1e3 * float(r[:, 1].mean()),
        "prefetch_wait_mean_ms": 1e3 * float(r[:, 2].mean()),
        "sync_fetches_per_token": float(r[:, 7].mean()),
        "MiB_sync_per_token": float(r[:, 3].mean()) / 2**20,
        "MiB_prefetch_per_token": float(r[:, 4].mean()) / 2**20,
        "prefetch_timeliness": float(r[:, 6].sum() / r[:, 5].sum()) if r[:, 5].sum() else None,
    }
json.dump({"args": vars(a), "C": C, "store_mode": store.mode, "results": out}, sys.stdout, indent=1)
print()
