"""moesub.generate: data loading, prompts, answer extraction, HumanEval in the sandbox (with the
sentinel that proves check() returned), held-out code completion, the stop cut shared by scoring
and agreement, and the stage entry point on a tiny random Qwen3-Next with a tiny byte-level BPE
tokenizer; the generation statistics over such artefacts."""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fixtures_artefacts import write_ranking
from tiny_models import tiny_qwen3_next

from moesub.artefacts import read_expert_ranking
from moesub.config import schema_section
from moesub.corpus import read_document
from moesub.documents import load_documents
from moesub.generate import (
    GSM8K_SHOT_POOL,
    GSM8K_STOP,
    OUTPUT_SCHEMA,
    TASKS,
    GenerateParams,
    agreement,
    check_humaneval,
    code_line_starts,
    completion_items,
    extract_answer,
    fetch_gsm8k,
    gsm8k_correct,
    gsm8k_gold,
    gsm8k_prompt,
    gsm8k_shots,
    heldout_code_files,
    load_gsm8k,
    load_humaneval,
    normalize_line,
    normalize_number,
    read_gsm8k,
    read_humaneval,
    run_generate,
    scored_length,
    task_named,
    truncate_at,
)
from moesub.generate.completion import _file_problems
from moesub.generate.continuation import continuation_items
from moesub.generate.degeneration import measures
from moesub.generate.humaneval import score_humaneval
from moesub.generate.run import TIMING_COLUMNS
from moesub.greedy import greedy_decode, greedy_decode_batched
from moesub.io import read_metadata, write_parquet
from moesub.models import load_model
from moesub.sandbox import SandboxResult
from moesub.stats import run_analysis

REPO = Path(__file__).resolve().parents[1]
REPO_GSM8K = REPO / "data" / "gsm8k" / "test.jsonl"
E, K, L, C = 16, 4, 2, 6
EXACT = {"rule": "fetch_all", "eviction": "lru"}
HARSH = {"rule": "substitute_all", "eviction": "lru"}
EVAL_FILES = ("bisect.py", "colorsys.py", "fnmatch.py")  # the tiny corpus' held-out split
TRAIN_FILE = "json/encoder.py"


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
    assert f"The answer is {shots[0].answer}." in prompt
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


def test_gsm8k_ships_with_the_repository():
    """The default config's GSM8K file is in the repository (MIT licence beside it)."""
    import yaml

    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    assert REPO / cfg["generate"]["tasks"]["gsm8k"]["path"] == REPO_GSM8K
    assert "MIT License" in (REPO_GSM8K.parent / "LICENSE").read_text()
    problems = read_gsm8k(REPO_GSM8K)
    assert len(problems) == 1319
    assert problems[0].answer == "18"
    assert all(p.answer == extract_answer(p.answer) for p in problems)
    # every gold solution, rewritten as a few-shot answer, scores as correct
    assert all(
        gsm8k_correct(gsm8k_prompt("x", [p]).split("Answer: ", 1)[1], p.answer)
        for p in problems[:200]
    )
    sample = load_gsm8k(REPO_GSM8K, 10, seed=0)
    assert len({p.problem_id for p in sample}) == 10
    shots = gsm8k_shots(REPO_GSM8K, 8)
    assert len(shots) == 8 and len(gsm8k_shots(REPO_GSM8K, GSM8K_SHOT_POOL)) == 64
    for script in ("Makefile", "scripts/get_gsm8k.sh"):
        assert "../shared" not in (REPO / script).read_text(), script


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
TOY = {
    "task_id": "Toy/0",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Sum of a and b."""\n',
    "entry_point": "add",
    "test": (
        "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
    ),
}


def test_correct_programs_pass_never_crash():
    """Canonical solutions pass (a correct program must never come back `crashed` or
    `error`), wrong ones fail."""
    assert len(read_humaneval()) == 164
    sample = load_humaneval(8, seed=0)
    assert [p["task_id"] for p in sample] == [p["task_id"] for p in load_humaneval(8, seed=0)]
    for p in sample:
        res = check_humaneval(p, p["canonical_solution"])
        assert res.status == "pass", (p["task_id"], res.sandbox)
        assert check_humaneval(p, "    return None\n").status == "fail", p["task_id"]
    noisy = "    print('x' * 20000)\n    return a + b\n"  # output beyond the kept tail
    assert check_humaneval(TOY, noisy).status == "pass"
    redirect = "    import sys; sys.stdout = open('/dev/null', 'w')\n    return a + b\n"
    assert check_humaneval(TOY, redirect).status == "pass"
    with pytest.raises(ValueError, match="n=165"):
        load_humaneval(165)


@pytest.mark.parametrize(
    "completion",
    [
        "    import sys\n    sys.exit(0)\n",  # inside the function, while check() runs
        "    import os\n    os._exit(0)\n",
        "    raise SystemExit\n",
        "    raise SystemExit(0)\n",
        "    raise SystemExit(None)\n",
        "    return a + b\n\nimport sys\nsys.exit()\n",  # module level, before check() runs
        "    return a + b\n\nprint('moesub-check-returned-0123')\nraise SystemExit(0)\n",
        "    import threading, os\n    threading.Thread(target=os._exit, args=(0,)).start()\n"
        "    import time; time.sleep(5)\n",
    ],
)
def test_early_exit_never_passes(completion):
    """Exit status 0 before check() returned is `early_exit`, whatever ends the process."""
    res = check_humaneval(TOY, completion)
    assert res.sandbox.status == "pass" and res.sandbox.returncode == 0  # the trap: exit 0
    assert res.status == "early_exit" and not res.passed


def test_systemexit_with_a_message_fails():
    res = check_humaneval(TOY, "    raise SystemExit('giving up')\n")
    assert res.status == "fail" and res.sandbox.returncode == 1


def test_sandbox_failure_is_missing_not_wrong(tmp_path, monkeypatch):
    """A launcher that cannot start the program: status `error`, the problem unscored."""
    not_python = tmp_path / "python3"
    not_python.write_bytes(b"\x00\x01 not an executable format\n")
    not_python.chmod(0o755)
    res = check_humaneval(TOY, "    return a + b\n", python=not_python)
    assert res.status == "error" and res.sandbox.error, res.sandbox
    monkeypatch.setattr(
        "moesub.sandbox.run_untrusted",
        lambda *a, **kw: SandboxResult("error", None, "", "", 0.0, "sandbox", error="boom"),
    )
    item = types.SimpleNamespace(problem=TOY)
    score = score_humaneval(item, "    return a + b\n", [], GenerateParams(timeout_s=5.0))
    assert score.correct is None and score.prediction == "error"
    assert "sandbox error: boom" in score.missing


def test_humaneval_file_argument(tmp_path):
    p = read_humaneval()[0]
    path = tmp_path / "he.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write(json.dumps(p) + "\n")
    assert read_humaneval(path) == [p]
    with pytest.raises(FileNotFoundError, match="humaneval.path"):
        read_humaneval(tmp_path / "missing.jsonl")


# --------------------------------------------------------------------------- code completion
SNIPPET = '''"""Module docstring
spanning lines."""
import os  # a comment


def f(x):
    # only a comment
    """Docstring."""
    y = (x +
         1)
    s = """text
    inside = 1
    """ + str(y)
    return y
'''


def test_code_line_starts():
    lines = SNIPPET.splitlines()
    starts = [lines[i].strip() for i in code_line_starts(SNIPPET)]
    assert starts == ["import os  # a comment", "def f(x):", "y = (x +", "1)", 's = """text',
                      "return y"]  # fmt: skip
    assert code_line_starts("def broken(:\n  (\n") == []
    assert normalize_line("  a =\t b  ") == "a = b"


# --------------------------------------------------------------------------- stage entry point
def tiny_checkpoint(root: Path) -> Path:
    """A random tiny Qwen3-Next (E=16, k=4, 2 layers) with a 300-token byte-level BPE tokenizer,
    a corpus table (three stdlib files held out, one for training) and initial sets."""
    from moesub.corpus import train_tokenizer

    texts = [json.loads(line)["question"] for line in gsm8k_file(root / "corpus.jsonl").open()]
    texts += [p["prompt"] for p in read_humaneval()[:20]]
    texts += [read_document(TRAIN_FILE)]
    tokenizer = train_tokenizer(texts, vocab_size=300)
    model = tiny_qwen3_next(
        vocab=len(tokenizer), layers=L, experts=E, k=K, gate_std=0.5, expert_std=0.4,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    corpus = {
        "path": [*EVAL_FILES, TRAIN_FILE, "pydoc_data/topics.py#assert"],
        "split": ["eval"] * 3 + ["train", "eval"],
        "package": ["x"] * 5,
        "kind": ["code"] * 4 + ["text"],
        "bytes": [1] * 5,
    }
    write_parquet(corpus, root / "model" / "corpus_files.parquet")
    rng = np.random.default_rng(0)
    write_ranking(root / "ranking.parquet", np.stack([rng.permutation(E) for _ in range(L)]), E)
    return root


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    root = tiny_checkpoint(tmp_path_factory.mktemp("generate"))
    gsm8k_file(root / "gsm8k.jsonl", 40)
    return root


def generate(root: Path, task: str, name: str, policy: dict, out: str, **params):
    params = {"n": 3, "max_new_tokens": 10, "progress": False, **params}
    if task == "gsm8k":
        params.setdefault("shots", 1)
    data = root / "gsm8k.jsonl" if task == "gsm8k" else None
    return run_generate(
        root / "model", task, data, root / "ranking.parquet", name, policy, 0.375,
        root / "out" / out, params,
    )  # fmt: skip


def test_completion_prompts_are_held_out_and_aligned(stage):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stage / "model")
    assert heldout_code_files(stage / "model" / "corpus_files.parquet") == list(EVAL_FILES)
    text = read_document("colorsys.py")
    lines = text.splitlines()
    whole = _file_problems("colorsys.py", text, tok, None, 8, 200, "start", 0)
    cut = _file_problems("colorsys.py", text, tok, None, 8, 200, "random", 0)
    assert len(whole) > 20 and len(cut) > 20
    for p in whole + cut:
        row = int(p.problem_id.rsplit(":", 1)[1]) - 1
        prefix = tok.decode(p.prompt_ids)  # the whole file before the cut: no context limit
        assert text.startswith(prefix + p.target), p.problem_id
        assert not lines[row].lstrip().startswith(("#", '"', "'"))
        assert len(normalize_line(lines[row])) >= 8
    for p in whole:  # the whole line is the target
        row = int(p.problem_id.rsplit(":", 1)[1]) - 1
        assert normalize_line(p.target) == normalize_line(lines[row])
    for p in cut:  # the prompt holds the start of the line, the target its (non-empty) rest
        row = int(p.problem_id.rsplit(":", 1)[1]) - 1
        start = tok.decode(p.prompt_ids).rsplit("\n", 1)[1]
        assert start.strip() and p.target.strip() and lines[row] == start + p.target
    again = _file_problems("colorsys.py", text, tok, None, 8, 200, "random", 0)
    other = _file_problems("colorsys.py", text, tok, None, 8, 200, "random", 1)
    assert [p.target for p in again] == [p.target for p in cut]  # seeded, deterministic
    assert [p.target for p in other] != [p.target for p in cut]
    short = _file_problems("colorsys.py", text, tok, 16, 8, 200, "random", 0)
    assert [p.target for p in short] == [p.target for p in cut]
    assert all(len(p.prompt_ids) <= 16 for p in short)
    for a, b in zip(cut, short, strict=True):  # the same prompts, cut to their last 16
        assert a.prompt_ids[-len(b.prompt_ids) :] == b.prompt_ids
    with pytest.raises(ValueError, match="line_cut"):
        _file_problems("colorsys.py", text, tok, None, 8, 200, "middle", 0)

    opts = GenerateParams(n=30, seed=0, max_prompt_tokens=64, min_line_chars=8, max_line_tokens=40)
    items = completion_items(None, stage / "model", opts)
    again = completion_items(None, stage / "model", opts)
    other = completion_items(None, stage / "model", dataclasses.replace(opts, seed=1))
    assert [i.problem_id for i in items] == [i.problem_id for i in again]
    assert [i.problem_id for i in items] != [i.problem_id for i in other]
    assert {i.problem_id.rsplit(":", 1)[0] for i in items + other} <= set(EVAL_FILES)
    with pytest.raises(ValueError, match="held-out lines available"):
        completion_items(None, stage / "model", dataclasses.replace(opts, n=10**6))


def test_heldout_files_refuse_a_training_file(tmp_path):
    table = {"path": ["a.py", "a.py"], "split": ["train", "eval"], "kind": ["code", "code"]}
    with pytest.raises(ValueError, match="both the train and the eval split"):
        heldout_code_files(write_parquet(table, tmp_path / "c.parquet"))
    table = {"path": ["a.py"], "split": ["train"], "kind": ["code"]}
    with pytest.raises(FileNotFoundError, match="no held-out"):
        heldout_code_files(write_parquet(table, tmp_path / "d.parquet"))


def test_stop_cut_is_shared_by_scoring_and_agreement(stage):
    """Outputs that differ only after the stop sequence agree; within it they do not."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stage / "model")
    a = tok("He has 12 apples\n\nQuestion: one more", add_special_tokens=False)["input_ids"]
    b = tok("He has 12 apples\n\nQuestion: two less", add_special_tokens=False)["input_ids"]
    cut = [scored_length(tok, t, len(truncate_at(tok.decode(t), GSM8K_STOP))) for t in (a, b)]
    assert tok.decode(a[: cut[0]]) == "He has 12 apples" and cut[0] == cut[1]
    assert agreement(a[: cut[0]], b[: cut[1]]) == (True, 1.0)
    assert not agreement(a, b)[0]
    newline = TASKS["code_completion"].stop_ids(tok)
    assert tok.eos_token_id in newline and all("\n" in tok.decode([i]) for i in newline - {0})
    assert TASKS["gsm8k"].stop_ids(tok) == TASKS["humaneval"].stop_ids(tok) == {tok.eos_token_id}
    assert TASKS["continuation"].stop_ids(tok) == set()  # fixed length: not even end of text


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
    assert (df["mass_per_token_layer"].drop_nulls() == 0.0).all()
    assert (df["n_tokens"] == df["tokens"].list.len()).all()
    assert (df["n_scored"] <= df["n_tokens"]).all()
    assert ((df["n_tokens"] == 10) | df["stopped"]).all()
    assert df["target"].to_list() == [p.answer for p in load_gsm8k(stage / "gsm8k.jsonl", 3, 0)]
    assert (df["correct"] == (df["prediction"] == df["target"])).all()
    assert (df["missing_reason"] == "").all()
    meta = read_metadata(path)
    assert meta["task"] == "gsm8k" and meta["name"] == "fetch_every_miss"
    assert meta["capacity"] == C and meta["n"] == 3 and "missing_data" not in meta
    assert meta["params"]["shots"] == 1 and meta["num_moe_layers"] == L


def test_run_generate_under_substitution(stage, exact_gsm8k):
    exact = pl.read_parquet(exact_gsm8k)
    harsh_path = generate(stage, "gsm8k", "substitute_all", HARSH, "g_sub.parquet")
    harsh = pl.read_parquet(harsh_path)
    assert harsh["problem_id"].to_list() == exact["problem_id"].to_list()
    # C=6 of 16 resident: substitutions happen; per token-layer mass is a share of one layer's
    # gate weight, so it never exceeds 1 (a sum over the 2 layers could)
    mass = harsh["mass_per_token_layer"].drop_nulls()
    assert (mass > 0).all() and (mass <= 1.0).all()
    # agreement columns compare the scored (stop-cut) tokens
    for h, x in zip(harsh.iter_rows(named=True), exact.iter_rows(named=True), strict=True):
        expected = agreement(h["tokens"][: h["n_scored"]], x["tokens"][: x["n_scored"]])
        assert (h["agree_exact"], h["agree_prefix_frac"]) == expected
    assert not harsh["agree_exact"].all()
    # a reference file gives the same agreement as decoding the reference again
    again = pl.read_parquet(
        generate(
            stage, "gsm8k", "substitute_all", HARSH, "g_sub_ref.parquet",
            reference_path=str(exact_gsm8k),
        )
    )  # fmt: skip
    # (the engine's measured times differ between runs)
    assert again.drop("policy", *TIMING_COLUMNS).equals(harsh.drop("policy", *TIMING_COLUMNS))


def test_reference_tokens_after_the_cut_are_ignored(stage, exact_gsm8k):
    ref = pl.read_parquet(exact_gsm8k)
    tail = ref.with_columns(pl.col("tokens").list.concat(pl.lit([5, 6, 7], pl.List(pl.Int32))))
    write_parquet(tail.to_arrow().cast(OUTPUT_SCHEMA), stage / "ref_tail.parquet")
    df = pl.read_parquet(
        generate(
            stage,
            "gsm8k",
            "fem",
            EXACT,
            "tail.parquet",
            reference_path=str(stage / "ref_tail.parquet"),
        )
    )
    assert df["agree_exact"].all()
    first = ref["tokens"][0].to_list()
    n0 = ref["n_scored"][0]
    if n0:  # a changed token within the cut is a disagreement
        bad = ref.with_columns(
            pl.Series("tokens", [[first[0] + 1, *first[1:]], *ref["tokens"][1:].to_list()])
        )
        write_parquet(bad.to_arrow().cast(OUTPUT_SCHEMA), stage / "ref_bad.parquet")
        df = pl.read_parquet(
            generate(
                stage,
                "gsm8k",
                "fem",
                EXACT,
                "bad.parquet",
                reference_path=str(stage / "ref_bad.parquet"),
            )
        )
        assert df["agree_exact"].to_list() == [False, True, True]


def test_run_generate_code_completion(stage):
    path = generate(
        stage, "code_completion", "substitute_all", HARSH, "cc.parquet",
        n=4, max_prompt_tokens=48, max_line_tokens=40, max_new_tokens=12,
    )  # fmt: skip
    df = pl.read_parquet(path)
    assert df.height == 4 and df["problem_id"].str.split(":").list.first().is_in(EVAL_FILES).all()
    assert not df["output"].str.contains("\n").any()  # one line: the newline token stops it
    assert (df["n_scored"] == df["n_tokens"]).all()
    assert df["correct"].is_not_null().all()
    assert (df["correct"] == (df["prediction"] == df["target"].map_elements(normalize_line))).all()
    meta = read_metadata(path)
    assert meta["params"]["max_prompt_tokens"] == 48 and meta["n_missing"] == 0


def test_run_generate_humaneval(stage):
    path = generate(stage, "humaneval", "fetch_every_miss", EXACT, "h.parquet", n=2, timeout_s=5)
    df = pl.read_parquet(path)
    assert df.height == 2 and df["problem_id"].str.starts_with("HumanEval/").all()
    # random model: the completions cannot pass, and each was really run in the sandbox
    assert set(df["prediction"]) <= {"fail", "timeout", "crashed", "early_exit"}
    assert not df["correct"].any()
    assert df["agree_exact"].all()
    assert read_metadata(path)["sandbox"]["network_isolated"] in (True, False)


def test_run_generate_missing_data_is_reported(stage, caplog):
    missing = stage / "no" / "gsm8k.jsonl"
    path = run_generate(
        stage / "model", "gsm8k", missing, stage / "ranking.parquet", "fem", EXACT, 0.375,
        stage / "out" / "missing.parquet", {"n": 2},
    )  # fmt: skip
    assert pq.read_table(path).num_rows == 0
    assert pq.read_schema(path).remove_metadata() == OUTPUT_SCHEMA
    message = read_metadata(path)["missing_data"]
    assert str(missing) in message and "fetch_gsm8k" in message
    assert str(missing) in caplog.text
    path = run_generate(
        stage / "model", "code_completion", stage / "no.parquet", stage / "ranking.parquet",
        "fem", EXACT, 0.375, stage / "out" / "missing_cc.parquet", {"n": 2},
    )  # fmt: skip
    assert "code_completion.path" in read_metadata(path)["missing_data"]


def test_run_generate_rejects_bad_input(stage):
    good = dict(
        model_dir=stage / "model", task="gsm8k", data_path=stage / "gsm8k.jsonl",
        ranking_path=stage / "ranking.parquet", name="p", policy=EXACT,
        size=0.375, out_path=stage / "bad" / "x.parquet", params={"n": 1},
    )  # fmt: skip
    cases = [
        ({"task": "mmlu"}, ValueError, "task"),
        ({"model_dir": stage / "nope"}, FileNotFoundError, "model_dir"),
        ({"ranking_path": stage / "nope"}, FileNotFoundError, "ranking_path"),
        ({"name": ""}, ValueError, "name"),
        ({"policy": {"rule": "magic"}}, ValueError, "policy"),
        ({"size": 1.5}, ValueError, "fraction"),
        ({"size": 0.01}, ValueError, r"C_l=0, outside \[k="),  # fewer slots than k
        ({"policy": {**EXACT, "pin": "C-1"}}, ValueError, "pin"),  # leaves k - 1 free slots
        ({"params": {"n": 0}}, ValueError, "params.n"),
        ({"params": {"bogus": 1}}, ValueError, "bogus"),
        ({"params": {"max_line_tokens": 0}}, ValueError, "max_line_tokens"),
        ({"params": {"line_cut": "middle"}}, ValueError, "line_cut"),
        ({"params": {"n": 1, "reference_path": str(stage / "nope")}}, FileNotFoundError, "ref"),
    ]
    for over, exc, match in cases:
        with pytest.raises(exc, match=match):
            run_generate(**{**good, **over})
    assert not (stage / "bad").exists()


def test_task_records():
    """Every task has its config section and a record under its own name; only HumanEval runs
    generated code; each record cuts where its module says."""
    assert sorted(TASKS) == sorted(schema_section("generate.tasks")["properties"])
    assert all(task_named(name).name == name for name in TASKS)
    assert [name for name, t in TASKS.items() if t.sandboxed] == ["humaneval"]
    assert TASKS["gsm8k"].stops == GSM8K_STOP and TASKS["code_completion"].stops == ("\n",)
    with pytest.raises(ValueError, match="task must be one of"):
        task_named("mmlu")


# --------------------------------------------------------------------------- free continuation
CONT = dict(n=3, prompt_tokens=20, max_new_tokens=24, loop_window=8, loop_max_period=4)
LFU_ADMIT = {"rule": "threshold", "tau": 0.15, "eviction": "lfu", "beta": 0.5, "delay": 1}


def test_batched_decoding_is_each_prompt_alone(stage):
    """`greedy_decode_batched` gives every prompt its own caches: the tokens and masses of
    decoding each prompt alone (`greedy_decode`), for the exact model and two substituting
    policies, in one batch and in batches of 2 (the last one short)."""
    model, _ = load_model(stage / "model")
    initial = read_expert_ranking(stage / "ranking.parquet", L, E)[:, :C]
    prompts = np.random.default_rng(0).integers(3, 300, (5, 12)).tolist()
    for policy in (None, HARSH, LFU_ADMIT):
        alone = greedy_decode(model, prompts, policy, C, initial, 10)
        for size in (None, 2):
            batched = greedy_decode_batched(model, prompts, policy, C, initial, 10, size)
            for a, b in zip(alone, batched, strict=True):
                assert b.tokens == a.tokens and not b.stopped and len(b.tokens) == 10
                # same substitutions; the gate weights differ in the batch's rounding
                assert b.mass == pytest.approx(a.mass, rel=1e-5, abs=1e-9)
        if policy is HARSH:
            assert sum(sum(r.mass) for r in alone) > 0  # substitution happened
    assert greedy_decode_batched(model, prompts, HARSH, C, initial, 0)[0].tokens == []
    with pytest.raises(ValueError, match="one length"):
        greedy_decode_batched(model, [[3, 4], [5]], None, C, initial, 4)
    with pytest.raises(ValueError, match="batch_size"):
        greedy_decode_batched(model, prompts, None, C, initial, 4, 0)


def test_continuation_prompts_are_held_out_and_seeded(stage, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stage / "model")
    opts = GenerateParams(**CONT)
    items = continuation_items(None, stage / "model", opts)
    assert len(items) == 3
    for it in items:  # prompt_tokens consecutive tokens of one held-out document, then its text
        name, start = it.problem_id.rsplit("@", 1)
        ids = tok(read_document(name), add_special_tokens=False)["input_ids"]
        assert name in (*EVAL_FILES, "pydoc_data/topics.py#assert")
        assert it.prompt_ids == ids[int(start) : int(start) + 20]
        assert it.target == tok.decode(ids[int(start) + 20 : int(start) + 44])
    again = continuation_items(None, stage / "model", opts)
    other = continuation_items(None, stage / "model", dataclasses.replace(opts, seed=1))
    assert [i.problem_id for i in again] == [i.problem_id for i in items]
    assert [i.problem_id for i in other] != [i.problem_id for i in items]
    assert len({i.problem_id.rsplit("@")[0] for i in items}) == 3  # one prompt per document
    # a text file: its documents; a text source: only its eval split
    text = tmp_path / "docs.jsonl"
    files = [*EVAL_FILES, TRAIN_FILE]
    text.write_text("".join(json.dumps({"text": read_document(f)}) + "\n" for f in files))

    def documents(items) -> set[str]:
        return {i.problem_id.split("@")[0] for i in items}

    assert documents(continuation_items(text, stage / "model", opts)) <= {
        f"docs.jsonl:{i}" for i in range(4)
    }
    source = {"kind": "text", "path": str(text), "calib_fraction": 0.5}
    split = load_documents(stage / "model", source)
    evaluated = {d.name for d in split["eval"]}
    assert 0 < len(evaluated) < 4  # the calibration documents are never prompts
    one = dataclasses.replace(opts, n=len(evaluated), source=source)
    assert documents(continuation_items(None, stage / "model", one)) == evaluated
    with pytest.raises(ValueError, match="held-out documents of at least"):
        continuation_items(None, stage / "model", dataclasses.replace(opts, n=50))
    with pytest.raises(ValueError, match="loop_window=30 exceeds max_new_tokens"):
        continuation_items(None, stage / "model", dataclasses.replace(opts, loop_window=30))
    with pytest.raises(ValueError, match="loop_max_period"):
        continuation_items(None, stage / "model", dataclasses.replace(opts, loop_max_period=5))


def test_run_generate_continuation(stage):
    exact_path = generate(stage, "continuation", "fetch_every_miss", EXACT, "cont_exact.parquet",
                          backend="engine", **CONT)  # fmt: skip
    table = pq.read_table(exact_path)
    assert table.schema.remove_metadata() == OUTPUT_SCHEMA
    exact = pl.from_arrow(table)
    meta = read_metadata(exact_path)
    assert meta["backend"] == "emulator"  # batched on the emulator whatever the backend
    assert exact.height == 3 and (exact["n_tokens"] == 24).all() and (exact["n_scored"] == 24).all()
    assert not exact["stopped"].any() and exact["correct"].is_null().all()
    assert (exact["missing_reason"] == "").all() and exact["agree_exact"].all()
    for r in exact.iter_rows(named=True):  # the measures of the generated tokens
        want = measures(r["tokens"], 8, 4)
        got = r["measures"]  # a map column reads as a dict
        assert got.keys() == want.keys()
        assert all(got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])) for k in want)
        assert (r["prediction"] != "") == (want["ends_in_loop"] == 1.0)
    # under substitution, against the exact output (read from the reference, or decoded again)
    harsh = pl.read_parquet(
        generate(
            stage,
            "continuation",
            "substitute_all",
            HARSH,
            "cont_sub.parquet",
            reference_path=str(exact_path),
            **CONT,
        )
    )
    assert harsh["problem_id"].to_list() == exact["problem_id"].to_list()
    assert (harsh["mass_per_token_layer"] > 0).all()
    for h, x in zip(harsh.iter_rows(named=True), exact.iter_rows(named=True), strict=True):
        assert (h["agree_exact"], h["agree_prefix_frac"]) == agreement(h["tokens"], x["tokens"])
    again = pl.read_parquet(generate(stage, "continuation", "substitute_all", HARSH,
                                     "cont_sub2.parquet", **CONT))  # fmt: skip
    assert again.equals(harsh)
    missing = run_generate(
        stage / "model", "continuation", stage / "no.txt", stage / "ranking.parquet", "fem",
        EXACT, 0.375, stage / "out" / "missing_cont.parquet", CONT,
    )  # fmt: skip
    assert "no.txt" in read_metadata(missing)["missing_data"]


def test_params():
    assert GenerateParams.from_dict(None) == GenerateParams()
    assert GenerateParams.from_dict({"n": 4, "device": "auto", "timeout_s": 2}).n == 4
    with pytest.raises(ValueError, match="device"):
        GenerateParams.from_dict({"device": "tpu"})
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        GenerateParams.from_dict({"max_prompt_tokens": 0})


# --------------------------------------------------------------------------- statistics
def artefact(root: Path, task: str, name: str, correct, agree, meta=None) -> Path:
    n = len(correct)
    rows = {
        "task": [task] * n,
        "problem_id": [f"{task}/{i}" for i in range(n)],
        "policy": [name] * n,
        "fraction": [0.25] * n,
        "output": [""] * n,
        "correct": list(correct),
        "missing_reason": ["" if c is not None else "sandbox error: boom" for c in correct],
        "agree_exact": list(agree),
        "agree_prefix_frac": [1.0 if a else 0.5 for a in agree],
        "mass_per_token_layer": [0.0 if name == "fetch_every_miss" else 0.1 * i for i in range(n)],
        "n_tokens": [4] * n,
        "n_scored": [4] * n,
        "prediction": [""] * n,
        "target": [""] * n,
        "stopped": [True] * n,
        "tokens": [[1, 2, 3, 4]] * n,
        **{c: [0.01] * n for c in TIMING_COLUMNS},
    }
    path = root / "embedded" / "generate" / task / name / "f0.25.parquet"
    none = pa.array([[]] * n, OUTPUT_SCHEMA.field("measures").type)  # graded: no measures
    table = pl.DataFrame(rows).to_arrow().append_column("measures", none)
    table = table.select(OUTPUT_SCHEMA.names).cast(OUTPUT_SCHEMA)
    return write_parquet(table, path, metadata=meta or {"task": task, "name": name})


def test_generation_statistics(tmp_path):
    ok = [True] * 6 + [False] * 4
    paths = [
        artefact(tmp_path, "code_completion", "fetch_every_miss", ok, [True] * 10),
        # one problem unscored (sandbox failure): n drops, accuracy is over the rest
        artefact(tmp_path, "code_completion", "quality", [True] * 3 + [False] * 6 + [None],
                 [True] * 4 + [False] * 6),
    ]  # fmt: skip
    for name in ("fetch_every_miss", "quality", "speed"):  # one missing-data message, 3 jobs
        meta = {"task": "gsm8k", "name": name, "missing_data": "GSM8K data file 'x' does not exist"}
        paths.append(artefact(tmp_path, "gsm8k", name, [], [], meta))
    doc = run_analysis({"generate": paths}, {"ci_level": 0.9}, tmp_path / "analysis")
    gen = pl.read_parquet(tmp_path / "analysis" / "generation.parquet")
    need = {"model", "task", "policy", "n", "accuracy", "ci_low", "ci_high", "agreement"}
    assert need <= set(gen.columns) and gen.height == 2
    q = gen.filter(pl.col("policy") == "quality").row(0, named=True)
    assert (q["n"], q["n_missing"], q["n_correct"]) == (9, 1, 3)
    assert q["accuracy"] == pytest.approx(3 / 9) and "boom" in q["missing_reasons"]
    z = 1.6448536269514722  # ci_level 0.9 is honoured
    centre = (3 / 9 + z * z / 18) / (1 + z * z / 9)
    assert (q["ci_low"] + q["ci_high"]) / 2 == pytest.approx(centre)
    assert q["agreement"] == pytest.approx(0.4) and q["agreement_ci_low"] < 0.4
    assert q["mass_per_token_layer"] == pytest.approx(0.45)
    # paired with the baseline on the 9 problems both scored: 3 vs 6 correct, all discordant
    assert q["baseline_accuracy"] == pytest.approx(6 / 9)
    assert q["accuracy_diff"] == pytest.approx(-3 / 9)
    assert q["mcnemar_p"] == pytest.approx(0.25)  # 3 discordant pairs, all one way: 2 * 1/8
    assert 0 < q["mdd"] <= 6 / 9
    note = doc["parts"]["generation"]["note"]
    assert note.count("does not exist") == 1 and "3 jobs" in note
