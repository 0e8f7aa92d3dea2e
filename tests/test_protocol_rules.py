"""The rules every role applies alike (protocol/rules.py): the max_async window and the quorum outcome.

Workers, validators, the trainer and the checkpoint store all call these; an off-by-one
here would make them disagree about which rollouts count, so the edges are pinned.
"""

from __future__ import annotations

import pytest

from protocol.rules import Quorum, is_stale, quorum_outcome, window_floor, within_window

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
