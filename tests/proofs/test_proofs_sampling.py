"""Seeded Gumbel-max sampling (proofs/sampling.py): the generator, the sampler and the replay.

The Philox4x32-10 known-answer vectors are Random123's (Salmon et al., SC'11); the limb
arithmetic is checked against a plain-integer implementation; the sampler is checked to
be exact (pruning changes nothing), batch-independent, faithful to the softmax, and to
respect the top-k / top-p support; the replay finds honest tokens and names the first
token that is not the seeded sample.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from proofs.sampling import (
    G_MAX,
    G_MIN,
    completion_logits,
    gumbel,
    gumbel_dense,
    philox4x32,
    philox4x32_reference,
    replay,
    scaled_logits,
    seeded_choice,
    uniform_words,
)
from protocol.messages import SamplingParams

U32 = st.integers(min_value=0, max_value=2**32 - 1)


@pytest.mark.parametrize(
    "counter, key, expected",
    [
        ([0, 0, 0, 0], [0, 0], (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
            [0xA4093822, 0x299F31D0],
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
    ids=["zeros", "ones", "pi"],
)
def test_philox_known_answers(counter, key, expected):
    assert philox4x32_reference(counter, key) == expected
    got = philox4x32(*(torch.tensor([x]) for x in counter + key))
    assert tuple(int(x) for x in got) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(U32, min_size=4, max_size=4), st.lists(U32, min_size=2, max_size=2))
def test_limb_arithmetic_equals_plain_integers(counter, key):
    got = philox4x32(*(torch.tensor([x]) for x in counter + key))
    assert tuple(int(x) for x in got) == philox4x32_reference(counter, key)


def test_noise_is_the_same_dense_sparse_and_in_any_batch():
    seeds = torch.tensor([0, 1, 2**62 + 12345, 2**63 - 1])
    pos = torch.tensor([0, 7, 100, 2**31])
    dense = gumbel_dense(seeds, pos, 1003)
    sparse = gumbel(seeds[:, None], pos[:, None], torch.arange(1003)[None, :])
    assert torch.equal(dense, sparse)
    assert torch.equal(gumbel_dense(seeds[2:3], pos[2:3], 1003), dense[2:3])
    assert float(dense.min()) >= G_MIN and float(dense.max()) <= G_MAX
    assert not torch.equal(dense[0], dense[1])


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), min_size=1, max_size=4),
    st.integers(min_value=0, max_value=2**32 - 1),
    st.integers(min_value=1, max_value=70),
)
def test_native_philox_rows_equal_the_torch_limbs(seeds, position, vocab):
    """randomgen's compiled Philox (the CPU fast path for whole rows) gives the limbs' bits,
    for negative int64 seeds (the top bit of a 64-bit seed), positions up to 2**32 - 1 and
    vocabularies that are not a multiple of four."""
    from proofs import sampling

    s = torch.tensor(seeds)
    p = torch.full((len(seeds),), position)
    assert torch.equal(sampling._native_words(seeds, p.tolist(), vocab), sampling._torch_words(s, p, vocab))


def test_uniform_words_look_uniform():
    words = uniform_words(torch.tensor(42), torch.arange(64)[:, None], torch.arange(4096)[None, :]).flatten()
    u = (words.double() + 0.5) / 2**32
    assert abs(float(u.mean()) - 0.5) < 0.005
    hist = torch.histc(u.float(), bins=16, min=0, max=1)
    assert float(hist.min()) > 0.9 * len(u) / 16 and float(hist.max()) < 1.1 * len(u) / 16


def test_pruning_is_exact():
    """Only tokens that can still win get noise; the argmax equals the full draw's."""
    params = SamplingParams(temperature=0.8)
    gen = torch.Generator().manual_seed(0)
    for scale in (0.5, 3.0, 30.0):
        logits = torch.randn(32, 5000, generator=gen) * scale
        seeds, pos = torch.arange(32) * 977, torch.arange(32) % 5
        full = (scaled_logits(logits, params) + gumbel_dense(seeds, pos, 5000)).argmax(-1)
        assert torch.equal(seeded_choice(logits, seeds, pos, params), full)


def test_a_row_samples_the_same_alone_or_in_a_batch():
    params = SamplingParams(temperature=1.0, top_p=0.9)
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(1))
    seeds, pos = list(range(100, 108)), [3] * 8
    batch = seeded_choice(logits, seeds, pos, params)
    alone = torch.stack(
        [seeded_choice(logits[i : i + 1], seeds[i : i + 1], pos[i : i + 1], params)[0] for i in range(8)]
    )
    assert torch.equal(batch, alone)


def test_samples_follow_the_softmax():
    """Gumbel-max draws token v with probability softmax(logits / T)_v (over many seeds)."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 1.5])
    params = SamplingParams(temperature=0.7)
    n = 20000
    draws = seeded_choice(logits.expand(n, -1), torch.arange(n), torch.zeros(n, dtype=torch.int64), params)
    freq = torch.bincount(draws, minlength=6).double() / n
    want = torch.softmax(logits.double() / 0.7, dim=-1)
    assert torch.allclose(freq, want, atol=0.012), (freq, want)


def test_support_top_k_top_p_and_greedy():
    logits = torch.tensor([[3.0, 2.9, 2.8, -5.0, -6.0, 2.7]])
    n = 2000
    rows = logits.expand(n, -1)
    seeds, pos = torch.arange(n), torch.zeros(n, dtype=torch.int64)
    top2 = set(seeded_choice(rows, seeds, pos, SamplingParams(temperature=5.0, top_k=2)).tolist())
    assert top2 == {0, 1}
    nucleus = set(seeded_choice(rows, seeds, pos, SamplingParams(temperature=1.0, top_p=0.5)).tolist())
    assert nucleus <= {0, 1} and 0 in nucleus
    assert set(seeded_choice(rows, seeds, pos, SamplingParams(temperature=0.0)).tolist()) == {0}
    x = scaled_logits(logits, SamplingParams(temperature=2.0, top_k=3))
    assert torch.isinf(x[0, 3:5]).all() and math.isinf(float(x[0, 5]))


def _honest(logits: torch.Tensor, seed: int, params: SamplingParams) -> list[int]:
    n = logits.shape[0]
    return seeded_choice(logits, [seed] * n, list(range(n)), params).tolist()


def test_replay_accepts_the_seeded_tokens_and_names_the_first_other_one():
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(20, 50, generator=torch.Generator().manual_seed(2)) * 2
    tokens = _honest(logits, 77, params)
    ok = replay(logits, tokens, 77, params, max_tie_gap=1e-3)
    assert ok.ok(0) and ok.max_gap == 0 and ok.best_tokens == tuple(tokens)
    other_seed = replay(logits, tokens, 78, params, max_tie_gap=1e-3)
    assert not other_seed.ok(0) and other_seed.first_bad >= 0
    edited = list(tokens)
    edited[5] = (edited[5] + 1) % 50
    bad = replay(logits, edited, 77, params, max_tie_gap=1e-3)
    assert bad.first_bad == 5 and bad.gaps[5] > 1e-3 and bad.best_tokens[5] == tokens[5]


def test_near_ties_within_delta_are_counted_and_bounded():
    """A worker on another numerics stack may flip a near-tie: the gap is small, tolerated
    up to ``max_near_ties`` per completion."""
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    tokens = _honest(logits, 5, params)
    # the validator's logits differ a little: find the runner-up at position 2 and make it a near-tie
    s = scaled_logits(logits, params) + gumbel_dense(torch.full((6,), 5), torch.arange(6), 40)
    runner = int(s[2].topk(2).indices[1])
    shifted = logits.clone()
    shifted[2, runner] += float(s[2, tokens[2]] - s[2, runner]) + 0.01  # runner-up now wins by 0.01
    r = replay(shifted, tokens, 5, params, max_tie_gap=0.05)
    assert r.first_bad < 0 and r.near_ties == 1 and r.ok(1) and not r.ok(0)
    assert replay(shifted, tokens, 5, params, max_tie_gap=0.001).first_bad == 2


def test_relative_gaps_are_in_units_of_each_rows_logit_scale():
    """Cross-stack replay: the gap divided by the row's std of logits / T (numerics errors
    between stacks grow with the logits' magnitude, so an absolute delta cannot fit a model
    whose logits are 100x smaller or larger)."""
    params = SamplingParams(temperature=0.7)
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(12, 300, generator=gen)
    tokens = _honest(logits, 11, params)
    edited = list(tokens)
    edited[3] = (edited[3] + 7) % 300
    for scale in (0.05, 5.0):
        shown = logits * scale
        absolute = replay(shown, edited, 11, params, max_tie_gap=1e9)
        relative = replay(shown, edited, 11, params, max_tie_gap=1e9, relative=True)
        row_scale = shown.double().std(dim=-1) / params.temperature
        for k in range(12):
            assert relative.gaps[k] == pytest.approx(absolute.gaps[k] / float(row_scale[k]), rel=1e-12)
    assert replay(logits, tokens, 11, params, max_tie_gap=1e-3, relative=True).max_gap == 0  # honest: still exact


def test_a_token_outside_the_support_is_never_within_delta():
    params = SamplingParams(temperature=1.0, top_k=1)
    logits = torch.tensor([[5.0, 4.9, 0.0]])
    assert replay(logits, [0], 1, params, max_tie_gap=10.0).ok(0)
    r = replay(logits, [1], 1, params, max_tie_gap=10.0)
    assert r.first_bad == 0 and math.isinf(r.gaps[0])


def test_completion_logits_rows_predict_each_completion_token():
    hidden = torch.randn(7, 4)  # 3 prompt rows + 4 completion rows
    head = torch.randn(10, 4)
    got = completion_logits(hidden, 3, head)
    assert got.shape == (4, 10)
    assert torch.allclose(got[0], head @ hidden[2]) and torch.allclose(got[3], head @ hidden[5])
