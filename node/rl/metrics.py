"""Per-step training metrics, as one flat record a status page or a JSONL log can take."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass
class StepMetrics:
    """What one GRPO step did. Reward and length statistics cover every admitted rollout
    (before the zero-advantage filter); loss, clip fraction and entropy cover the trained tokens."""

    step: int = 0
    lr: float = 0.0
    num_groups: int = 0
    num_rollouts: int = 0
    filtered_groups: int = 0  # dropped by the zero-advantage filter
    stale_groups: int = 0  # dropped by the max_async staleness bound
    missing_policy_groups: int = 0  # dropped: the generating version's weights were not available
    reward_mean: float = 0.0
    reward_std: float = 0.0
    reward_min: float = 0.0
    reward_max: float = 0.0
    reward_hist: list[int] = dataclasses.field(default_factory=list)  # 10 bins over [reward_min, reward_max]
    pass_rate: float = 0.0
    length_mean: float = 0.0
    length_min: int = 0
    length_max: int = 0
    loss: float = 0.0
    grad_norm: float = 0.0  # before clipping
    clip_fraction: float = 0.0
    # ratio statistics and clip fraction per staleness ("0", "1", "2": versions behind): RatioStats
    by_staleness: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    entropy: float = 0.0  # mean per trained token
    kl: float = 0.0
    trained_tokens: int = 0
    tokens_per_s: float = 0.0  # prompt + completion tokens through the trainer per wall second
    step_time_s: float = 0.0
    skipped: bool = False  # no group survived the filters: no optimizer step

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class RatioStats:
    """Importance ratios ``exp(logp - logp_old)`` of trained tokens and the clip's work, per
    staleness (how many versions behind the trainer the generating policy was). Staleness 0 is
    on-policy data (ratio 1 on the first mini-batch); with stale data the ratios move away from 1
    and the clip starts cutting gradients: this is how a run sees what asynchrony costs."""

    def __init__(self) -> None:
        self._by: dict[int, dict[str, float]] = {}

    def add(self, staleness: Sequence[int], ratio: Any, clipped: Any, mask: Any) -> None:
        """One micro-batch: ``staleness`` per row; ``ratio`` (raw, before the delta cap),
        ``clipped`` and ``mask`` are (rows, tokens) tensors."""
        for row, s in enumerate(staleness):
            m = mask[row] > 0
            n = int(m.sum())
            r = ratio[row][m].double()
            acc = self._by.setdefault(
                s, {"rollouts": 0, "tokens": 0, "sum": 0.0, "dev": 0.0, "min": float("inf"), "max": 0.0, "clipped": 0}
            )
            acc["rollouts"] += 1
            if n == 0:
                continue
            acc["tokens"] += n
            acc["sum"] += float(r.sum())
            acc["dev"] += float((r - 1.0).abs().sum())
            acc["min"] = min(acc["min"], float(r.min()))
            acc["max"] = max(acc["max"], float(r.max()))
            acc["clipped"] += int((clipped[row] & m).sum())

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{"0": {rollouts, tokens, ratio_mean, ratio_dev, ratio_min, ratio_max, clip_fraction}, ...}``
        (string keys: the record goes to JSON)."""
        out = {}
        for s, a in sorted(self._by.items()):
            t = max(1, int(a["tokens"]))
            out[str(s)] = {
                "rollouts": int(a["rollouts"]),
                "tokens": int(a["tokens"]),
                "ratio_mean": a["sum"] / t,
                "ratio_dev": a["dev"] / t,  # mean |ratio - 1|
                "ratio_min": a["min"] if a["tokens"] else 1.0,
                "ratio_max": a["max"] if a["tokens"] else 1.0,
                "clip_fraction": a["clipped"] / t,
            }
        return out


def histogram(values: Sequence[float], bins: int = 10) -> list[int]:
    """Counts in ``bins`` equal bins spanning [min, max] (all in the first bin if they are equal)."""
    if not values:
        return [0] * bins
    lo, hi = min(values), max(values)
    counts = [0] * bins
    for v in values:
        i = 0 if hi == lo else min(bins - 1, int((v - lo) / (hi - lo) * bins))
        counts[i] += 1
    return counts


def reward_stats(rewards: Sequence[float], passed: Sequence[bool], lengths: Sequence[int]) -> dict[str, Any]:
    """The reward/length part of StepMetrics."""
    n = len(rewards)
    if n == 0:
        return {}
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    return {
        "reward_mean": mean,
        "reward_std": std,
        "reward_min": min(rewards),
        "reward_max": max(rewards),
        "reward_hist": histogram(rewards),
        "pass_rate": sum(1 for p in passed if p) / n,
        "length_mean": sum(lengths) / n,
        "length_min": min(lengths),
        "length_max": max(lengths),
    }
