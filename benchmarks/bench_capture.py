"""Capture overhead vs a plain forward pass over the same streams (target: ratio <= 1.15).

Model: Qwen3-Next-shaped at the reference routing geometry (E=512, top-10, renormalized,
shared expert), hidden 128, expert width 16, 4 layers (3 linear + 1 full attention), random
weights. Both sides load the checkpoint with `moesub.models.load_model` and run one forward
per batch of streams as `run_capture` batches them (`use_cache=False`); the capture side
additionally computes the NLL, records every router's logits and lookahead logits (each layer's
norm and router applied once more, to the previous MoE layer's residual stream) and writes both
Parquet tables. Reported: the ratio measured batch by batch back to back on one loaded model,
with its stages (forward + NLL, + the lookahead's RouterHook, + recording and writing =
`capture_batch`), and the end-to-end ratio (best of `--repeats`, alternating; model loading
weighs in it: 0.81-1.27 over the runs of 2026-12-01). On this shape (hidden 128, E=512,
expert width 16) a router costs as much as the k routed experts, so the lookahead's second
router matmul per layer and the table's second logit column weigh far more than on a real
checkpoint (hidden 2048: the router is ~3% of a layer).

Measured on the 2-core machine, 2026-12-01 (CPU time, one thread, 4 x 512 tokens in one
forward, `--repeats 15`, three runs): capture_batch / forward 1.137, 1.123, 1.138 (single
repeats 1.05-1.33); stages forward + NLL 0.97-1.00, + lookahead 1.00-1.10; the capture loop
with its background writer 1.12-1.15. Before, 1.185 the same morning and 1.16-1.30 under load:
`stream_nll` took the NLL's log-softmax from the [B, T, V] logits of `model(ids)` (+5-8%); it
now runs the output head on 64-row chunks that stay in cache, cheaper than the plain forward's
own head (forward + NLL < 1). What remains is recording: the lookahead's four [2048, 128] x
[128, 512] router matmuls (~84 GFLOP/s, one core's float32 peak), stacking the layers' logits
into (stream, pos, layer) rows (~2.5 ms) and writing the two 16 MiB logit columns: ~4.5 ms of
Parquet encoding (to /dev/null) and ~7 ms of page cache for a new file (a raw write of the same
bytes; these three timed apart from this script, on the same tables; page size, write batch
size, v2 pages, PLAIN encoding each move it by < 1 ms, lz4 costs +1 ms and saves nothing on
float32 logits). The finiteness check sums each layer's logits
while they are in cache. On this shape that is 16 KiB of logits per token for a forward of a
hidden-128 model; on a wider shape (hidden 512, E=128, k=8, width 256) the capture was 1.04.
Wall clock swings with the page cache on this VM (`--clock wall --threads 1 --streams 16
--repeats 5`, three runs): per batch 1.09, 1.36, 1.21; the loop 1.13, 1.26, 1.25.
By default time is this process's CPU time with one torch thread,
which stays meaningful on a machine shared with other jobs; `--clock wall --threads 2` gives
elapsed time on an idle machine.

    PYTHONPATH=src python benchmarks/bench_capture.py [--streams 4 --length 512 --repeats 3]
        [--clock cpu|wall --threads 1] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
import transformers as tf

from moesub.artefacts import load_trace, router_writer
from moesub.capture import BackgroundWriter, CaptureParams, capture_batch, run_capture
from moesub.io import write_parquet
from moesub.models import (
    MoEInfo,
    RouterHook,
    load_model,
    moe_blocks,
    moe_info,
    stream_batches,
    stream_nll,
)

_clock = time.perf_counter  # set by --clock


def build_model(path: Path, vocab: int, seed: int = 0) -> None:
    torch.manual_seed(seed)
    cfg = tf.Qwen3NextConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=16,
        shared_expert_intermediate_size=64, norm_topk_prob=True, bos_token_id=0,
        eos_token_id=1, pad_token_id=2,
    )  # fmt: skip
    model = tf.AutoModelForCausalLM.from_config(cfg)
    for b in moe_blocks(model):
        torch.nn.init.normal_(b.gate.weight, std=0.1)  # non-trivial routing
    model.save_pretrained(path)


def build_streams(path: Path, n: int, length: int, vocab: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    T = n * length
    write_parquet(
        {
            "stream": np.repeat(np.arange(n, dtype=np.int32), length),
            "pos": np.tile(np.arange(length, dtype=np.int32), n),
            "token_id": rng.integers(3, vocab, T).astype(np.int32),
            "doc_id": np.repeat(np.arange(n, dtype=np.int32), length),
            "doc_start": np.tile(np.arange(length) == 0, n),
        },
        path,
    )


def batches(streams: Path) -> list[np.ndarray]:
    """(B, T) token ids of each forward, batched as run_capture batches them."""
    t = pq.read_table(streams).to_pydict()
    ids = np.asarray(t["token_id"], dtype=np.int64)
    stream = np.asarray(t["stream"])
    per = [ids[stream == s] for s in np.unique(stream)]
    groups = stream_batches([len(x) for x in per], CaptureParams().batch_tokens)
    return [np.stack([per[i] for i in g]) for g in groups]


def plain(model_dir: Path, streams: Path) -> float:
    """End to end: load the checkpoint, one plain forward per batch of streams."""
    t0 = _clock()
    model, _ = load_model(model_dir)
    with torch.inference_mode():
        for x in batches(streams):
            model(input_ids=torch.from_numpy(x), use_cache=False)
    return _clock() - t0


def capture(model_dir: Path, streams: Path, out: Path) -> float:
    """End to end: `run_capture` (load, forward + NLL + router recording, both tables)."""
    t0 = _clock()
    run_capture(model_dir, streams, out / "tok.parquet", out / "router.parquet", {})
    return _clock() - t0


def _rows_per_group(info: MoEInfo) -> int:
    """Positions per row group, as `run_capture` sizes them at its default 64 MiB."""
    return int(64 * 2**20 // (2 * 4 * info.num_experts * info.num_layers))


def interleaved(model_dir: Path, streams: Path, out: Path, repeats: int) -> dict[str, list[float]]:
    """Per repeat and stage: time summed over batches / the plain forward's, every stage run
    back to back with the plain forward on one loaded model (robust to load from other
    processes). Each stage adds one cost to the one before: `nll` the NLL (`stream_nll`),
    `lookahead` a RouterHook computing the lookahead logits (norm + router once more per
    layer), `capture` recording both logit arrays and writing the table (`capture_batch`)."""
    model, _ = load_model(model_dir)
    info = moe_info(model)
    rows_per_group = _rows_per_group(info)
    meta = {"num_experts": info.num_experts}

    def forward(x: np.ndarray) -> None:
        with torch.inference_mode():
            model(input_ids=torch.from_numpy(x), use_cache=False)

    def lookahead(x: np.ndarray) -> None:
        with RouterHook(model, lambda *route: None, lookahead=True):
            stream_nll(model, torch.from_numpy(x))

    ratios: dict[str, list[float]] = {"nll": [], "lookahead": [], "capture": []}
    for _ in range(repeats):
        spent = dict.fromkeys(["plain", *ratios], 0.0)
        with router_writer(out / "r.parquet", info.num_experts, meta) as writer:
            stages = {
                "plain": forward,
                "nll": lambda x: stream_nll(model, torch.from_numpy(x)),
                "lookahead": lookahead,
                "capture": lambda x: capture_batch(
                    model, writer, list(range(len(x))), x, rows_per_group
                ),
            }
            for x in batches(streams):
                for name, stage in stages.items():
                    t0 = _clock()
                    stage(x)
                    spent[name] += _clock() - t0
        for name, r in ratios.items():
            r.append(spent[name] / spent["plain"])
    return ratios


def pipelined(model_dir: Path, streams: Path, out: Path, repeats: int) -> list[float]:
    """Per repeat: the capture loop as `run_capture` runs it (every batch through
    `capture_batch`, each table written by a `BackgroundWriter` while the next batch computes,
    the writer closed at the end) over the plain forwards of the same batches, each timed whole
    on one loaded model. With the CPU clock the writer thread's time counts; with the wall
    clock on an idle machine its writes overlap the next forward, as they do in a capture (the
    last batch's write does not: use several batches, e.g. `--streams 16`)."""
    model, _ = load_model(model_dir)
    info = moe_info(model)
    rows_per_group = _rows_per_group(info)
    xs = batches(streams)
    ratios = []
    for _ in range(repeats):
        t0 = _clock()
        with torch.inference_mode():
            for x in xs:
                model(input_ids=torch.from_numpy(x), use_cache=False)
        t1 = _clock()
        meta = {"num_experts": info.num_experts}
        with (
            router_writer(out / "p.parquet", info.num_experts, meta) as file_writer,
            BackgroundWriter(file_writer) as writer,
        ):
            for x in xs:
                capture_batch(model, writer, list(range(len(x))), x, rows_per_group)
        ratios.append((_clock() - t1) / (t1 - t0))
    return ratios


def profile_capture(model_dir: Path, streams: Path, out: Path) -> None:
    """cProfile of `capture_batch` over every batch, on the script's clock: the calls that take
    the most time of their own (the router matmuls of forward and lookahead, the log-softmax,
    the Parquet writes, the stack of the recorded logits)."""
    model, _ = load_model(model_dir)
    info = moe_info(model)
    meta = {"num_experts": info.num_experts}
    profile = cProfile.Profile(_clock)
    with router_writer(out / "p.parquet", info.num_experts, meta) as writer:
        for x in batches(streams):
            ids = list(range(len(x)))
            profile.runcall(capture_batch, model, writer, ids, x, _rows_per_group(info))
    pstats.Stats(profile).sort_stats("tottime").print_stats(15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: no OpenMP spin)")
    ap.add_argument(
        "--clock", choices=["cpu", "wall"], default="cpu",
        help="cpu: process CPU time (robust on a shared machine); wall: elapsed time",
    )  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of capture_batch")
    args = ap.parse_args()
    global _clock
    _clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    print(f"clock {args.clock}, torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        build_model(d / "model", args.vocab)
        build_streams(d / "streams.parquet", args.streams, args.length, args.vocab)
        plain(d / "model", d / "streams.parquet")  # warm-up (first forward is slow)
        ratios = interleaved(d / "model", d / "streams.parquet", d, args.repeats)
        loop = pipelined(d / "model", d / "streams.parquet", d, args.repeats)
        n_batches = len(batches(d / "streams.parquet"))
        tp, tc = [], []
        for _ in range(args.repeats):
            tp.append(plain(d / "model", d / "streams.parquet"))
            tc.append(capture(d / "model", d / "streams.parquet", d))
        if args.profile:
            profile_capture(d / "model", d / "streams.parquet", d)
        mb = (d / "router.parquet").stat().st_size / 2**20
        t0 = time.perf_counter()
        trace = load_trace(d / "router.parquet", lookahead=True)
        t_load = time.perf_counter() - t0
    tokens = args.streams * args.length
    print(f"tokens {tokens}, router table {mb:.1f} MiB")
    r = ratios["capture"]
    print(f"per-batch interleaved capture/plain: median {np.median(r):.3f}, all "
          f"{[round(x, 3) for x in r]}  (target <= 1.15)")  # fmt: skip
    print(
        "  stages / plain (medians): forward + NLL {:.3f}, + lookahead {:.3f}, + recording "
        "and writing = capture {:.3f}".format(*(np.median(v) for v in ratios.values()))
    )
    print(f"capture loop (background writer) / plain forwards: median {np.median(loop):.3f}, "
          f"all {[round(x, 3) for x in loop]} ({n_batches} batches)")  # fmt: skip
    print(f"end to end plain   best {min(tp):.3f} s ({tokens / min(tp):.0f} tok/s)")
    print(f"end to end capture best {min(tc):.3f} s ({tokens / min(tc):.0f} tok/s)")
    print(f"end to end capture / plain = {min(tc) / min(tp):.3f}")
    print(f"load_trace: {t_load:.3f} s wall for {trace.num_tokens} tokens ({mb:.1f} MiB)")


if __name__ == "__main__":
    main()
