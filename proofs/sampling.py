"""Seeded Gumbel-max sampling, and its replay by a validator.

TOPLOC proves that hidden states came from the claimed weights for the claimed
tokens; it says nothing about whether those tokens were *sampled* by the model.
Seeded sampling closes that gap: a worker draws every completion token as

    argmax over the support of  logits / T + g

where ``g`` is Gumbel noise from a counter-based generator keyed by the
per-sample seed (``protocol.seeds.sample_seed``) and the token's position in the
completion. A validator derives the same seed, recomputes the logits from the
final hidden states of the prefill it already runs, regenerates the same noise
and checks that every claimed token is the argmax, up to a tolerance ``max_tie_gap``
for the numerics noise between two machines.

The generator is Philox4x32-10 (Salmon et al., SC'11; the generator behind
cuRAND, JAX and torch's CUDA RNG), written with 16-bit limbs so that every
intermediate fits a signed int64: the integer stream is bit-identical on any
device and any batch shape. The float transform ``-log(-log(u))`` runs in
float64; two devices' ``log`` may differ in the last ulp (~1e-16), far below
any ``max_tie_gap``.

Counter layout for vocabulary entry ``v`` at completion position ``p``:
``(v // 4, p, DOMAIN, 0)`` with key ``(seed & 0xffffffff, seed >> 32)``; the
entry takes output word ``v % 4``; ``u = (word + 0.5) / 2**32``.

Only tokens that can still win are given noise: Gumbel noise from 32-bit
uniforms lies in ``[G_MIN, G_MAX]``, so once the noise of the top-scored token is
known, a token whose scaled logit is more than ``G_MAX - g_top`` below the top
cannot be the argmax. The pruning is exact: the result equals the full draw.

torch only; no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence

import numpy as np
import torch

from protocol.messages import SamplingParams

try:  # the same Philox4x32-10 as a compiled loop: ~10x faster noise for whole rows on the CPU
    from randomgen import Philox as _NativePhilox
except ImportError:  # pragma: no cover - randomgen is a dependency; the torch limbs still work
    _NativePhilox = None

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF
_MASK64 = (1 << 64) - 1
ROUNDS = 10
DOMAIN = 0x50524E31  # "PRN1": the third counter word, so other streams never collide with this one

# Bounds of the noise: u ranges over (0.5 / 2**32, 1 - 0.5 / 2**32).
G_MIN = -math.log(-math.log(0.5 / 2**32))
G_MAX = -math.log(-math.log1p(-0.5 / 2**32))


# ---------------------------------------------------------------- Philox4x32-10


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``m * x`` for a 32-bit constant ``m`` and int64
    tensor ``x`` of 32-bit values, with every intermediate below 2**50."""
    m1, m0 = m >> 16, m & _MASK16
    x1, x0 = x >> 16, x & _MASK16
    lo0 = x0 * m0  # < 2**32
    mid = x1 * m0 + x0 * m1  # < 2**33
    low = lo0 + ((mid & _MASK16) << 16)  # < 2**34
    hi = x1 * m1 + (mid >> 16) + (low >> 32)
    return hi & _MASK32, low & _MASK32


def philox4x32(
    c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, k0: torch.Tensor, k1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 on int64 tensors holding 32-bit words (broadcast together)."""
    for r in range(ROUNDS):
        if r:
            k0 = (k0 + _W0) & _MASK32
            k1 = (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox4x32_reference(counter: Sequence[int], key: Sequence[int]) -> tuple[int, int, int, int]:
    """The same generator on Python integers (the test oracle for the limb arithmetic)."""
    c = [int(x) & _MASK32 for x in counter]
    k0, k1 = (int(x) & _MASK32 for x in key)
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        p0, p1 = _M0 * c[0], _M1 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & _MASK32, (p0 >> 32) ^ c[3] ^ k1, p0 & _MASK32]
    return c[0], c[1], c[2], c[3]


def uniform_words(seeds: torch.Tensor, positions: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """The 32-bit word of each (seed, position, vocabulary id), int64, broadcast together."""
    seeds = seeds.to(torch.int64)
    k0, k1 = seeds & _MASK32, (seeds >> 32) & _MASK32
    block = vocab_ids.to(torch.int64) >> 2
    pos = positions.to(torch.int64) & _MASK32
    zero = torch.zeros_like(k0 + pos + block)  # the broadcast shape
    words = philox4x32(block + zero, pos + zero, zero + DOMAIN, zero, k0 + zero, k1 + zero)
    lane = (vocab_ids.to(torch.int64) & 3) + zero
    out = torch.where(lane == 0, words[0], words[1])
    out = torch.where(lane == 2, words[2], out)
    return torch.where(lane == 3, words[3], out)


def gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise (float64) for each (seed, position, vocabulary id), broadcast together."""
    u = (uniform_words(seeds, positions, vocab_ids).to(torch.float64) + 0.5) * 2.0**-32
    return -torch.log(-torch.log(u))


# ---------------------------------------------------------------- the support


def scaled_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits / T`` in float64 with -inf outside the top-k / top-p support (rows on the last
    axis). The nucleus is measured on the temperature-scaled distribution and always keeps
    the most likely token; ``top_k`` 0 means no top-k cut."""
    x = logits.to(torch.float64)
    if params.temperature > 0:
        x = x / params.temperature
    top_k = getattr(params, "top_k", 0)
    if top_k and top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        p = torch.softmax(sorted_x, dim=-1)
        drop = (p.cumsum(-1) - p) > params.top_p
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, -math.inf))
    return x


def gumbel_dense(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Noise for every vocabulary id of each row (B, vocab), one Philox call per four ids.

    On the CPU the words of long rows come from randomgen's Philox4x32-10 (a compiled loop;
    the counter layout makes a row's words one consecutive stream; ~7x faster from 2,048
    ids, even below: a generator costs ~20 us to set up), elsewhere from the torch limbs;
    tests/proofs/test_proofs_sampling.py checks that both give the same bits."""
    if seeds.device.type == "cpu" and _NativePhilox is not None and vocab >= 1024:
        words = _native_words(seeds.reshape(-1).tolist(), positions.reshape(-1).tolist(), vocab)
    else:
        words = _torch_words(seeds, positions, vocab)
    # gumbel()'s arithmetic, in place: these rows are the replay's largest tensors
    return words.to(torch.float64).add_(0.5).mul_(2.0**-32).log_().neg_().log_().neg_()


def _torch_words(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    blocks = torch.arange((vocab + 3) // 4, dtype=torch.int64, device=seeds.device)[None, :]
    seeds = seeds.to(torch.int64)[:, None]
    k0, k1 = seeds & _MASK32, (seeds >> 32) & _MASK32
    pos = (positions.to(torch.int64) & _MASK32)[:, None]
    zero = torch.zeros((seeds.shape[0], blocks.shape[1]), dtype=torch.int64, device=seeds.device)
    words = torch.stack(philox4x32(blocks + zero, pos + zero, zero + DOMAIN, zero, k0 + zero, k1 + zero), dim=-1)
    return words.reshape(seeds.shape[0], -1)[:, :vocab]


def _native_words(seeds: Sequence[int], positions: Sequence[int], vocab: int) -> torch.Tensor:
    """Row ``i``'s words from counters ``(0.., positions[i], DOMAIN, 0)`` under key ``seeds[i]``.
    randomgen increments the 128-bit counter before each block, so it starts one below."""
    assert _NativePhilox is not None
    width = (vocab + 3) // 4 * 4
    out = np.empty((len(seeds), width), dtype=np.uint64)
    for i, (seed, pos) in enumerate(zip(seeds, positions)):
        start = ((DOMAIN << 64) | ((int(pos) & _MASK32) << 32)) - 1
        out[i] = _NativePhilox(number=4, width=32, key=int(seed) & _MASK64, counter=start).random_raw(width)
    return torch.from_numpy(out.view(np.int64)[:, :vocab])  # 32-bit values: the same bits


def _scores(
    scaled: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, extra: torch.Tensor | None = None
) -> torch.Tensor:
    """``scaled + g`` where a token can still win (and at the ``extra`` ids); elsewhere -inf, or
    the true score when noise was drawn for whole rows (it cannot win either way).

    Rows of ``scaled`` are (B, V); ``seeds``/``positions`` are (B,); ``extra`` (B,) ids
    whose score is always computed (the claimed tokens, for a validator). Noise is drawn
    per element when few tokens can win, else for whole rows (four ids per Philox call)."""
    b, vocab = scaled.shape
    rows = torch.arange(b, device=scaled.device)
    top = scaled.argmax(dim=-1)
    g_top = gumbel(seeds, positions, top)
    floor = scaled[rows, top] + g_top - G_MAX
    live = scaled >= floor[:, None]
    if extra is not None:
        live[rows, extra] = True
    # whole rows once more than a 16th (native words) or a 4th (torch limbs) can win: per element
    # the limbs cost ~15x a native word (a Philox block per id instead of per four ids); the
    # dense scores are the true ones everywhere (-inf stays -inf outside the support)
    dense_above = 16 if scaled.device.type == "cpu" and _NativePhilox is not None else 4
    if int(live.count_nonzero()) * dense_above > b * vocab:
        return gumbel_dense(seeds, positions, vocab).add_(scaled)
    r, v = live.nonzero(as_tuple=True)
    out = torch.full_like(scaled, -math.inf)
    out[r, v] = scaled[r, v] + gumbel(seeds[r], positions[r], v)
    return out


def seeded_choice(
    logits: torch.Tensor,
    seeds: Sequence[int] | torch.Tensor,
    positions: Sequence[int] | torch.Tensor,
    params: SamplingParams,
) -> torch.Tensor:
    """The token each row of ``logits`` (B, V) samples at its completion position: the argmax
    of the scaled logits plus the row's seeded noise over the support. Temperature 0 is plain
    argmax (no noise)."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    device = logits.device
    seeds_t = torch.as_tensor(seeds, dtype=torch.int64, device=device).reshape(-1)
    pos_t = torch.as_tensor(positions, dtype=torch.int64, device=device).reshape(-1)
    return _scores(scaled_logits(logits, params), seeds_t, pos_t).argmax(dim=-1)


# ---------------------------------------------------------------- replay


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    """A validator's replay of one completion. ``gaps[k]`` is how far the claimed token's
    score at position ``k`` is below the best score in the support (0 when it is the argmax;
    inf when it is outside the support), in score units, or with ``relative`` replay in
    units of the row's scale (the standard deviation of its logits / T). ``first_bad`` is
    the first position whose gap exceeds ``max_tie_gap``, or -1; ``near_ties`` counts positions
    with 0 < gap <= max_tie_gap."""

    gaps: tuple[float, ...]
    first_bad: int
    near_ties: int
    best_tokens: tuple[int, ...]

    @property
    def max_gap(self) -> float:
        return max(self.gaps, default=0.0)

    def ok(self, allowed_near_ties: int) -> bool:
        return self.first_bad < 0 and self.near_ties <= allowed_near_ties


def replay(
    logits: torch.Tensor,
    tokens: Sequence[int],
    seed: int,
    params: SamplingParams,
    max_tie_gap: float,
    *,
    relative: bool = False,
) -> ReplayResult:
    """Check that each claimed token is the seeded argmax. ``logits`` (L, V): row ``k`` is
    the distribution the model gives for completion position ``k`` (computed from the hidden
    state of the token before it)."""
    return replay_many([logits], [tokens], [seed], params, max_tie_gap, relative=relative)[0]


def replay_many(
    logits: Sequence[torch.Tensor],
    tokens: Sequence[Sequence[int]],
    seeds: Sequence[int],
    params: SamplingParams,
    max_tie_gap: float,
    *,
    relative: bool = False,
) -> list[ReplayResult]:
    """:func:`replay` of several completions at once (one noise draw for all their rows).

    ``relative``: gaps are divided by each row's scale, the standard deviation of its
    temperature-scaled logits over the whole vocabulary. Two numerics stacks differ in
    proportion to the logits' magnitude, and so does the miss of a token from another
    source, so one relative ``max_tie_gap`` fits models whose logits differ in scale by 100x
    (docs/proofs.md, "Calibration"); an absolute one cannot."""
    lengths = [len(t) for t in tokens]
    for rows, n in zip(logits, lengths):
        if rows.shape[0] != n:
            raise ValueError(f"{rows.shape[0]} logit rows for {n} tokens")
    if sum(lengths) == 0:
        return [ReplayResult((), -1, 0, ()) for _ in tokens]
    x = torch.cat([rows for rows, n in zip(logits, lengths) if n])
    device = x.device
    claimed = torch.tensor([int(t) for toks in tokens for t in toks], dtype=torch.int64, device=device)
    seed_rows = torch.tensor(
        [int(s) for s, n in zip(seeds, lengths) for _ in range(n)], dtype=torch.int64, device=device
    )
    positions = torch.tensor([k for n in lengths for k in range(n)], dtype=torch.int64, device=device)
    rows = torch.arange(x.shape[0], device=device)
    if params.temperature == 0:
        x64 = x.to(torch.float64)
        best = x64.argmax(dim=-1)
        gaps = x64[rows, best] - x64[rows, claimed]
    else:
        scaled = scaled_logits(x, params)
        scores = _scores(scaled, seed_rows, positions, extra=claimed)
        best = scores.argmax(dim=-1)
        inside = scaled[rows, claimed] > -math.inf
        gaps = torch.where(inside, scores[rows, best] - scores[rows, claimed], torch.full_like(scores[:, 0], math.inf))
    if relative:
        scale = x.to(torch.float64).std(dim=-1) / (params.temperature if params.temperature > 0 else 1.0)
        gaps = gaps / scale.clamp_min(1e-12)
    all_gaps = [max(0.0, float(g)) for g in gaps.tolist()]
    all_best = [int(t) for t in best.tolist()]
    out, start = [], 0
    for n in lengths:
        gap_list, best_list = all_gaps[start : start + n], all_best[start : start + n]
        start += n
        bad = next((k for k, gap in enumerate(gap_list) if gap > max_tie_gap), -1)
        ties = sum(1 for gap in gap_list if 0 < gap <= max_tie_gap)
        out.append(ReplayResult(tuple(gap_list), bad, ties, tuple(best_list)))
    return out


def completion_logits(hidden: torch.Tensor, prompt_len: int, lm_head: torch.Tensor) -> torch.Tensor:
    """The logits that sampled each completion token, from a prefill's final hidden states
    (prompt + completion rows): row ``prompt_len - 1 + k`` predicts completion token ``k``.
    ``lm_head`` is the (V, H) output matrix; the product runs in its dtype, returned float32."""
    rows = hidden[prompt_len - 1 : hidden.shape[0] - 1]
    return (rows.to(lm_head.dtype) @ lm_head.T).float()


def eos_positions(tokens: Sequence[int], eos_ids: Collection[int]) -> list[int]:
    return [k for k, t in enumerate(tokens) if t in eos_ids]
