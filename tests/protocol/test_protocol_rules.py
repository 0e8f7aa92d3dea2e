"""The rules every role applies alike (protocol/rules.py): the max_async window and the quorum outcome.

Workers, validators, the trainer and the checkpoint store all call these; an off-by-one
here would make them disagree about which rollouts count, so the edges are pinned.
"""

from __future__ import annotations

import pytest

from protocol.rules import Quorum, agreeing_validators, is_stale, quorum_outcome, window_floor, within_window

V = [f"validator-{i}" for i in range(5)]


# ------------------------------------------------------------------ the max_async window


def test_window_floor_is_newest_minus_max_async():
    assert window_floor(10, 2) == 8
    assert window_floor(10, 0) == 10
    assert window_floor(1, 2) == -1  # early in a run every version so far is inside


@pytest.mark.parametrize(
    "version, inside, stale",
    [
        (7, False, True),  # one below the floor
        (8, True, False),  # the floor itself
        (9, True, False),
        (10, True, False),  # the newest
        (11, False, False),  # ahead: not usable, but not stale either (the checkpoint may be in flight)
    ],
)
def test_window_edges(version, inside, stale):
    assert within_window(version, 10, 2) is inside
    assert is_stale(version, 10, 2) is stale


def test_synchronous_run_accepts_only_the_newest():
    assert within_window(10, 10, 0)
    assert not within_window(9, 10, 0) and is_stale(9, 10, 0)


# ------------------------------------------------------------------ quorum


def test_accepted_once_quorum_members_accept():
    assert quorum_outcome(V[:2], [], V, 3) is Quorum.PENDING
    assert quorum_outcome(V[:3], [], V, 3) is Quorum.ACCEPTED
    assert quorum_outcome(V[:3], V[3:], V, 3) is Quorum.ACCEPTED  # rejects do not undo a reached quorum


def test_rejected_once_quorum_can_no_longer_be_reached():
    # 5 validators, quorum 3: 2 rejects leave 3 possible accepts, 3 rejects leave 2
    assert quorum_outcome([], V[:2], V, 3) is Quorum.PENDING
    assert quorum_outcome([], V[:3], V, 3) is Quorum.REJECTED
    assert quorum_outcome(V[3:4], V[:3], V, 3) is Quorum.REJECTED


def test_pending_without_votes():
    assert quorum_outcome([], [], V, 3) is Quorum.PENDING


def test_votes_of_non_members_are_ignored():
    outsiders = ["worker-a", "worker-b", "worker-c", "worker-d"]
    assert quorum_outcome(outsiders, [], V, 3) is Quorum.PENDING
    assert quorum_outcome([], outsiders, V, 3) is Quorum.PENDING
    assert quorum_outcome([*V[:2], *outsiders], outsiders, V, 3) is Quorum.PENDING


def test_duplicate_votes_count_once():
    assert quorum_outcome([V[0], V[0], V[0]], [], V, 2) is Quorum.PENDING
    assert quorum_outcome([], [V[0]] * 4, V, 5) is Quorum.REJECTED  # one member, counted once, decides at quorum 5


def test_quorum_equal_to_validators_needs_everyone_and_one_reject_decides():
    assert quorum_outcome(V[:4], [], V, 5) is Quorum.PENDING
    assert quorum_outcome(V, [], V, 5) is Quorum.ACCEPTED
    assert quorum_outcome(V[:4], V[4:], V, 5) is Quorum.REJECTED
    assert quorum_outcome([], V[:1], V, 5) is Quorum.REJECTED


def test_single_validator():
    assert quorum_outcome(V[:1], [], V[:1], 1) is Quorum.ACCEPTED
    assert quorum_outcome([], V[:1], V[:1], 1) is Quorum.REJECTED
    assert quorum_outcome([], [], V[:1], 1) is Quorum.PENDING


# ------------------------------------------------------------------ reward agreement


def test_validators_with_equal_rewards_agree():
    same = {v: [1.0, 0.0, 0.25] for v in V[:3]}
    assert agreeing_validators(same, 1e-6) == set(V[:3])
    assert agreeing_validators({}, 1e-6) == frozenset()
    assert agreeing_validators({V[0]: []}, 0.0) == {V[0]}  # an empty batch: vacuously agreed


def test_agreement_is_within_the_tolerance_on_every_sample():
    close = {V[0]: [1.0, 0.0], V[1]: [1.0 + 1e-7, 0.0]}
    assert agreeing_validators(close, 1e-6) == {V[0], V[1]}
    assert agreeing_validators({V[0]: [0.0], V[1]: [0.5]}, 0.5) == {V[0], V[1]}  # the edge counts
    # one sample apart is enough to disagree: each alone (ties: the first id)
    apart = {V[0]: [1.0, 0.0], V[1]: [1.0, 1.0]}
    assert agreeing_validators(apart, 1e-6) == {V[0]}
    assert agreeing_validators(apart, 1.0) == {V[0], V[1]}  # a loose run tolerates it


def test_an_outlier_minority_does_not_break_an_agreeing_majority():
    honest = {v: [1.0, 0.0, 1.0] for v in V[:3]}
    outliers = {V[3]: [0.0, 0.0, 1.0], V[4]: [1.0, 1.0, 0.0]}
    assert agreeing_validators({**honest, **outliers}, 1e-6) == set(V[:3])
    assert agreeing_validators(honest, 1e-6) == set(V[:3])  # control: the same without the outliers


def test_agreement_is_pairwise_not_a_chain():
    # each neighbour is within 0.1 of the next, but the ends are 0.2 apart: no chain drift
    chain = {V[0]: [0.0], V[1]: [0.1], V[2]: [0.2]}
    assert agreeing_validators(chain, 0.1) == {V[0], V[1]}  # two equal pairs: the first ids
    # the middle one agrees with two others that agree with each other: the larger set wins
    assert agreeing_validators({**chain, V[3]: [0.15]}, 0.1) == {V[1], V[2], V[3]}


def test_reward_lists_of_other_lengths_and_non_finite_rewards_agree_with_nothing():
    rewards = {V[0]: [1.0, 1.0], V[1]: [1.0, 1.0], V[2]: [1.0], V[3]: [float("nan"), 1.0], V[4]: [float("inf")] * 2}
    assert agreeing_validators(rewards, 10.0) == {V[0], V[1]}
    assert agreeing_validators({V[3]: [float("nan"), 1.0]}, 10.0) == frozenset()  # not even with itself


def test_the_choice_does_not_depend_on_the_order_of_the_votes():
    rewards = {V[4]: [0.5], V[0]: [0.0], V[3]: [0.5], V[1]: [0.0], V[2]: [1.0]}
    assert agreeing_validators(rewards, 0.1) == {V[0], V[1]}  # two pairs of two: the first sorted ids
    assert agreeing_validators(dict(reversed(list(rewards.items()))), 0.1) == {V[0], V[1]}


def test_the_tolerance_must_not_be_negative():
    for bad in (-1e-9, float("nan")):
        with pytest.raises(ValueError, match="tolerance"):
            agreeing_validators({V[0]: [1.0]}, bad)
