"""Data filters.

Online (every training step): a group whose rewards are all equal has all-zero
advantages, contributes no policy gradient and only dilutes the batch, so it is
dropped before the step and counted (INTELLECT-2 did the same).

Offline (``primenode dataset filter``): problems the base model always or never
solves teach nothing; keep those whose sampled pass rate lies in a window
(INTELLECT-2: [0.1, 0.8]).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

T = TypeVar("T")

INTELLECT2_PASS_WINDOW = (0.1, 0.8)


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """GRPO advantages of one group: ``(r - mean) / (std + eps)``.

    std is the population standard deviation (unbiased=False): a group of two
    rewards 0 and 1 gets advantages -1 and +1. An all-equal group gets zeros.
    """
    r = torch.tensor(list(rewards), dtype=torch.float64)
    if r.numel() == 0:
        return []
    std = r.std(unbiased=False)
    return ((r - r.mean()) / (std + eps)).tolist()


def is_zero_advantage(advantages: Sequence[float], tol: float = 0.0) -> bool:
    """True when every advantage is zero (within ``tol``)."""
    return all(abs(a) <= tol for a in advantages)


def filter_zero_advantage(
    groups: Sequence[T], advantages: Sequence[Sequence[float]]
) -> tuple[list[T], list[list[float]], int]:
    """Drop groups whose advantages are all zero; returns (kept groups, their advantages, dropped count)."""
    kept, kept_adv, dropped = [], [], 0
    for g, adv in zip(groups, advantages, strict=True):
        if is_zero_advantage(adv):
            dropped += 1
        else:
            kept.append(g)
            kept_adv.append(list(adv))
    return kept, kept_adv, dropped


def in_pass_window(
    pass_rate: float, lo: float = INTELLECT2_PASS_WINDOW[0], hi: float = INTELLECT2_PASS_WINDOW[1]
) -> bool:
    """Inclusive window test used by the offline filter."""
    return lo <= pass_rate <= hi


def pass_rate(passes: Sequence[bool]) -> float:
    return sum(1 for p in passes if p) / len(passes) if passes else 0.0
