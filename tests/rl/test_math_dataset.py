"""Issue 16 point 6: real chat and math.

A GSM8K-style Parquet dataset in the local Hugging Face cache (built here, offline) loads
with its reference answers extracted; prompts go through the model's chat template with
the system prompt and the ``\\boxed{}`` instruction; ``primenode dataset filter`` samples
with the same prompts the run will use and keeps the pass-rate window.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from harness.genesis import tiny_genesis
from harness.qwen import qwen_folder
from node.engines.base import Completion
from node.models import model_files, model_root_of
from node.ops.dataset_cli import filter_dataset, load_model_for_sampling
from node.rl.rewards import compute_reward
from node.rl.tasks import (
    MATH_INSTRUCTION,
    MATH_SYSTEM_PROMPT,
    Problem,
    PromptStyle,
    dataset_hash,
    extract_reference_answer,
    load_dataset,
    problem_from_record,
    prompt_token_ids,
    save_dataset,
)
from node.roles.context import RunContext
from protocol.run_config import RunConfig

PRIMENODE = shutil.which("primenode")
BASE = [PRIMENODE] if PRIMENODE else [sys.executable, "-m", "node.ops.cli"]

GSM8K = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72",
    },
    {
        "question": "A shop sells 1,000 pens a day for 1.2 days. How many pens?",
        "answer": "1000 * 1.2 = 1200\n#### 1,200",
    },
    {"question": "What is -3 plus 1?", "answer": "-3 + 1 = -2\n#### -2"},
]


def gsm8k_hub(hub):
    """openai/gsm8k as huggingface_hub caches it: Parquet blobs, snapshot symlinks, refs/main."""
    commit = "e" * 40
    repo = hub / "datasets--openai--gsm8k"
    snap = repo / "snapshots" / commit / "main"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for split, rows in (("train", GSM8K), ("test", GSM8K[:1])):
        blob = repo / "blobs" / f"{split}.parquet"
        save_dataset(rows, blob)
        (snap / f"{split}-00000-of-00001.parquet").symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    gsm8k_hub(tmp_path / "hub")

    def no_network(*a, **k):
        raise AssertionError("loading a cached dataset touched the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    return tmp_path / "hub"


def test_a_cached_gsm8k_parquet_loads_offline_with_its_answers(hub):
    problems = load_dataset("hf:openai/gsm8k@main")
    assert [p.answer for p in problems] == ["72", "1200", "-2"]
    assert problems[0].prompt == GSM8K[0]["question"] and problems[0].task == "math"
    assert [p.answer for p in load_dataset("hf:openai/gsm8k", split="test")] == ["72"]
    # the answers are what the math reward checks a model's final \boxed{} against
    assert compute_reward(problems[1], "1000 x 1.2 pens... \\boxed{1200}", []).reward == 1.0
    assert compute_reward(problems[1], "\\boxed{1,000}", []).reward == 0.0
    assert compute_reward(problems[2], "<think>minus</think> so \\boxed{-2}", []).reward == 1.0


def test_answer_extraction_forms():
    assert extract_reference_answer("work\n#### 5,000,000") == "5000000"
    assert extract_reference_answer("a #### 1 then #### 3/4 ") == "3/4"  # the last marker
    assert extract_reference_answer(None, "so $x = \\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"  # MATH style
    assert extract_reference_answer("17") == "17" and extract_reference_answer(None) is None
    p = problem_from_record({"problem": "Find x.", "solution": "x is \\boxed{4}"})
    assert (p.prompt, p.answer) == ("Find x.", "4")
    with pytest.raises(ValueError, match="has no answer"):
        problem_from_record({"question": "no answer here"})


def test_prompts_go_through_the_chat_template_with_system_prompt_and_boxed_instruction(tmp_path):
    tok = qwen_folder(tmp_path / "qwen")
    math = Problem(id="m", prompt="What is 2 + 3?", answer="5")
    text = tok.decode(prompt_token_ids(tok, math))
    assert text == (
        f"<|im_start|>system\n{MATH_SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\nWhat is 2 + 3?\n\n{MATH_INSTRUCTION}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # a prompt that already asks for \boxed{} gets no second instruction; the run can change both
    boxed = Problem(id="b", prompt="Put 5 in \\boxed{}.", answer="5")
    assert MATH_INSTRUCTION not in tok.decode(prompt_token_ids(tok, boxed))
    plain = PromptStyle.from_config(RunConfig.decode({"system_prompt": "", "math_instruction": "Answer in \\boxed{}."}))
    assert tok.decode(prompt_token_ids(tok, math, plain)) == (
        "<|im_start|>user\nWhat is 2 + 3?\n\nAnswer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    )
    # the length task keeps its bare prompt (no math system prompt)
    length = Problem(id="l", prompt="len 8:", task="length", target_length=8)
    assert tok.decode(prompt_token_ids(tok, length)) == "<|im_start|>user\nlen 8:<|im_end|>\n<|im_start|>assistant\n"


def test_the_run_and_the_offline_filter_put_the_same_prompt_tokens(hub, tmp_path):
    folder = tmp_path / "qwen"
    qwen_folder(folder)
    problems = load_dataset("hf:openai/gsm8k@main")
    fields = {
        "model": str(folder),
        "model_root": model_root_of(model_files(folder), 1 << 20),
        "dataset": "hf:openai/gsm8k@main",
        "dataset_size": 3,
        "dataset_hash": dataset_hash(problems),
    }
    ctx = RunContext.from_genesis(tiny_genesis(fields=fields).genesis, tmp_path / "cache")
    _engine, prompt_ids, _decode = load_model_for_sampling(str(folder), style=PromptStyle.from_config(ctx.config))
    for i, p in enumerate(problems):
        assert prompt_ids(p) == ctx.prompt_tokens(i)


class AnswerEngine:
    """Answers problem i correctly in ``right[i]`` of ``k`` completions (a scripted policy): the
    window rule on real GSM8K records, their extracted answers and the math reward."""

    eos_token_id = 0

    def __init__(self, problems, right, encode):
        self.by_prompt = {tuple(encode(p)): (p, r) for p, r in zip(problems, right)}

    def generate(self, prompts, n, params, seeds):
        out = []
        for prompt in prompts:
            prob, right = self.by_prompt[tuple(prompt)]
            texts = [f"\\boxed{{{prob.answer if j < right else 'no'}}}" for j in range(n)]
            out.append([Completion(list(prompt), [ord(c) for c in t], [0.0] * len(t), 0, "stop") for t in texts])
        return out


def test_filter_keeps_the_pass_rate_window_of_a_cached_math_dataset(hub, tmp_path):
    problems = load_dataset("hf:openai/gsm8k@main")

    def encode(text):
        return [ord(c) for c in text]

    engine = AnswerEngine(problems, right=[0, 2, 4], encode=lambda p: encode(p.prompt))
    summary = filter_dataset(
        "hf:openai/gsm8k@main",
        "scripted",
        tmp_path / "kept.jsonl",
        k=4,
        lo=0.1,
        hi=0.8,
        engine=engine,
        encode=encode,
        decode=lambda ids: "".join(chr(i) for i in ids),
    )
    kept = load_dataset(tmp_path / "kept.jsonl")
    assert [(p.answer, p.pass_rate) for p in kept] == [("1200", 0.5)]  # 0/4 and 4/4 teach nothing
    assert summary.total == 3 and summary.kept == 1


def test_dataset_filter_cli_on_the_cached_dataset_with_a_model_folder(hub, tmp_path):
    folder = tmp_path / "qwen"
    qwen_folder(folder)
    out = tmp_path / "filtered.parquet"
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "OMP_NUM_THREADS": "1"}
    args = ["dataset", "filter", "hf:openai/gsm8k@main", "--model", str(folder), "--k", "2"]
    args += ["--min-pass", "0", "--max-pass", "1", "--max-tokens", "4", "-o", str(out)]
    res = subprocess.run([*BASE, *args], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    assert "kept 3/3 problems" in res.stdout
    assert "mean pass rate 0.0000 over all 3 problems" in res.stdout
    kept = load_dataset(out)
    assert [p.answer for p in kept] == ["72", "1200", "-2"] and all(p.pass_rate == 0.0 for p in kept)


def test_dataset_make_writes_a_builtin_task_that_loads_back_the_same(tmp_path):
    """``primenode dataset make``: a built-in task as a dataset file (what the filter reads),
    the same problems a genesis naming ``builtin:addition`` loads; an unknown task is refused."""
    from node.rl.tasks import addition_problems

    out = tmp_path / "addition.jsonl"
    res = subprocess.run(
        [*BASE, "dataset", "make", "addition", "-n", "7", "-o", str(out)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert dataset_hash(load_dataset(out)) == dataset_hash(addition_problems(7, 0))
    assert len({p.prompt for p in addition_problems(400, 0)}) == 400  # distinct pairs before repeats
    bad = subprocess.run([*BASE, "dataset", "make", "nope", "-o", str(out)], capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown built-in task" in bad.stderr + bad.stdout


def test_dataset_make_narrows_the_operands_of_addition(tmp_path):
    """``--max-operand 9``: single-digit sums (the SmolLM2 run's task), the same problems as
    ``addition_problems(n, seed, hi=9)``; the default range is untouched; a task without
    operands refuses the option rather than ignoring it."""
    from node.rl.tasks import addition_problems

    out = tmp_path / "add9.jsonl"
    args = ["dataset", "make", "addition", "-n", "48", "--max-operand", "9", "-o", str(out)]
    res = subprocess.run([*BASE, *args], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    problems = load_dataset(out)
    assert dataset_hash(problems) == dataset_hash(addition_problems(48, 0, hi=9))
    pairs = [tuple(int(x) for x in re.findall(r"\d+", p.prompt)[:2]) for p in problems]
    assert all(1 <= a <= 9 and 1 <= b <= 9 and int(p.answer) == a + b for (a, b), p in zip(pairs, problems))
    assert len(set(pairs)) == 48  # distinct pairs (81 exist)
    wide = [tuple(int(x) for x in re.findall(r"\d+", p.prompt)[:2]) for p in addition_problems(48, 0)]
    assert max(max(p) for p in wide) > 9  # the default is still 1..20
    bad = subprocess.run(
        [*BASE, "dataset", "make", "target-length", "--max-operand", "9", "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "has no operands" in bad.stderr + bad.stdout


def test_dataset_filter_help_names_its_pass_rate_window():
    """The help text once lost its ``[lo, hi]`` to rich markup ("keep problems inside .")."""
    res = subprocess.run(
        [*BASE, "dataset", "filter", "--help"], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"}
    )
    assert res.returncode == 0, res.stderr
    assert "from --min-pass to --max-pass" in res.stdout
