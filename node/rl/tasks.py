"""Problems, datasets and the built-in tasks.

Dataset schema (one record per problem; JSONL line, Parquet row, or a row of a
locally cached Hugging Face dataset, ``hf:owner/name[@revision]``):

==================  ========  ====================================================
field               required  meaning
==================  ========  ====================================================
``prompt``          yes       the text shown to the model
``task``            no        ``math`` (default), ``code`` or ``length``
``answer``          math      the reference answer (checked symbolically)
``tests``           code      Python ``assert`` statements (or a list of such
                              strings), or an io/calls spec (a JSON object or
                              its text; docs/rl.md); reward 1 only if all pass
``target_length``   length;   target completion length in tokens; on a math/code
                    optional  problem it adds INTELLECT-2's length penalty
``id``              no        stable identifier (default: hash of the record)
``pass_rate``       no        written by ``primenode dataset filter``
``verification_info`` no      a dict (or JSON string) holding any of ``answer``,
                              ``tests``, ``target_length`` (INTELLECT-2 style)
==================  ========  ====================================================

Everything a verifier needs is inside the record, so validators and the trainer
recompute rewards from the dataset alone and never take a worker's word.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from node.models import cached_hf_snapshot as _cached_snapshot
from node.models import parse_hf_spec
from node.rl.answers import last_boxed
from node.util import atomic_write_bytes, atomic_write_text
from protocol.run_config import RunConfig

TASK_TYPES = ("math", "code", "length")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One verifiable problem. ``answer``/``tests``/``target_length`` per the schema above."""

    id: str
    prompt: str
    task: str = "math"
    answer: str | None = None
    tests: str | None = None
    target_length: int | None = None
    pass_rate: float | None = None

    def __post_init__(self) -> None:
        if self.task not in TASK_TYPES:
            raise ValueError(f"unknown task type {self.task!r} (expected one of {TASK_TYPES})")
        if self.task == "math" and self.answer is None:
            raise ValueError(f"math problem {self.id!r} has no answer")
        if self.task == "code" and not self.tests:
            raise ValueError(f"code problem {self.id!r} has no tests")
        if self.task == "length" and not self.target_length:
            raise ValueError(f"length problem {self.id!r} has no target_length")

    def to_record(self) -> dict[str, Any]:
        """The JSON-serialisable record (schema above); None fields are left out."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def problem_from_record(record: dict[str, Any], index: int = 0) -> Problem:
    """Build a Problem from one dataset record, accepting ``verification_info`` as INTELLECT-2's data does."""
    rec = dict(record)
    info = rec.pop("verification_info", None)
    if isinstance(info, str):
        info = json.loads(info)
    if isinstance(info, dict):
        for key in ("answer", "tests", "target_length"):
            if rec.get(key) is None and info.get(key) is not None:
                rec[key] = info[key]
        if rec.get("answer") is None and info.get("ground_truth") is not None:
            rec["answer"] = info["ground_truth"]
        if rec.get("tests") is None and info.get("test_cases") is not None:
            rec["tests"] = info["test_cases"]
    if rec.get("prompt") is None:  # GSM8K names the prompt "question", MATH "problem"
        for key in ("question", "problem"):
            if isinstance(rec.get(key), str):
                rec["prompt"] = rec[key]
                break
    if "prompt" not in rec or not isinstance(rec["prompt"], str):
        raise ValueError(f"record {index} has no string 'prompt' (nor 'question' / 'problem')")
    rec["answer"] = extract_reference_answer(rec.get("answer"), rec.get("solution"))
    tests = rec.get("tests")
    if isinstance(tests, dict) or (isinstance(tests, (list, tuple)) and tests and isinstance(tests[0], dict)):
        tests = json.dumps(tests)  # an io/calls spec (docs/rl.md, "Code test formats")
    elif isinstance(tests, (list, tuple)):
        tests = "\n".join(str(t) for t in tests)
    answer = rec.get("answer")
    target = rec.get("target_length")
    pid = rec.get("id")
    if pid is None:
        digest = hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()
        pid = digest[:16]
    return Problem(
        id=str(pid),
        prompt=rec["prompt"],
        task=str(rec.get("task") or "math"),
        answer=None if answer is None else str(answer),
        tests=tests,
        target_length=None if target is None else int(target),
        pass_rate=None if rec.get("pass_rate") is None else float(rec["pass_rate"]),
    )


_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.S)
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?:\D|$))")


def extract_reference_answer(answer: Any, solution: Any = None) -> Any:
    """The reference answer of a math record, from the forms public math datasets use:

    * GSM8K: ``answer`` is the worked solution ending in ``#### 72``: the text after the
      last ``####``, thousands separators removed (``1,200`` -> ``1200``);
    * MATH / NuminaMath: no ``answer``, a ``solution`` whose last ``\\boxed{...}`` is it;
    * anything else (a plain ``answer``) is kept as it is.
    """
    if isinstance(answer, str) and "####" in answer:
        tail = answer[answer.rindex("####") :]
        m = _GSM8K_FINAL.match(tail)
        if m:
            return _THOUSANDS.sub("", m.group(1).strip())
    if answer is None and isinstance(solution, str):
        boxed = last_boxed(solution)
        if boxed is not None and boxed.strip():
            return boxed.strip()
    return answer


def dataset_hash(problems: Sequence[Problem]) -> bytes:
    """sha256 of the problems as a node loaded them (each record as canonical JSON, in order):
    what the genesis's ``dataset_hash`` pins. Hashing the loaded problems rather than file
    bytes pins what matters (the same prompts and answers in the same order, so prompt
    indices mean the same everywhere) whatever the file format, and catches a node whose
    loader reads the same file differently."""
    h = hashlib.sha256(b"primenode/dataset/v1\n")
    for p in problems:
        h.update(json.dumps(p.to_record(), sort_keys=True, ensure_ascii=True, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.digest()


def _read_records(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        records = []
        with path.open("r", encoding="utf-8") as fh:
            text = fh.read()
        if suffix == ".json" and text.lstrip().startswith("["):
            return list(json.loads(text))
        for line in text.splitlines():
            if line.strip():
                records.append(json.loads(line))
        return records
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"unsupported dataset file {path} (expected .jsonl, .json or .parquet)")


def cached_hf_snapshot(name: str, revision: str = "main") -> Path:
    """The snapshot folder of dataset ``name`` at ``revision`` in the local hub cache; never
    downloads (resolution rules: ``node.models.cached_hf_snapshot``, shared with models)."""
    return _cached_snapshot(name, revision, kind="dataset")


def _names_split(relpath: str, split: str) -> bool:
    """``train`` in ``data/train-00000-of-00001.parquet``, ``train.jsonl``, ``default/train/0000.parquet``;
    not in ``pretraining.jsonl`` (``test`` not in ``contest``)."""
    return re.search(r"(?:^|[/_.-])" + re.escape(split) + r"(?:[/_.-]|$)", relpath) is not None


def cached_hf_files(name: str, split: str = "train", revision: str = "main") -> list[Path]:
    """Data files (Parquet, JSONL) of split ``split`` of a Hugging Face dataset in the local hub cache.

    Reads the snapshot folder (see :func:`cached_hf_snapshot`) directly, so neither the ``datasets``
    library nor the network is involved. Files whose path names the split are used; when no file
    names any split, every data file is the ``train`` split (the Hub's convention).
    """
    snap = cached_hf_snapshot(name, revision)
    files = sorted(p for p in snap.rglob("*") if p.suffix in (".parquet", ".jsonl") and p.is_file())
    if not files:
        raise FileNotFoundError(f"no parquet/jsonl files in {snap} (dataset {name!r}, revision {revision!r})")
    rel = {p: p.relative_to(snap).as_posix() for p in files}
    in_split = [p for p in files if _names_split(rel[p], split)]
    if in_split:
        return in_split
    if split == "train" and not any(
        _names_split(r, s) for r in rel.values() for s in ("test", "validation", "valid", "dev")
    ):
        return files
    raise FileNotFoundError(
        f"no file of dataset {name!r} (revision {revision!r}) names split {split!r}: {sorted(rel.values())}"
    )


def parse_hf_source(spec: str) -> tuple[str, str]:
    """``hf:owner/name`` or ``hf:owner/name@revision`` -> (name, revision); revision defaults to main."""
    return parse_hf_spec(spec)


def load_dataset(source: str | os.PathLike[str], split: str = "train", limit: int | None = None) -> list[Problem]:
    """Load problems from a JSONL/JSON/Parquet file, a folder of them, or ``hf:owner/name[@revision]``
    (local Hugging Face cache only; revision: a branch, tag or commit, default ``main``)."""
    src = str(source)
    if src.startswith("hf:"):
        name, revision = parse_hf_source(src)
        paths = cached_hf_files(name, split, revision)
    else:
        p = Path(src)
        if p.is_dir():
            paths = sorted(q for q in p.iterdir() if q.suffix in (".jsonl", ".json", ".parquet"))
        elif p.exists():
            paths = [p]
        else:
            raise FileNotFoundError(f"dataset {src} not found")
    problems: list[Problem] = []
    for path in paths:
        for rec in _read_records(path):
            problems.append(problem_from_record(rec, len(problems)))
            if limit is not None and len(problems) >= limit:
                return problems
    return problems


def save_dataset(problems: Iterable[Problem | dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write problems (or raw records) as JSONL or Parquet, chosen by the file suffix; atomic
    (readers see the old file or the new one), not fsynced (a dataset can be written again)."""
    out = Path(path)
    records = [p.to_record() if isinstance(p, Problem) else dict(p) for p in problems]
    if out.suffix.lower() == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        keys: list[str] = []
        for rec in records:  # from_pylist takes its columns from the first row only
            keys += [k for k in rec if k not in keys]
        buf = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist([{k: rec.get(k) for k in keys} for rec in records]), buf)
        atomic_write_bytes(out, buf.getvalue().to_pybytes(), durable=False)
    else:
        text = "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)
        atomic_write_text(out, text, durable=False)
    return out


# ---------------------------------------------------------------- prompts

# How a math problem is put to a chat model, as INTELLECT-2's math prompts were: the problem,
# then an instruction to reason step by step and put the final answer in \boxed{} (which is
# what the math reward reads), under a short system prompt. The genesis [config] keys
# ``system_prompt`` and ``math_instruction`` override them (an empty string: none).
MATH_SYSTEM_PROMPT = "You are a careful mathematician. Reason step by step before answering."
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


@dataclasses.dataclass(frozen=True)
class PromptStyle:
    """How problems become chat messages: ``system`` prompt (None or "" for none) and the
    ``math_instruction`` appended to a math problem that does not already ask for \\boxed{}."""

    system: str | None = MATH_SYSTEM_PROMPT
    math_instruction: str = MATH_INSTRUCTION

    @classmethod
    def from_config(cls, config: RunConfig) -> PromptStyle:
        """The run's style: its ``system_prompt`` and ``math_instruction``, else the built-in ones."""
        return cls(
            system=MATH_SYSTEM_PROMPT if config.system_prompt is None else config.system_prompt,
            math_instruction=MATH_INSTRUCTION if config.math_instruction is None else config.math_instruction,
        )

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        text = problem.prompt
        if problem.task == "math" and self.math_instruction and "\\boxed" not in text:
            text = f"{text}\n\n{self.math_instruction}"
        msgs = [{"role": "user", "content": text}]
        if self.system and problem.task == "math":
            msgs.insert(0, {"role": "system", "content": self.system})
        return msgs


def prompt_token_ids(tokenizer: Any, problem: Problem, style: PromptStyle | None = None) -> list[int]:
    """The token ids a problem is put to the model as: through the tokenizer's chat template
    when it has one (system prompt, instruction, generation prompt), else the raw text (the
    tiny models' character tokenizer). Workers, validators, the trainer and the offline
    filter all call this, so they agree on every prompt token."""
    style = style or PromptStyle()
    if hasattr(tokenizer, "apply_chat_template") and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(style.messages(problem), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer.encode(problem.prompt)]


# ---------------------------------------------------------------- built-in tasks

MATH_SUFFIX = " Think step by step, then put the final answer in \\boxed{}."


def arithmetic_problems(n: int, seed: int, max_operand: int = 99, ops: str = "+-*") -> list[Problem]:
    """``n`` seeded arithmetic problems with exact integer answers (same seed, same problems)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b, c = (rng.randint(0, max_operand) for _ in range(3))
        op1, op2 = rng.choice(ops), rng.choice(ops)
        expr = f"{a} {op1} {b} {op2} {c}"
        value = eval(expr, {"__builtins__": {}}, {})
        out.append(
            Problem(id=f"arith-{seed}-{i}", prompt=f"Compute {expr}.{MATH_SUFFIX}", task="math", answer=str(value))
        )
    return out


# The instruction of the built-in addition task: a worked format example, because
# SmolLM2-135M-Instruct almost never writes \\boxed{} unasked (0 of 32 samples at temperature
# 0.7) and writes it in ~6% of samples with the example: a pass rate the offline filter can
# work with (docs/benchmarks.md, "A real model learns").
ADDITION_FORMAT = "Give the answer in the form \\boxed{number}, for example \\boxed{12}."


def addition_problems(n: int, seed: int, lo: int = 1, hi: int = 20) -> list[Problem]:
    """``n`` seeded one-step additions ``a + b`` with ``lo <= a, b <= hi`` (same seed, same
    problems; distinct pairs until ``n`` exceeds them, then they repeat). Short answers, so a
    small chat model's completion fits in ~32 tokens: the task a real model learns on two cores."""
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    random.Random(seed).shuffle(pairs)
    out = []
    for i in range(n):
        a, b = pairs[i % len(pairs)]
        out.append(
            Problem(
                id=f"add-{seed}-{i}", prompt=f"What is {a} + {b}? {ADDITION_FORMAT}", task="math", answer=str(a + b)
            )
        )
    return out


BUILTIN_TASKS = ("target-length", "arithmetic", "addition")


def builtin_problems(task: str, n: int, seed: int, max_operand: int | None = None) -> list[Problem]:
    """The problems of a built-in task (``builtin:<task>`` in a genesis). ``max_operand``
    (arithmetic, addition; None: the task's default) narrows the operands, which is how a
    task is brought into a small model's reach (single-digit sums for SmolLM2-135M:
    docs/benchmarks.md, "A real model learns")."""
    if max_operand is not None and task not in ("arithmetic", "math", "addition"):
        raise ValueError(f"task {task!r} has no operands (max_operand is for arithmetic and addition)")
    if max_operand is not None and max_operand < 1:
        raise ValueError(f"max_operand must be at least 1, got {max_operand}")
    if task in ("target-length", "length"):
        return length_problems(n, seed)
    if task in ("arithmetic", "math"):
        return arithmetic_problems(n, seed) if max_operand is None else arithmetic_problems(n, seed, max_operand)
    if task == "addition":
        return addition_problems(n, seed) if max_operand is None else addition_problems(n, seed, hi=max_operand)
    raise ValueError(f"unknown built-in task {task!r} (expected one of {', '.join(BUILTIN_TASKS)})")


LENGTH_TARGETS = (8, 16, 24, 32)


def length_prompt(target: int) -> str:
    """The learnable task's prompt text; a character model sees the digits of T."""
    return f"len {target}:"


def length_problems(n: int, seed: int, targets: Sequence[int] = LENGTH_TARGETS) -> list[Problem]:
    """Seeded target-length problems: the reward is ``1 - |len - T| / T`` (see length.py).

    Chosen as the learnable task because a ~3M-parameter Llama trained from scratch
    with a character vocabulary lifts its mean reward from below 0 to ~0.8 in ~40
    GRPO steps on a 2-core CPU, and a policy that ignores T cannot beat an average
    error of 8 tokens, so success shows the model reads the prompt.
    """
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = rng.choice(list(targets))
        out.append(Problem(id=f"len-{seed}-{i}", prompt=length_prompt(t), task="length", target_length=t))
    return out


class CharTokenizer:
    """A fixed character vocabulary (PAD, BOS, EOS + 70 printable symbols) for tiny models.

    Deterministic and dependency-free, so a test can build a model and its tokenizer
    without downloading anything.
    """

    PAD, BOS, EOS = 0, 1, 2
    CHARS = "0123456789abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,:;=+-*/()"

    def __init__(self) -> None:
        self._index = {c: i + 3 for i, c in enumerate(self.CHARS)}

    @property
    def vocab_size(self) -> int:
        return 3 + len(self.CHARS)

    @property
    def eos_token_id(self) -> int:
        return self.EOS

    @property
    def pad_token_id(self) -> int:
        return self.PAD

    @property
    def bos_token_id(self) -> int:
        return self.BOS

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Characters outside the vocabulary map to a space."""
        ids = [self._index.get(c, self._index[" "]) for c in text]
        return [self.BOS] + ids if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.CHARS[i - 3] for i in ids if 3 <= i < self.vocab_size)
