"""Scoring a policy on problems: pass@k, confidence intervals, and the held-out split.

Pure functions (no I/O, no torch), shared by ``primenode eval``, the trainer's periodic
held-out evaluation and every node that loads a run's problems.

* ``pass_at_k(n, c, k)``: the unbiased estimator of Chen et al. (2021, "Evaluating Large
  Language Models Trained on Code"): from ``n`` samples of which ``c`` pass, the chance
  that at least one of ``k`` drawn without replacement passes, ``1 - C(n-c, k) / C(n, k)``,
  computed as a product (no big binomials). With ``k = 1`` it is ``c / n``.
* ``mean_interval(values)``: a 95 % interval of a mean over problems: Wilson's score
  interval when every value is 0 or 1 (one sample per problem), else the normal
  approximation over problems, clipped to [0, 1] when the scores lie there (problems are the independent units;
  samples of one problem are not independent of each other).
* ``paired_difference(a, b)``: the mean of ``b - a`` over the same problems and its 95 %
  interval: how two policies (version 0 and the last one) compare problem by problem,
  which is tighter than two separate intervals.
* ``heldout_indices(prompts, want, seed)``: which problems of a run's dataset are held out.
  The split is by *prompt text*: a prompt that occurs twice is on one side only, so no
  held-out problem was ever shown to a worker under another id. Prompts are ordered by
  ``sha256(domain | seed | prompt)`` and taken whole until at least ``want`` problems are
  held out; the count reached is what the genesis records (``heldout_size``), and greedy
  selection up to that count gives the same prompts back, so every node recomputes the
  split from the dataset and the genesis alone.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile
_SPLIT_DOMAIN = b"primenode/heldout/v1"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` passing (``k <= n``)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


def mean_interval(values: Sequence[float], z: float = Z95) -> tuple[float, float, float]:
    """(mean, low, high) of per-problem scores (pass rates in [0, 1], or mean rewards, which a
    length penalty or the target-length reward can take below 0)."""
    n = len(values)
    if n == 0:
        return (math.nan, math.nan, math.nan)
    mean = sum(values) / n
    if all(v in (0.0, 1.0) for v in values):
        denom = 1 + z * z / n
        centre = (mean + z * z / (2 * n)) / denom
        half = z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / denom
        return (mean, max(0.0, centre - half), min(1.0, centre + half))
    if n == 1:
        return (mean, 0.0, 1.0)
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    half = z * math.sqrt(var / n)
    # clipped to [0, 1] only when the scores live there (a length reward can be negative)
    lo = max(0.0, mean - half) if min(values) >= 0 else mean - half
    hi = min(1.0, mean + half) if max(values) <= 1 else mean + half
    return (mean, lo, hi)


def paired_difference(a: Sequence[float], b: Sequence[float], z: float = Z95) -> tuple[float, float, float]:
    """(mean of b - a, low, high) over paired problem scores (normal approximation)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired scores need two equal, non-empty lists, got {len(a)} and {len(b)}")
    d = [y - x for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    if n == 1:
        return (mean, -1.0, 1.0)
    var = sum((v - mean) ** 2 for v in d) / (n - 1)
    half = z * math.sqrt(var / n)
    return (mean, mean - half, mean + half)


def _prompt_key(seed: int, prompt: str) -> bytes:
    h = hashlib.sha256(_SPLIT_DOMAIN)
    h.update(str(int(seed)).encode() + b"\n")
    h.update(prompt.encode())
    return h.digest()


def heldout_indices(prompts: Sequence[str], want: int, seed: int = 0) -> list[int]:
    """Indices (ascending) of the held-out problems: whole prompts in hash order until at
    least ``want`` problems are held out (more only when the last prompt taken repeats).
    Raises ValueError when the held-out split would leave no training problem."""
    if want < 0:
        raise ValueError(f"held-out size must be >= 0, got {want}")
    if want == 0:
        return []
    by_prompt: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_prompt.setdefault(p, []).append(i)
    chosen: list[int] = []
    for prompt in sorted(by_prompt, key=lambda p: _prompt_key(seed, p)):
        if len(chosen) >= want:
            break
        chosen += by_prompt[prompt]
    if len(chosen) < want or len(chosen) >= len(prompts):
        raise ValueError(
            f"a held-out split of {want} problems leaves no training problem "
            f"({len(prompts)} problems, {len(by_prompt)} distinct prompts)"
        )
    return sorted(chosen)
