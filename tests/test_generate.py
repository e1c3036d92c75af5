"""moesub.generate: data loading, prompts, answer extraction, HumanEval in the sandbox, and the
stage entry point on a tiny random Qwen3-MoE model with a tiny byte-level BPE tokenizer."""

from __future__ import annotations

import gzip
import json
import sys
import types
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
import torch
import transformers as tf

from moesub.generate import (
    GSM8K_SHOT_POOL,
    OUTPUT_SCHEMA,
    GenerateParams,
    agreement,
    extract_answer,
    fetch_gsm8k,
    gsm8k_correct,
    gsm8k_gold,
    gsm8k_prompt,
    gsm8k_shots,
    load_gsm8k,
    load_humaneval,
    normalize_number,
    read_gsm8k,
    read_humaneval,
    run_generate,
    truncate_at,
)
from moesub.io import read_metadata, write_parquet
from moesub.models import moe_blocks
from moesub.sandbox import check_humaneval

SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"
E, K, L, C = 16, 4, 2, 6
EXACT = {"rule": "fetch_all", "eviction": "lru"}
HARSH = {"rule": "substitute_all", "eviction": "lru"}


def gsm8k_file(path: Path, n: int = 40) -> Path:
    """A synthetic GSM8K-format file: problem i asks for 3*i + 1 (with calculator notes)."""
    with open(path, "w") as fh:
        for i in range(n):
            q = f"Tom has {i} boxes of 3 apples and 1 more apple. How many apples?"
            a = f"He has {i}*3 = <<{i}*3={3 * i}>>{3 * i} apples in boxes.\n#### {3 * i + 1:,}"
            fh.write(json.dumps({"question": q, "answer": a}) + "\n")
    return path


# --------------------------------------------------------------------------- answers
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 18.", "18"),
        ("She pays $1,234.50 in total", "1234.5"),
        ("It drops to -5 degrees", "-5"),
        ("16-3-4=9", "9"),
        ("so 5-3", "3"),
        ("x = 3.0", "3"),
        ("1,000,000 people", "1000000"),
        ("0.25 of it", "0.25"),
        ("costs -$7.", "-7"),
        ("first 12, then 7 and finally 42", "42"),
        ("no digits here", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_gold_and_exact_match():
    assert gsm8k_gold("blah <<2*3=6>>6\n#### 1,200") == "1200"
    assert gsm8k_gold("no final line 7") is None
    assert normalize_number("$1,200.00") == "1200" and normalize_number("abc") is None
    assert gsm8k_correct("so the total is $1,200.", "1200")
    assert not gsm8k_correct("so the total is 1201", "1200")
    assert not gsm8k_correct("I do not know", "1200")


def test_truncate_and_agreement():
    assert truncate_at("a\n\nQuestion: b", ("\n\n", "Question:")) == "a"
    assert truncate_at("    return 1\ndef g():", ("\ndef",)) == "    return 1"
    assert truncate_at("abc", ("x",)) == "abc"
    assert agreement([1, 2, 3], [1, 2, 3]) == (True, 1.0)
    assert agreement([1, 2, 9, 9], [1, 2, 3, 4]) == (False, 0.5)
    assert agreement([1, 2], [1, 2, 3, 4]) == (False, 0.5)  # a prefix is not agreement
    assert agreement([7], [1]) == (False, 0.0)
    assert agreement([], []) == (True, 1.0)


# --------------------------------------------------------------------------- GSM8K data
def test_load_gsm8k_subsample_and_shots(tmp_path):
    path = gsm8k_file(tmp_path / "g.jsonl", 40)
    problems = read_gsm8k(path)
    assert len(problems) == 40 and problems[5].answer == "16"
    a = load_gsm8k(path, 5, seed=0)
    assert [p.problem_id for p in a] == [p.problem_id for p in load_gsm8k(path, 5, seed=0)]
    assert [p.problem_id for p in a] != [p.problem_id for p in load_gsm8k(path, 5, seed=1)]
    ids = [int(p.problem_id.split("/")[1]) for p in a]
    assert ids == sorted(ids)
    shots = gsm8k_shots(path, 3)
    pool = {p.problem_id for p in gsm8k_shots(path, 10)}  # 40 // 4 = 10 shot examples
    assert len(pool) == 10
    for seed in range(5):  # never an evaluation problem, whatever the seed
        assert not pool & {p.problem_id for p in load_gsm8k(path, 30, seed)}
    with pytest.raises(ValueError, match="n=31 exceeds"):
        load_gsm8k(path, 31, 0)
    with pytest.raises(ValueError, match="shots=11"):
        gsm8k_shots(path, 11)

    prompt = gsm8k_prompt(a[0].question, shots)
    assert prompt.count("Question:") == 4 and prompt.endswith(f"{a[0].question}\nAnswer:")
    assert "<<" not in prompt and prompt.count("The answer is") == 3
    assert f"The answer is {shots[0].answer:}." in prompt or "The answer is" in prompt
    assert gsm8k_prompt("Q?") == "Question: Q?\nAnswer:"


def test_gsm8k_errors(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl") as info:
        read_gsm8k(missing)
    assert "fetch_gsm8k" in str(info.value) and "generate.tasks.gsm8k.path" in str(info.value)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "a\\n#### 3"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2"):
        read_gsm8k(bad)
    bad.write_text('{"question": "q", "answer": "no number line"}\n')
    with pytest.raises(ValueError, match="####"):
        read_gsm8k(bad)


@pytest.mark.skipif(not SHARED_GSM8K.is_file(), reason=f"{SHARED_GSM8K} not present")
def test_real_gsm8k_file():
    problems = read_gsm8k(SHARED_GSM8K)
    assert len(problems) == 1319
    assert problems[0].answer == "18"
    assert all(p.answer == extract_answer(p.answer) for p in problems)
    # every gold solution, rewritten as a few-shot answer, scores as correct
    assert all(
        gsm8k_correct(gsm8k_prompt("x", [p]).split("Answer: ", 1)[1], p.answer)
        for p in problems[:200]
    )
    sample = load_gsm8k(SHARED_GSM8K, 10, seed=0)
    assert len({p.problem_id for p in sample}) == 10
    shots = gsm8k_shots(SHARED_GSM8K, 8)
    assert len(shots) == 8 and len(gsm8k_shots(SHARED_GSM8K, GSM8K_SHOT_POOL)) == 64


def test_fetch_gsm8k_writes_jsonl(tmp_path, monkeypatch):
    rows = [{"question": "1+1?", "answer": "1+1=2\n#### 2", "extra": 0}]
    fake = types.ModuleType("datasets")
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return rows

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    out = fetch_gsm8k(tmp_path / "d" / "test.jsonl")
    assert calls == [("openai/gsm8k", "main", "test")]
    assert read_gsm8k(out)[0].answer == "2"
    assert json.loads(out.read_text()) == {"question": "1+1?", "answer": "1+1=2\n#### 2"}


# --------------------------------------------------------------------------- HumanEval
def test_humaneval_canonical_passes_and_wrong_fails():
    problems = read_humaneval()
    assert len(problems) == 164
    sample = load_humaneval(3, seed=0)
    assert [p["task_id"] for p in sample] == [p["task_id"] for p in load_humaneval(3, seed=0)]
    for p in sample:
        assert check_humaneval(p, p["canonical_solution"]).status == "pass", p["task_id"]
        assert check_humaneval(p, "    return None\n").status == "fail", p["task_id"]
    with pytest.raises(ValueError, match="n=165"):
        load_humaneval(165)


def test_humaneval_file_argument(tmp_path):
    p = read_humaneval()[0]
    path = tmp_path / "he.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write(json.dumps(p) + "\n")
    assert read_humaneval(path) == [p]
    with pytest.raises(FileNotFoundError, match="humaneval.path"):
        read_humaneval(tmp_path / "missing.jsonl")


# --------------------------------------------------------------------------- stage entry point
def tiny_checkpoint(root: Path) -> Path:
    """A random Qwen3-MoE (E=16, k=4, 2 layers) with a 300-token byte-level BPE tokenizer
    (Qwen3-MoE rather than Qwen3-Next: no linear-attention fallback kernels, fast on CPU)."""
    from moesub.embedded import train_tokenizer

    texts = [json.loads(line)["question"] for line in gsm8k_file(root / "corpus.jsonl").open()]
    texts += [p["prompt"] for p in read_humaneval()[:20]]
    tokenizer = train_tokenizer(texts, vocab_size=300)
    torch.manual_seed(0)
    cfg = tf.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=48, num_hidden_layers=L, head_dim=16, num_experts=E,
        num_experts_per_tok=K, moe_intermediate_size=8, norm_topk_prob=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    for block in moe_blocks(model):  # decisive routing: substitution changes the output
        torch.nn.init.normal_(block.gate.weight, std=0.5)
        torch.nn.init.normal_(block.experts.gate_up_proj, std=0.4)
        torch.nn.init.normal_(block.experts.down_proj, std=0.4)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    rng = np.random.default_rng(0)
    rows = [
        (0.375, C, layer, rank, int(e))
        for layer in range(L)
        for rank, e in enumerate(rng.permutation(E)[:C])
    ]
    sets = pl.DataFrame(
        rows, schema=["fraction", "capacity", "layer", "rank", "expert"], orient="row"
    ).cast({"capacity": pl.Int32, "layer": pl.Int16, "rank": pl.Int32, "expert": pl.Int32})
    write_parquet(sets, root / "initial_sets.parquet")
    return root


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    root = tiny_checkpoint(tmp_path_factory.mktemp("generate"))
    gsm8k_file(root / "gsm8k.jsonl", 40)
    return root


def generate(root: Path, task: str, name: str, policy: dict, out: str, **params):
    params = {"n": 3, "max_new_tokens": 10, "progress": False, "shots": 1, **params}
    if task == "humaneval":
        params.pop("shots")
    data = root / "gsm8k.jsonl" if task == "gsm8k" else None
    return run_generate(
        root / "model", task, data, root / "initial_sets.parquet", name, policy, 0.375,
        root / "out" / out, params,
    )  # fmt: skip


@pytest.fixture(scope="module")
def exact_gsm8k(stage):
    return generate(stage, "gsm8k", "fetch_every_miss", EXACT, "g_exact.parquet")


def test_run_generate_gsm8k_schema_and_exact_agreement(stage, exact_gsm8k):
    path = exact_gsm8k
    table = pq.read_table(path)
    assert table.schema.remove_metadata() == OUTPUT_SCHEMA
    df = pl.from_arrow(table)
    assert df.height == 3 and df["task"].unique().to_list() == ["gsm8k"]
    assert df["policy"].unique().to_list() == ["fetch_every_miss"]
    assert df["fraction"].unique().to_list() == [0.375]
    # the exact policy reproduces the exact model's greedy output token for token
    assert df["agree_exact"].all() and (df["agree_prefix_frac"] == 1.0).all()
    assert (df["mass_mean"].drop_nulls() == 0.0).all()
    assert (df["n_tokens"] == df["tokens"].list.len()).all()
    assert ((df["n_tokens"] == 10) | df["stopped"]).all()
    assert df["target"].to_list() == [p.answer for p in load_gsm8k(stage / "gsm8k.jsonl", 3, 0)]
    assert (df["correct"] == (df["prediction"] == df["target"])).all()
    meta = read_metadata(path)
    assert meta["task"] == "gsm8k" and meta["name"] == "fetch_every_miss"
    assert meta["capacity"] == C and meta["n"] == 3 and "missing_data" not in meta
    assert meta["params"]["shots"] == 1


def test_run_generate_under_substitution(stage, exact_gsm8k):
    exact = pl.read_parquet(exact_gsm8k)
    harsh_path = generate(stage, "gsm8k", "substitute_all", HARSH, "g_sub.parquet")
    harsh = pl.read_parquet(harsh_path)
    assert harsh["problem_id"].to_list() == exact["problem_id"].to_list()
    assert (harsh["mass_mean"] > 0).all()  # C=6 of 16 resident: substitutions happen
    # agreement columns are consistent with the token lists
    for h, x in zip(harsh.iter_rows(named=True), exact.iter_rows(named=True), strict=True):
        assert (h["agree_exact"], h["agree_prefix_frac"]) == agreement(h["tokens"], x["tokens"])
    assert not harsh["agree_exact"].all()
    # a reference file gives the same agreement as decoding the reference again
    again = pl.read_parquet(
        generate(
            stage, "gsm8k", "substitute_all", HARSH, "g_sub_ref.parquet",
            reference_path=str(exact_gsm8k),
        )
    )  # fmt: skip
    assert again.drop("policy").equals(harsh.drop("policy"))


def test_run_generate_humaneval(stage):
    path = generate(stage, "humaneval", "fetch_every_miss", EXACT, "h.parquet", n=2, timeout_s=5)
    df = pl.read_parquet(path)
    assert df.height == 2 and df["problem_id"].str.starts_with("HumanEval/").all()
    # random model: the completions cannot pass, and each was really run in the sandbox
    assert set(df["prediction"]) <= {"fail", "timeout", "crashed"} and not df["correct"].any()
    assert df["agree_exact"].all()
    assert read_metadata(path)["sandbox"]["network_isolated"] in (True, False)


def test_run_generate_missing_gsm8k_is_reported(stage, caplog):
    missing = stage / "no" / "gsm8k.jsonl"
    path = run_generate(
        stage / "model", "gsm8k", missing, stage / "initial_sets.parquet", "fem", EXACT, 0.375,
        stage / "out" / "missing.parquet", {"n": 2},
    )  # fmt: skip
    assert pq.read_table(path).num_rows == 0
    assert pq.read_schema(path).remove_metadata() == OUTPUT_SCHEMA
    message = read_metadata(path)["missing_data"]
    assert str(missing) in message and "fetch_gsm8k" in message
    assert str(missing) in caplog.text


def test_run_generate_rejects_bad_input(stage):
    good = dict(
        model_dir=stage / "model", task="gsm8k", data_path=stage / "gsm8k.jsonl",
        initial_sets_path=stage / "initial_sets.parquet", name="p", policy=EXACT,
        fraction=0.375, out_path=stage / "bad" / "x.parquet", params={"n": 1},
    )  # fmt: skip
    cases = [
        ({"task": "mmlu"}, ValueError, "task"),
        ({"model_dir": stage / "nope"}, FileNotFoundError, "model_dir"),
        ({"initial_sets_path": stage / "nope"}, FileNotFoundError, "initial_sets_path"),
        ({"name": ""}, ValueError, "name"),
        ({"policy": {"rule": "magic"}}, ValueError, "policy"),
        ({"fraction": 1.5}, ValueError, "fraction"),
        ({"fraction": 0.5}, ValueError, "fraction 0.5"),  # no initial set for it
        ({"params": {"n": 0}}, ValueError, "params.n"),
        ({"params": {"bogus": 1}}, ValueError, "bogus"),
        ({"params": {"n": 1, "reference_path": str(stage / "nope")}}, FileNotFoundError, "ref"),
    ]
    for over, exc, match in cases:
        with pytest.raises(exc, match=match):
            run_generate(**{**good, **over})
    assert not (stage / "bad").exists()


def test_params():
    assert GenerateParams.from_dict(None) == GenerateParams()
    assert GenerateParams.from_dict({"n": 4, "device": "auto", "timeout_s": 2}).n == 4
    with pytest.raises(ValueError, match="device"):
        GenerateParams.from_dict({"device": "tpu"})
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        GenerateParams.from_dict({"max_prompt_tokens": 0})
