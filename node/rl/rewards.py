"""Rule-based rewards. Validators and the trainer recompute them; a worker's claim is never used.

:func:`compute_reward` picks the problem's rule, one room each: math in
:mod:`node.rl.math_reward` (boxed answers, numerically then symbolically in a helper
process), code in the :mod:`node.rl.sandbox` package (bubblewrap; the verdict is decided
outside the sandbox; a node that cannot sandbox raises SandboxError rather than scoring),
length in :mod:`node.rl.length` (the target-length task and the INTELLECT-2 penalty).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from node.rl.answers import extract_answer
from node.rl.length import INTELLECT2_LENGTH_COEF, completion_length, length_penalty, target_length_reward
from node.rl.math_reward import math_reward
from node.rl.tasks import Problem


@dataclasses.dataclass
class RewardResult:
    """``reward`` is what GRPO uses; ``task_reward`` before the length term; ``passed`` feeds pass rates."""

    reward: float
    task_reward: float
    length_penalty: float
    passed: bool
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


def compute_reward(
    problem: Problem,
    completion_text: str,
    completion_tokens: list[int] | None = None,
    *,
    eos_token_id: int | None = None,
    num_tokens: int | None = None,
    length_coef: float = INTELLECT2_LENGTH_COEF,
    code_timeout_s: float = 5.0,
) -> RewardResult:
    """The reward of one completion, from the problem's rules alone.

    ``num_tokens`` (or ``completion_tokens`` minus a final EOS) is the length used for
    length rewards. A math/code problem with ``target_length`` gets the INTELLECT-2
    penalty ``length_coef * |T - n|`` subtracted.
    """
    if num_tokens is None:
        num_tokens = completion_length(list(completion_tokens or []), eos_token_id)
    if problem.task == "length":
        assert problem.target_length is not None
        r = target_length_reward(num_tokens, problem.target_length)
        return RewardResult(r, r, 0.0, num_tokens == problem.target_length, {"length": num_tokens})
    if problem.task == "math":
        assert problem.answer is not None
        task_r = math_reward(completion_text, problem.answer)
        details: dict[str, Any] = {"extracted": extract_answer(completion_text)}
    elif problem.task == "code":
        from node.rl.sandbox import code_reward_detailed

        assert problem.tests is not None
        res = code_reward_detailed(completion_text, problem.tests, timeout_s=code_timeout_s)
        task_r = 1.0 if res.passed else 0.0
        details = {"status": res.status, "isolation": res.isolation, "detail": res.detail}
        if res.weak_checks:
            details["weak_checks"] = res.weak_checks
    else:  # pragma: no cover - Problem validates task
        raise ValueError(problem.task)
    pen = length_penalty(num_tokens, problem.target_length, length_coef) if problem.target_length else 0.0
    return RewardResult(task_r - pen, task_r, pen, task_r >= 1.0, details)
