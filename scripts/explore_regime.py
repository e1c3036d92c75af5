"""Explore the embedded model's cache regime: train a recipe variant, then measure its regime.

Each variant is the `embedded:` section of a config file (default config.yaml) with KEY=VALUE
overrides; its model, streams, captures and regime table go to OUT/NAME (never results/):

    .venv/bin/python scripts/explore_regime.py train OUT NAME balance_pooling=global \
        router_aux_loss_coef=0.01 threads=2
    .venv/bin/python scripts/explore_regime.py evaluate OUT/NAME/model OUT/NAME
    .venv/bin/python scripts/explore_regime.py table OUT

`evaluate` works on any embedded checkpoint (e.g. the pipeline's results/embedded/model) and
uses the config's `streams:` section unless `--eval-streams N --stream-len T` override it.
`table` prints one Markdown row per evaluated variant (docs/model-regime.md); `steptime` times
the training step of trained models taking turns (a training time measured for the first scales
to the others by the ratio, whatever the load).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import yaml


def _value(text: str):
    return yaml.safe_load(text)


def train(args: argparse.Namespace) -> None:
    from moesub.embedded import build_model

    config = yaml.safe_load(Path(args.config).read_text())
    params = dict(config["embedded"])
    for item in args.overrides:
        key, _, value = item.partition("=")
        params[key] = _value(value)
    out = Path(args.out) / args.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "params.json").write_text(json.dumps(params, indent=1, sort_keys=True))
    t0 = time.perf_counter()
    build_model(out / "model", params)
    print(f"{args.name}: built in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def resplit_view(model_dir: Path, out: Path, eval_fraction: float) -> Path:
    """A view of `model_dir` (symlinks) whose corpus_files.parquet re-splits the documents with
    `eval_fraction`: streams of a model trained on a smaller eval split. Its eval documents
    (hash < eval_fraction) were never trained on when eval_fraction <= the model's eval + calib
    fractions; its calib documents may have been (they only pick the initial resident sets)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moesub.corpus import split_of

    config = json.loads((model_dir / "train_summary.json").read_text())["config"]
    if eval_fraction > config["eval_fraction"] + config["calib_fraction"]:
        raise ValueError(f"--resplit {eval_fraction}: would evaluate on the model's training split")
    view = out / "model_view"
    view.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.name != "corpus_files.parquet" and not (view / item.name).exists():
            (view / item.name).symlink_to(item.resolve())
    table = pq.read_table(model_dir / "corpus_files.parquet")
    paths = table["path"].to_pylist()
    split = [split_of(p, config["calib_fraction"], eval_fraction) for p in paths]
    table = table.set_column(table.schema.get_field_index("split"), "split", pa.array(split))
    pq.write_table(table, view / "corpus_files.parquet")
    return view


def evaluate(args: argparse.Namespace) -> None:
    import torch

    from moesub.capture import run_capture, run_expert_ranking
    from moesub.io import write_json, write_parquet
    from moesub.regime import regime_from_files
    from moesub.streams import build_streams

    torch.set_num_threads(args.threads)
    config = yaml.safe_load(Path(args.config).read_text())
    streams = {k: v for k, v in config["streams"].items() if k != "source"}
    if args.eval_streams is not None:
        streams["eval"] = {"n_streams": args.eval_streams, "stream_len": args.stream_len}
    if args.doc_tokens_max is not None:
        streams["doc_tokens_max"] = args.doc_tokens_max
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.resplit is not None:
        args.model_dir = resplit_view(Path(args.model_dir), out, args.resplit)
    s_eval, s_calib = out / "streams_eval.parquet", out / "streams_calib.parquet"
    build_streams(args.model_dir, config["streams"]["source"], streams, s_eval, s_calib)
    for split, path in (("eval", s_eval), ("calib", s_calib)):
        run_capture(
            args.model_dir, path, out / f"{split}_tokens.parquet", out / f"{split}_router.parquet"
        )
    run_expert_ranking(out / "calib_router.parquet", out / "expert_ranking.parquet")
    regime = regime_from_files(
        out / "eval_router.parquet",
        out / "expert_ranking.parquet",
        args.fraction,
    )
    summary = regime.summary
    summary["model_dir"] = str(args.model_dir)
    summary["streams"] = streams
    summary["resplit"] = args.resplit
    train_summary = Path(args.model_dir) / "train_summary.json"
    if train_summary.is_file():
        ts = json.loads(train_summary.read_text())
        summary["heldout_perplexity"] = ts["heldout_perplexity"]
        summary["train_time_s"] = ts["train_time_s"]
        summary["steps"] = ts["steps"]
    write_parquet(regime.layers, out / "regime.parquet")
    write_json(summary, out / "regime.json")
    print(json.dumps(summary, indent=1))


def _heldout_ids(model_dir: Path, eval_fraction: float):
    """The model's config and the token ids of the documents held out at `eval_fraction`."""
    from transformers import AutoTokenizer

    from moesub.corpus import collect_corpus, encode_documents, split_of
    from moesub.embedded.config import EmbeddedConfig

    config = json.loads((model_dir / "train_summary.json").read_text())["config"]
    if eval_fraction > config["eval_fraction"] + config["calib_fraction"]:
        raise ValueError(f"eval fraction {eval_fraction}: overlaps {model_dir}'s training split")
    docs, texts = collect_corpus(EmbeddedConfig.from_params(config))
    calib = config["calib_fraction"]
    eval_texts = [
        t for d, t in zip(docs, texts, strict=True)
        if split_of(d.path, calib, eval_fraction) == "eval"
    ]  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = encode_documents(tokenizer, eval_texts, "tokenizing eval", tokenizer.eos_token_id)
    return config, ids


def perplexity(args: argparse.Namespace) -> None:
    """Held-out perplexity on the documents of a given eval fraction (the embedded model's own
    measure, `moesub.embedded.heldout_perplexity`), so that models trained with different
    eval splits are compared on the same documents."""
    import torch
    from transformers import AutoModelForCausalLM

    from moesub.embedded.training import heldout_perplexity

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir)
    config, ids = _heldout_ids(model_dir, args.eval_fraction)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ppl = heldout_perplexity(model, ids, config["seq_len"], config["eval_tokens"])
    out = {"model_dir": str(model_dir), "eval_fraction": args.eval_fraction, **ppl}
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


def steptime(args: argparse.Namespace) -> None:
    """Seconds per training step of each trained model (its own recipe, `train` continued from
    its checkpoint on held-out tokens), the models taking turns for `--rounds` rounds so that
    load from other processes falls on all of them alike: the ratio to the first model scales
    a training time measured for it (e.g. the default run's) to the others."""
    import statistics

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from moesub.embedded.config import EmbeddedConfig
    from moesub.embedded.training import _deterministic, train

    torch.set_num_threads(args.threads)
    runs = []
    for model_dir in map(Path, args.model_dirs):
        config, ids = _heldout_ids(model_dir, args.eval_fraction)
        cfg = EmbeddedConfig.from_params(config)
        # a token budget of `--steps` steps, no wall-clock budget
        budget = args.steps * cfg.tokens_per_step
        cfg = dataclasses.replace(cfg, max_tokens=budget, train_seconds=None)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        runs.append((model_dir, cfg, model, np.asarray(ids, dtype=np.int32), []))
    for _ in range(args.rounds):
        for _, cfg, model, ids, times in runs:
            with _deterministic(cfg.deterministic):
                log, _ = train(model, ids, cfg)
            # per-step times, without each call's first step (optimizer state allocation)
            times.extend(np.diff(log["elapsed_s"]).tolist())
    # the median, and the fastest step (the least disturbed by other processes' bursts)
    base, base_min = statistics.median(runs[0][4]), min(runs[0][4])
    result = []
    for model_dir, _, _, _, times in runs:
        med, fastest = statistics.median(times), min(times)
        result.append(
            {
                "model_dir": str(model_dir),
                "s_per_step": med,
                "ratio": med / base,
                "fastest_s_per_step": fastest,
                "fastest_ratio": fastest / base_min,
            }
        )
        print(
            f"{model_dir}: {med:.3f} s/step (median of {len(times)}), x{med / base:.3f}; "
            f"fastest {fastest:.3f} s, x{fastest / base_min:.3f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


def table(args: argparse.Namespace) -> None:
    """One Markdown row per evaluated variant: regime.json (+ ppl005.json from `perplexity`)."""
    rows = []
    for path in sorted(Path(args.out).glob("*/regime.json")):
        s = json.loads(path.read_text())
        layers = s["layers"]
        ppl_path = path.parent / "ppl005.json"
        ppl = json.loads(ppl_path.read_text())["perplexity"] if ppl_path.is_file() else None
        rows.append(
            "| {name} | {hit:.3f} | {per} | {bel:.3f} | {eff} | {r015:.3f} | {ppl} | {t} |".format(
                name=path.parent.name,
                hit=s["hit_rate"],
                per="/".join(f"{x['hit_rate']:.2f}" for x in layers),
                bel=s["belady_hit_rate"],
                eff="/".join(f"{x['effective_experts']:.0f}" for x in layers),
                r015=s["rule015_sub_rate"],
                ppl="-" if ppl is None else f"{ppl:.1f}",
                t=f"{s['train_time_s']:.0f} s / {s['steps']}" if "train_time_s" in s else "-",
            )
        )
    print(
        "| setting | hit rate | per layer | Belady | effective experts per layer "
        "| rule_015 sub rate | held-out ppl | training time / steps |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="config.yaml")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train")
    p.add_argument("out")
    p.add_argument("name")
    p.add_argument("overrides", nargs="*", help="embedded KEY=VALUE (YAML values)")
    p.set_defaults(run=train)
    p = sub.add_parser("evaluate")
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--eval-streams", type=int, default=None)
    p.add_argument("--stream-len", type=int, default=384)
    p.add_argument("--doc-tokens-max", type=int, default=None)
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--resplit", type=float, default=None, help="evaluate on this eval fraction")
    p.set_defaults(run=evaluate)
    p = sub.add_parser("perplexity")
    p.add_argument("model_dir")
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    p.set_defaults(run=perplexity)
    p = sub.add_parser("steptime")
    p.add_argument("model_dirs", nargs="+", help="trained models; ratios are to the first")
    p.add_argument("--steps", type=int, default=20, help="steps per model and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--eval-fraction", type=float, default=0.05, help="tokens it trains on")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    p.set_defaults(run=steptime)
    p = sub.add_parser("table")
    p.add_argument("out")
    p.set_defaults(run=table)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
