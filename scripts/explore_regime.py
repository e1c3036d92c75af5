"""Explore the embedded model's cache regime: train a recipe variant, then measure its regime.

Each variant is the `embedded:` section of a config file (default config.yaml) with KEY=VALUE
overrides; its model, streams, captures and regime table go to OUT/NAME (never results/):

    .venv/bin/python scripts/explore_regime.py train OUT NAME balance_pooling=global \
        router_aux_loss_coef=0.01 threads=2
    .venv/bin/python scripts/explore_regime.py evaluate OUT/NAME/model OUT/NAME
    .venv/bin/python scripts/explore_regime.py table OUT

`evaluate` works on any embedded checkpoint (e.g. the pipeline's results/embedded/model) and
uses the config's `streams:` section unless `--eval-streams N --stream-len T` override it.
`table` prints one Markdown row per evaluated variant (docs/model-regime.md).
"""

from __future__ import annotations

import argparse
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


def evaluate(args: argparse.Namespace) -> None:
    import torch

    from moesub.capture import run_capture, write_initial_sets
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
    s_eval, s_calib = out / "streams_eval.parquet", out / "streams_calib.parquet"
    build_streams(args.model_dir, config["streams"]["source"], streams, s_eval, s_calib)
    for split, path in (("eval", s_eval), ("calib", s_calib)):
        run_capture(
            args.model_dir, path, out / f"{split}_tokens.parquet", out / f"{split}_router.parquet"
        )
    write_initial_sets(out / "calib_router.parquet", [args.fraction], out / "initial_sets.parquet")
    regime = regime_from_files(
        out / "eval_router.parquet",
        out / "initial_sets.parquet",
        args.fraction,
    )
    summary = regime.summary
    summary["model_dir"] = str(args.model_dir)
    summary["streams"] = streams
    train_summary = Path(args.model_dir) / "train_summary.json"
    if train_summary.is_file():
        ts = json.loads(train_summary.read_text())
        summary["heldout_perplexity"] = ts["heldout_perplexity"]
        summary["train_time_s"] = ts["train_time_s"]
        summary["steps"] = ts["steps"]
    write_parquet(regime.layers, out / "regime.parquet")
    write_json(summary, out / "regime.json")
    print(json.dumps(summary, indent=1))


def table(args: argparse.Namespace) -> None:
    rows = []
    for path in sorted(Path(args.out).glob("*/regime.json")):
        s = json.loads(path.read_text())
        layers = s["layers"]
        rows.append(
            "| {name} | {hit:.3f} | {per} | {bel:.3f} | {eff} | {ppl} | {t} |".format(
                name=path.parent.name,
                hit=s["hit_rate"],
                per="/".join(f"{x['hit_rate']:.2f}" for x in layers),
                bel=s["belady_hit_rate"],
                eff="/".join(f"{x['effective_experts']:.0f}" for x in layers),
                ppl=f"{s['heldout_perplexity']:.1f}" if "heldout_perplexity" in s else "-",
                t=f"{s['train_time_s']:.0f} s" if "train_time_s" in s else "-",
            )
        )
    print("| setting | hit rate | per layer | Belady | effective experts | ppl | train time |")
    print("|---|---|---|---|---|---|---|")
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
    p.set_defaults(run=evaluate)
    p = sub.add_parser("table")
    p.add_argument("out")
    p.set_defaults(run=table)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
