"""Length rewards.

Two shapes, both computed from the number of completion tokens (EOS excluded):

* ``length_penalty``: INTELLECT-2's controllable-thinking term. The prompt names
  a target T; the reward is reduced by ``coef * |T - n|`` (coef 0.0003 per token
  in INTELLECT-2), so it composes additively with a task reward.
* ``target_length_reward``: the relative score ``1 - |n - T| / T`` used by the
  built-in learnable task. A tiny model trained from scratch can move this in
  minutes on a CPU (see docs/rl.md), which is why it exists.
"""

from __future__ import annotations

INTELLECT2_LENGTH_COEF = 0.0003


def length_penalty(num_tokens: int, target: int, coef: float = INTELLECT2_LENGTH_COEF) -> float:
    """The amount to subtract from a task reward: ``coef * |target - num_tokens|`` (>= 0)."""
    if num_tokens < 0 or target < 0:
        raise ValueError("lengths must be non-negative")
    return coef * abs(int(target) - int(num_tokens))


def target_length_reward(num_tokens: int, target: int) -> float:
    """``1 - |n - T| / T``: 1 when the length hits the target, negative far from it."""
    if target <= 0:
        raise ValueError("target must be positive")
    return 1.0 - abs(int(num_tokens) - int(target)) / float(target)


def completion_length(tokens: list[int], eos_token_id: int | None) -> int:
    """Completion length as rewarded: generated tokens, not counting a final EOS."""
    n = len(tokens)
    if n and eos_token_id is not None and tokens[-1] == eos_token_id:
        n -= 1
    return n
