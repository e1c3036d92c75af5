"""The simulator against the engine on user checkpoints: three small random Hugging Face MoE
checkpoints (Qwen3-Next, Qwen3-MoE, OLMoE families), run through the pipeline as a user's
`models: {name: {path: DIR}}` would be, and every engine run's own counts priced on the profile
the engine calibrated on that model (`results/{model}/priced/this_machine.parquet`, source
engine), against the run's measured mean time per token.

    python benchmarks/sim_vs_engine_checkpoints.py --out /tmp/ckpts        # checkpoints + config
    snakemake --cores 2 --configfile /tmp/ckpts/config.yaml -- \\
        results/{embedded,ckpt_qwen3_next,ckpt_qwen3_moe,ckpt_olmoe}/priced/this_machine.parquet
    python benchmarks/sim_vs_engine_checkpoints.py --out /tmp/ckpts --summarize

The checkpoints take the embedded model's tokenizer and corpus split (`--tokenizer`,
results/embedded/model by default: run the default pipeline's model first), so their streams
are the embedded model's held-out files; the config is config.yaml with the three
added to its `models:` and no byte budgets (they buy more slots than 256 experts), so streams,
fractions, engine policies and calibration are the shipped ones.
Random routers route nearly uniformly, so the miss rates are higher than a trained model's:
what is measured is the pricing, not the regime.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import polars as pl
import torch
import transformers as tf
import yaml

# family -> config keyword arguments (4 MoE layers, 256 experts, top-8, hidden 128, width 64;
# 256 experts: at 25% the shipped prefetch policies (up to 40) fit in C = 64 slots)
COMMON = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=256, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=64,
    bos_token_id=0, eos_token_id=1, pad_token_id=2,
)  # fmt: skip
FAMILIES = {
    "qwen3_next": lambda v: tf.Qwen3NextConfig(
        vocab_size=v,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        shared_expert_intermediate_size=64,
        norm_topk_prob=True,
        **COMMON,
    ),
    "qwen3_moe": lambda v: tf.Qwen3MoeConfig(
        vocab_size=v, head_dim=32, norm_topk_prob=True, **COMMON
    ),
    "olmoe": lambda v: tf.OlmoeConfig(vocab_size=v, norm_topk_prob=False, **COMMON),
}


def write_checkpoints(out: Path, tokenizer_dir: Path, config_path: Path, seed: int) -> Path:
    """The three checkpoints under `out/<family>` and `out/config.yaml`; returns the config."""
    tok = tf.AutoTokenizer.from_pretrained(tokenizer_dir)
    models = {}
    for family, make in FAMILIES.items():
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(make(len(tok))).eval()
        path = out / family
        model.save_pretrained(path)
        tok.save_pretrained(path)
        shutil.copy(tokenizer_dir / "corpus_files.parquet", path)  # streams of kind embedded
        models[f"ckpt_{family}"] = {"path": str(path.resolve())}
    config = yaml.safe_load(config_path.read_text())
    config["models"].update(models)
    config["budgets"] = []  # GiB budgets buy more slots than these models have experts
    target = out / "config.yaml"
    target.write_text(yaml.safe_dump(config, sort_keys=False))
    return target


def summarize(config: Path, results: Path) -> pl.DataFrame:
    """Per model and engine run: priced vs measured time per token (`rel_error`); models without
    engine runs priced (a trace-only model) are left out."""
    models = yaml.safe_load(config.read_text())["models"]
    frames = []
    for name in models:
        path = results / name / "priced" / "this_machine.parquet"
        if not path.exists():
            continue
        priced = pl.read_parquet(path)
        frames.append(
            priced.filter(pl.col("source") == "engine").select(
                pl.lit(name).alias("model"),
                "policy",
                "fraction",
                (pl.col("time_per_token_s") * 1e3).alias("priced_ms"),
                (pl.col("measured_time_per_token_s") * 1e3).alias("measured_ms"),
                (pl.col("time_per_token_s") / pl.col("measured_time_per_token_s") - 1).alias(
                    "rel_error"
                ),
                "cpu_share",
            )  # fmt: skip
        )
    return pl.concat(frames)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, default=Path("results/embedded/model"))
    ap.add_argument("--config", type=Path, default=Path("config.yaml"))
    ap.add_argument("--results", type=Path, default=Path("results"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--summarize", action="store_true", help="read the priced runs back")
    a = ap.parse_args()
    if a.summarize:
        table = summarize(a.out / "config.yaml", a.results)
        with pl.Config(tbl_rows=-1, float_precision=3):
            print(table)
        err = table["rel_error"].abs()
        print(f"median |error| {err.median():.1%}, max {err.max():.1%}, "
              f"within 10%: {(err <= 0.10).sum()} of {len(err)}")  # fmt: skip
        return
    if a.out.exists():
        shutil.rmtree(a.out)
    a.out.mkdir(parents=True)
    print(write_checkpoints(a.out, a.tokenizer, a.config, a.seed))


if __name__ == "__main__":
    main()
