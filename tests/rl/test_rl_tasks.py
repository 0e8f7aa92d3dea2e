"""Datasets (JSONL, Parquet, cached HF), built-in tasks, and the offline pass-rate filter."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

import pytest

from node.engines.base import Completion
from node.ops.dataset_cli import filter_dataset
from node.rl.math_reward import math_reward
from node.rl.tasks import (
    CharTokenizer,
    Problem,
    _names_split,
    arithmetic_problems,
    cached_hf_files,
    cached_hf_snapshot,
    length_problems,
    load_dataset,
    problem_from_record,
    save_dataset,
)

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


MAIN = "0" * 39 + "a"  # refs/main: lexicographically the smaller snapshot
NEWER = "f" * 40  # another revision, downloaded later, sorts last


def fake_hub_dataset(hub, name: str, snapshots: dict[str, dict[str, list[Problem]]], refs: dict[str, str] | None):
    """The hub cache layout huggingface_hub writes: blobs/<hash>, snapshots/<commit>/<file> -> ../../blobs/<hash>
    (relative symlinks), refs/<revision> holding a commit hash (no newline)."""
    repo = hub / ("datasets--" + name.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for commit, files in snapshots.items():
        for rel, problems in files.items():
            blob = repo / "blobs" / hashlib.sha256(f"{commit}/{rel}".encode()).hexdigest()
            os.replace(save_dataset(problems, blob.with_name(blob.name + Path(rel).suffix)), blob)
            link = repo / "snapshots" / commit / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    for rev, commit in (refs or {}).items():
        (repo / "refs" / rev).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / rev).write_text(commit)
    return repo


def prob(answer: str) -> list[Problem]:
    return [Problem(id=f"x{answer}", prompt="2+2?", answer=answer)]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))

    def no_network(*a, **k):
        raise AssertionError("the cached-dataset loader touched the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    return tmp_path / "hub"


def test_cached_hf_dataset_resolves_refs_main(hub):
    fake_hub_dataset(
        hub,
        "org/mathset",
        {
            MAIN: {"data/train-00000-of-00001.parquet": prob("4"), "data/test-00000-of-00001.parquet": prob("40")},
            NEWER: {"data/train-00000-of-00001.parquet": prob("5"), "data/test-00000-of-00001.parquet": prob("50")},
        },
        {"main": MAIN, "v2": NEWER, "refs/pr/1": NEWER},
    )
    assert [p.answer for p in load_dataset("hf:org/mathset")] == ["4"]  # refs/main, not the last snapshot
    assert [p.answer for p in load_dataset("hf:org/mathset@main")] == ["4"]
    assert [p.answer for p in load_dataset("hf:org/mathset", split="test")] == ["40"]
    assert [p.answer for p in load_dataset("hf:org/mathset@v2")] == ["5"]  # a branch or tag
    assert [p.answer for p in load_dataset("hf:org/mathset@refs/pr/1", split="test")] == ["50"]
    assert [p.answer for p in load_dataset(f"hf:org/mathset@{NEWER}")] == ["5"]  # a cached commit
    assert cached_hf_snapshot("org/mathset") == hub / "datasets--org--mathset" / "snapshots" / MAIN
    # the same files huggingface_hub's own offline lookup resolves (and the fake layout is one it reads)
    from huggingface_hub import try_to_load_from_cache

    for rev in ("main", "v2", "refs/pr/1", NEWER, MAIN):
        theirs = try_to_load_from_cache(
            "org/mathset", "data/train-00000-of-00001.parquet", cache_dir=hub, revision=rev, repo_type="dataset"
        )
        assert cached_hf_files("org/mathset", revision=rev) == [Path(theirs)], rev
    with pytest.raises(FileNotFoundError, match="names split 'validation'"):
        load_dataset("hf:org/mathset", split="validation")
    with pytest.raises(FileNotFoundError, match=r"revision 'v3'.*not in the local Hugging Face cache"):
        load_dataset("hf:org/mathset@v3")
    with pytest.raises(ValueError):
        load_dataset("hf:org/mathset@../../etc")


def test_cached_hf_dataset_missing_or_ambiguous_is_a_clear_error(hub):
    with pytest.raises(FileNotFoundError, match=r"not in the local Hugging Face cache.*nothing is downloaded"):
        load_dataset("hf:org/missing")
    # refs/main names a commit whose snapshot is gone: an error, not another snapshot
    fake_hub_dataset(hub, "org/partial", {NEWER: {"train.jsonl": prob("5")}}, {"main": MAIN})
    with pytest.raises(FileNotFoundError, match=r"refs/main.*not cached"):
        load_dataset("hf:org/partial")
    # hand-copied: no refs folder, a single snapshot serves main; with two, nothing is guessed
    fake_hub_dataset(hub, "org/copied", {NEWER: {"train.jsonl": prob("5")}}, None)
    assert [p.answer for p in load_dataset("hf:org/copied")] == ["5"]
    fake_hub_dataset(hub, "org/copied", {MAIN: {"train.jsonl": prob("4")}}, None)
    with pytest.raises(FileNotFoundError, match="revision 'main'"):
        load_dataset("hf:org/copied")
    assert [p.answer for p in load_dataset(f"hf:org/copied@{MAIN}")] == ["4"]


def test_hf_split_names():
    assert _names_split("data/train-00000-of-00001.parquet", "train")
    assert _names_split("train.jsonl", "train") and _names_split("default/train/0000.parquet", "train")
    assert not _names_split("pretraining.jsonl", "train") and not _names_split("data/contest.parquet", "test")


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
        assert str(eval(expr)) == p.answer
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
            out.append(
                [
                    Completion(list(prompt), [5] * (t if j < passes else t + 1) + [2], [0.0] * (t + 2), 0, "stop")
                    for j in range(n)
                ]
            )
        return out


def test_offline_filter_keeps_the_window_and_records_pass_rates(tmp_path):
    tok = CharTokenizer()
    probs = [Problem(id=f"p{t}", prompt=f"len {t}:", task="length", target_length=t) for t in (8, 16, 24, 32)]
    save_dataset(probs, tmp_path / "in.jsonl")
    engine = ScriptedEngine({tuple(tok.encode(p.prompt)): p.target_length for p in probs})
    summary = filter_dataset(
        tmp_path / "in.jsonl",
        "scripted",
        tmp_path / "out.jsonl",
        k=4,
        lo=0.1,
        hi=0.8,
        engine=engine,
        encode=tok.encode,
        decode=tok.decode,
    )
    assert summary.pass_rates == {"p8": 0.0, "p16": 0.25, "p24": 0.5, "p32": 1.0}
    kept = load_dataset(tmp_path / "out.jsonl")
    assert [(p.id, p.pass_rate) for p in kept] == [("p16", 0.25), ("p24", 0.5)]
    assert summary.kept == 2 and summary.total == 4


def test_dataset_filter_cli_with_a_real_tiny_model(tmp_path):
    from typer.testing import CliRunner

    from node.ops.cli import app

    save_dataset(length_problems(3, seed=0), tmp_path / "in.jsonl")
    res = CliRunner().invoke(
        app,
        [
            "dataset",
            "filter",
            str(tmp_path / "in.jsonl"),
            "--model",
            "tiny",
            "--k",
            "2",
            "--min-pass",
            "0",
            "--max-pass",
            "1",
            "--max-tokens",
            "8",
            "--output",
            str(tmp_path / "out.parquet"),
        ],
    )
    assert res.exit_code == 0, res.output
    kept = load_dataset(tmp_path / "out.parquet")
    assert len(kept) == 3 and all(p.pass_rate is not None for p in kept)
