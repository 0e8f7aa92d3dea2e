"""Deterministic prompt assignment."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from harness.strategies import PEER_IDS
from protocol import assign_prompts

RUN = b"R" * 32


def test_same_inputs_same_prompts():
    a = assign_prompts(RUN, PEER_IDS[0], 7, 1000, 16)
    assert a == assign_prompts(RUN, PEER_IDS[0], 7, 1000, 16)


def test_different_workers_counters_runs_differ():
    base = assign_prompts(RUN, PEER_IDS[0], 7, 10_000, 16)
    assert assign_prompts(RUN, PEER_IDS[1], 7, 10_000, 16) != base
    assert assign_prompts(RUN, PEER_IDS[0], 8, 10_000, 16) != base
    assert assign_prompts(b"S" * 32, PEER_IDS[0], 7, 10_000, 16) != base


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(PEER_IDS),
    st.integers(0, 2**31 - 1),
    st.integers(1, 5000),
    st.integers(1, 64),
)
def test_indices_within_dataset_and_distinct(worker, counter, size, count):
    idx = assign_prompts(RUN, worker, counter, size, count)
    assert len(idx) == min(size, count)
    assert len(set(idx)) == len(idx)
    assert all(0 <= i < size for i in idx)


def test_roughly_uniform():
    counts = [0] * 10
    for c in range(2000):
        for i in assign_prompts(RUN, PEER_IDS[0], c, 10, 1):
            counts[i] += 1
    assert min(counts) > 120 and max(counts) < 280  # 200 expected each
