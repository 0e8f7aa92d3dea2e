"""Datasets (JSONL, Parquet, cached HF), built-in tasks, and the offline pass-rate filter."""

from __future__ import annotations

import json

import pytest

from node.engines.base import Completion
from node.rl.dataset_cli import filter_dataset
from node.rl.tasks import (
    CharTokenizer, Problem, arithmetic_problems, length_problems, load_dataset, problem_from_record, save_dataset,
)
from node.rl.rewards import math_reward

RECORDS = [
    {"id": "a", "prompt": "1+1?", "task": "math", "answer": "2"},
    {"prompt": "write f", "task": "code", "tests": ["assert f(1) == 1", "assert f(2) == 2"]},
    {"id": "c", "prompt": "len 8:", "task": "length", "target_length": 8},
    {"id": "d", "prompt": "3*3?", "verification_info": json.dumps({"ground_truth": "9"})},
]


def test_jsonl_and_parquet_round_trip(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n\n")
    probs = load_dataset(src)
    assert [p.task for p in probs] == ["math", "code", "length", "math"]
    assert probs[1].tests == "assert f(1) == 1\nassert f(2) == 2" and len(probs[1].id) == 16
    assert probs[3].answer == "9"
    save_dataset(probs, tmp_path / "d.parquet")
    assert load_dataset(tmp_path / "d.parquet") == probs
    assert load_dataset(tmp_path / "d.parquet", limit=2) == probs[:2]


def test_cached_hf_dataset(tmp_path, monkeypatch):
    snap = tmp_path / "hub" / "datasets--org--mathset" / "snapshots" / "abc123" / "data"
    snap.mkdir(parents=True)
    save_dataset([Problem(id="x", prompt="2+2?", answer="4")], snap / "train-00000.parquet")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert load_dataset("hf:org/mathset")[0].answer == "4"
    with pytest.raises(FileNotFoundError):
        load_dataset("hf:org/missing")


def test_bad_records_are_rejected():
    with pytest.raises(ValueError):
        problem_from_record({"prompt": "x", "task": "math"})  # no answer
    with pytest.raises(ValueError):
        problem_from_record({"task": "math", "answer": "1"})  # no prompt
    with pytest.raises(ValueError):
        problem_from_record({"prompt": "x", "task": "poetry"})


def test_builtin_tasks_are_seeded_and_exact():
    a, b = arithmetic_problems(20, seed=3), arithmetic_problems(20, seed=3)
    assert a == b and a != arithmetic_problems(20, seed=4)
    for p in a:
        expr = p.prompt.removeprefix("Compute ").split(".")[0]
        assert str(eval(expr)) == p.answer  # noqa: S307 - our own generated digits
        assert math_reward(f"\\boxed{{{p.answer}}}", p.answer) == 1.0
    lp = length_problems(10, seed=1)
    assert lp == length_problems(10, seed=1) and {p.target_length for p in lp} <= {8, 16, 24, 32}


def test_char_tokenizer():
    tok = CharTokenizer()
    ids = tok.encode("len 16:")
    assert ids[0] == tok.BOS and tok.decode(ids + [tok.EOS]) == "len 16:"
    assert tok.vocab_size == 3 + len(CharTokenizer.CHARS)


class ScriptedEngine:
    """Returns completions whose lengths make problem i pass i of 4 times (target-length task)."""

    eos_token_id = 2

    def __init__(self, targets):
        self.targets = targets

    def generate(self, prompts, n, params, seeds, capture_hidden=False):
        out = []
        for prompt in prompts:
            t = self.targets[tuple(prompt)]
            passes = {8: 0, 16: 1, 24: 2, 32: 4}[t]
            out.append([Completion(list(prompt), [5] * (t if j < passes else t + 1) + [2], [0.0] * (t + 2), 0, "stop")
                        for j in range(n)])
        return out


def test_offline_filter_keeps_the_window_and_records_pass_rates(tmp_path):
    tok = CharTokenizer()
    probs = [Problem(id=f"p{t}", prompt=f"len {t}:", task="length", target_length=t) for t in (8, 16, 24, 32)]
    save_dataset(probs, tmp_path / "in.jsonl")
    engine = ScriptedEngine({tuple(tok.encode(p.prompt)): p.target_length for p in probs})
    summary = filter_dataset(tmp_path / "in.jsonl", "scripted", tmp_path / "out.jsonl", k=4, lo=0.1, hi=0.8,
                             engine=engine, encode=tok.encode, decode=tok.decode)
    assert summary.pass_rates == {"p8": 0.0, "p16": 0.25, "p24": 0.5, "p32": 1.0}
    kept = load_dataset(tmp_path / "out.jsonl")
    assert [(p.id, p.pass_rate) for p in kept] == [("p16", 0.25), ("p24", 0.5)]
    assert summary.kept == 2 and summary.total == 4


def test_dataset_filter_cli_with_a_real_tiny_model(tmp_path):
    from typer.testing import CliRunner

    from node.cli import app

    save_dataset(length_problems(3, seed=0), tmp_path / "in.jsonl")
    res = CliRunner().invoke(app, ["dataset", "filter", str(tmp_path / "in.jsonl"), "--model", "tiny", "--k", "2",
                                   "--min-pass", "0", "--max-pass", "1", "--max-tokens", "8",
                                   "--output", str(tmp_path / "out.parquet")])
    assert res.exit_code == 0, res.output
    kept = load_dataset(tmp_path / "out.parquet")
    assert len(kept) == 3 and all(p.pass_rate is not None for p in kept)
