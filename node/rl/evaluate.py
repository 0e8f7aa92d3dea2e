"""Sampling and scoring a policy on problems: the core of ``primenode eval``, of the
trainer's periodic held-out evaluation and of ``primenode dataset filter``.

It goes through the same parts a worker uses: the run's prompt tokens
(``node.rl.tasks.prompt_token_ids``, the chat template and system prompt), an
inference engine's seeded Gumbel-max sampling (``InferenceEngine.generate``) and
the rules' rewards (``node.rl.rewards.compute_reward``: math, code in the
sandbox, length). A worker's seeds come from its assignment slot
(``protocol.sample_seed``); an evaluation has no slot, so each problem's seed is
fixed by (``seed``, problem id) (``problem_seed``) and each of its ``k`` samples
gets its own stream (``group_seeds``): the same seed, weights and problems give
the same completions, hence the same score, on any batch shape.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from node.engines.base import group_seeds
from node.rl.rewards import compute_reward
from node.rl.scoring import mean_interval, pass_at_k
from node.rl.tasks import Problem
from protocol.messages import SamplingParams


def problem_seed(seed: int, problem_id: str) -> int:
    """Sampling seed of one problem: fixed by (seed, id), so a rerun reproduces the scores."""
    h = hashlib.sha256(f"{seed}|{problem_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") >> 1


@dataclasses.dataclass(frozen=True)
class ProblemResult:
    """The ``k`` samples of one problem, scored by the rules."""

    id: str
    passed: tuple[bool, ...]
    rewards: tuple[float, ...]
    lengths: tuple[int, ...]
    completions: tuple[str, ...] = ()

    @property
    def pass_rate(self) -> float:
        return sum(self.passed) / len(self.passed)

    @property
    def reward_mean(self) -> float:
        return sum(self.rewards) / len(self.rewards)

    def pass_at(self, k: int) -> float:
        return pass_at_k(len(self.passed), sum(self.passed), k)

    def to_record(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "pass_rate": self.pass_rate,
            "reward_mean": self.reward_mean,
            "passed": list(self.passed),
            "rewards": list(self.rewards),
            "lengths": list(self.lengths),
            "completions": list(self.completions),
        }


def sample_problems(
    problems: Sequence[Problem],
    engine: Any,
    prompt_ids: Callable[[Problem], list[int]],
    decode: Callable[[list[int]], str],
    k: int,
    params: SamplingParams,
    *,
    seed: int = 0,
    batch_prompts: int = 8,
    keep_text: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> list[ProblemResult]:
    """``k`` seeded completions per problem, each scored by the rules (blocking: a thread)."""
    if k < 1:
        raise ValueError("samples per problem must be >= 1")
    out: list[ProblemResult] = []
    for start in range(0, len(problems), batch_prompts):
        chunk = list(problems[start : start + batch_prompts])
        groups = engine.generate(
            [prompt_ids(p) for p in chunk], k, params, group_seeds([problem_seed(seed, p.id) for p in chunk], k)
        )
        for prob, comps in zip(chunk, groups):
            texts = [decode(list(c.tokens)) for c in comps]
            scored = [
                compute_reward(prob, text, list(c.tokens), eos_token_id=engine.eos_token_id)
                for text, c in zip(texts, comps)
            ]
            out.append(
                ProblemResult(
                    prob.id,
                    tuple(bool(r.passed) for r in scored),
                    tuple(float(r.reward) for r in scored),
                    tuple(len(c.tokens) for c in comps),
                    tuple(texts) if keep_text else (),
                )
            )
        if progress:
            progress(len(out), len(problems))
    return out


def summarize(results: Sequence[ProblemResult], k: int | None = None) -> dict[str, Any]:
    """The scores over problems: pass@1 and pass@k (unbiased, ``k`` default the samples per
    problem) and mean reward, each with its 95 % interval over problems, and mean length."""
    if not results:
        raise ValueError("no problems to summarize")
    samples = min(len(r.passed) for r in results)
    k = samples if k is None else k
    p1, p1_lo, p1_hi = mean_interval([r.pass_at(1) for r in results])
    pk, pk_lo, pk_hi = mean_interval([r.pass_at(k) for r in results])
    rw, rw_lo, rw_hi = mean_interval([r.reward_mean for r in results])
    lengths = [n for r in results for n in r.lengths]
    return {
        "problems": len(results),
        "samples": samples,
        "pass@1": round(p1, 6),
        "pass@1_ci95": [round(p1_lo, 6), round(p1_hi, 6)],
        f"pass@{k}": round(pk, 6),
        f"pass@{k}_ci95": [round(pk_lo, 6), round(pk_hi, 6)],
        "k": k,
        "reward_mean": round(rw, 6),
        "reward_mean_ci95": [round(rw_lo, 6), round(rw_hi, 6)],
        "length_mean": round(sum(lengths) / len(lengths), 3),
    }
