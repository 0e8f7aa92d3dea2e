"""Validator committees (protocol/committee.py): who verifies a batch, and when its votes decide.

Each adversarial case sits beside the honest run it must not change: a dead member, a lying
member, members whose rewards disagree, colluders outside the committee, and a worker that
tries its slots for a friendlier committee."""

from __future__ import annotations

import collections
import itertools

import pytest

from protocol import ProtocolError
from protocol.committee import (
    Ballot,
    CommitteeRule,
    check_committee,
    committee_order,
    committee_seed,
    default_committee,
)
from protocol.rules import Quorum

RUN = b"r" * 32
ROOT = b"m" * 32
VALIDATORS = [f"12D3KooValidator{i:02d}" for i in range(10)]
GOOD = Ballot(True, (1.0, 0.0))
BAD_REWARDS = Ballot(True, (0.0, 0.0))
NO = Ballot(False)


def rule(size: int = 2, quorum: int = 2, deadline: float = 60.0) -> CommitteeRule:
    return CommitteeRule(size, quorum, deadline, 1e-6)


def test_the_order_is_a_permutation_fixed_by_every_field_of_the_slot():
    seed = committee_seed(RUN, "w", 3, 7, ROOT)
    order = committee_order(VALIDATORS, seed)
    assert sorted(order) == sorted(VALIDATORS) and committee_order(reversed(VALIDATORS), seed) == order
    others = [
        committee_seed(b"s" * 32, "w", 3, 7, ROOT),
        committee_seed(RUN, "x", 3, 7, ROOT),
        committee_seed(RUN, "w", 4, 7, ROOT),
        committee_seed(RUN, "w", 3, 8, ROOT),
        committee_seed(RUN, "w", 3, 7, b"n" * 32),
    ]
    assert len({seed, *others}) == 6  # each field moves the draw


def test_every_validator_sits_on_about_its_share_of_committees():
    """Over 3,000 slots each of 10 validators is first in the order 300 +- 25 % of the time and
    on a committee of 3 about 900 times: the draw favours nobody (a fixed set of slots, so
    this cannot flake)."""
    first: collections.Counter[str] = collections.Counter()
    on: collections.Counter[str] = collections.Counter()
    for worker, counter in itertools.product(("a", "b", "c"), range(1000)):
        order = committee_order(VALIDATORS, committee_seed(RUN, worker, 1, counter, ROOT))
        first[order[0]] += 1
        on.update(order[:3])
    assert all(225 <= first[v] <= 375 for v in VALIDATORS), first
    assert all(750 <= on[v] <= 1050 for v in VALIDATORS), on


def test_an_honest_committee_decides_alone_control():
    order = VALIDATORS[:5]
    d = rule(3, 2).outcome(order, {order[0]: GOOD, order[1]: GOOD}, 0.0, 2)
    assert (d.outcome, d.reach, d.agreeing) == (Quorum.ACCEPTED, 3, frozenset(order[:2]))
    d = rule(3, 2).outcome(order, {order[0]: NO, order[2]: NO}, 0.0, 2)
    assert (d.outcome, d.reach) == (Quorum.REJECTED, 3)


def test_a_dead_member_is_replaced_after_the_deadline():
    order = VALIDATORS[:4]
    r = rule(2, 2, deadline=60.0)
    votes = {order[0]: GOOD}
    assert r.outcome(order, votes, 59.9, 2).outcome is Quorum.PENDING
    assert r.reach(order, votes, 59.9, 2) == 2
    assert r.reach(order, votes, 60.0, 2) == 3  # the next validator in the order is called on
    early = r.outcome(order, {**votes, order[2]: GOOD}, 30.0, 2)
    assert early.outcome is Quorum.PENDING, "a vote from beyond the reach counts only once reached"
    assert r.outcome(order, {**votes, order[2]: GOOD}, 60.0, 2).outcome is Quorum.ACCEPTED
    # the whole committee dead: one more validator per deadline, never lost
    assert [r.reach(order, {}, t, 2) for t in (0, 60, 120, 180, 600)] == [2, 3, 4, 4, 4]


def test_a_lying_member_calls_the_next_validator_at_once_and_decides_nothing_alone():
    order = VALIDATORS[:4]
    r = rule(2, 2)
    lie = {order[0]: GOOD, order[1]: NO}  # honest batch, the second member lies
    d = r.outcome(order, lie, 0.0, 2)
    assert (d.outcome, d.reach) == (Quorum.PENDING, 3)
    assert r.outcome(order, {**lie, order[2]: GOOD}, 0.0, 2).outcome is Quorum.ACCEPTED
    lie = {order[0]: NO, order[1]: GOOD}  # a bad batch, the second member lies for it
    assert r.outcome(order, {**lie, order[2]: NO}, 0.0, 2).outcome is Quorum.REJECTED


def test_members_whose_rewards_disagree_call_the_next_and_the_agreeing_pair_decides():
    order = VALIDATORS[:4]
    r = rule(2, 2)
    split = {order[0]: GOOD, order[1]: BAD_REWARDS}
    d = r.outcome(order, split, 0.0, 2)
    assert (d.outcome, d.reach) == (Quorum.PENDING, 3)
    d = r.outcome(order, {**split, order[2]: GOOD}, 0.0, 2)
    assert (d.outcome, d.agreeing) == (Quorum.ACCEPTED, frozenset({order[0], order[2]}))
    # everyone disagrees with everyone: rejected once no agreeing quorum can form
    worse = {v: Ballot(True, (float(i), 0.0)) for i, v in enumerate(order)}
    assert r.outcome(order, worse, 0.0, 2).outcome is Quorum.REJECTED


def test_colluders_outside_the_committee_cannot_decide_a_batch():
    """Two colluders at places 3 and 4 vote to accept a bad batch at once; the honest committee
    rejects it. Control: without the committee (every validator), two accepts would have won."""
    order = VALIDATORS[:5]
    votes = {order[3]: GOOD, order[4]: GOOD}
    assert rule(2, 2).outcome(order, votes, 0.0, 2).outcome is Quorum.PENDING
    assert rule(2, 2).outcome(order, {**votes, order[0]: NO, order[1]: NO}, 0.0, 2).outcome is Quorum.REJECTED
    assert rule(0, 2).outcome(order, votes, 0.0, 2).outcome is Quorum.ACCEPTED


@pytest.mark.parametrize("validators", [3, 4, 5, 7])
def test_one_liar_anywhere_in_the_order_never_changes_the_outcome(validators):
    """Every committee size with a quorum of two or more, every place the liar can hold, both
    truths, the liar voting against the truth or (honest batch) with wrong rewards, dead or
    alive members besides: playing votes in the order the rule calls validators, the outcome is
    the truth. One dead or lying validator delays a batch; it never admits or loses it."""
    order = tuple(VALIDATORS[:validators])
    for size in range(2, validators):
        q = size // 2 + 1
        if q < 2:
            continue
        r = rule(size, q, deadline=10.0)
        for liar, truth, lie in itertools.product(range(validators), (True, False), ("flip", "rewards")):
            if lie == "rewards" and not truth:
                continue
            honest = GOOD if truth else NO
            lying = (NO if truth else GOOD) if lie == "flip" else BAD_REWARDS
            votes: dict[str, Ballot] = {}
            t = 0.0
            for _ in range(100):
                d = r.outcome(order, votes, t, 2)
                if d.outcome is not Quorum.PENDING:
                    break
                for v in order[: d.reach]:
                    votes.setdefault(v, lying if v == order[liar] else honest)
                t += 1.0
            assert d.outcome is (Quorum.ACCEPTED if truth else Quorum.REJECTED), (size, liar, truth, lie)
            # a silent liar instead: only time moves the batch on
            votes, t = {}, 0.0
            for _ in range(100):
                d = r.outcome(order, votes, t, 2)
                if d.outcome is not Quorum.PENDING:
                    break
                for v in order[: d.reach]:
                    if v != order[liar]:
                        votes.setdefault(v, honest)
                t += 1.0
            assert d.outcome is (Quorum.ACCEPTED if truth else Quorum.REJECTED), (size, liar, truth, "silent")


def test_without_committees_the_rule_is_the_all_validators_rule_control():
    """Size 0 (or at least the number of validators): every validator is called on from the
    start, and a batch is rejected once no quorum of accepts is possible, as before committees."""
    order = VALIDATORS[:3]
    for size in (0, 3, 5):
        r = rule(size, 2)
        assert r.reach(order, {}, 0.0, 2) == 3
        assert r.outcome(order, {order[0]: NO}, 0.0, 2).outcome is Quorum.PENDING
        assert r.outcome(order, {order[0]: NO, order[2]: NO}, 0.0, 2).outcome is Quorum.REJECTED
        assert r.outcome(order, {order[1]: GOOD, order[2]: GOOD}, 0.0, 2).outcome is Quorum.ACCEPTED


def test_a_worker_choosing_among_its_slots_sees_few_committees():
    """What a worker can do about its committee: its counters run in order (one chain per
    worker), and the announce must match the signed batch, so its only choice for counter c is
    the policy version inside the window (max_async + 1 of them) it generates with. With one
    colluder among 10 validators and committees of 3, the colluder sits on a given slot's
    committee about 30 % of the time and on at least one of 3 choices about 66 %; but a quorum
    of 2 needs a second colluder on the same committee (about 7 % of slots with 2 colluders),
    docs/security.md "Committees"."""
    colluders = set(VALIDATORS[:2])
    friendly_one = friendly_two = any_of_three = 0
    slots = 3000
    for counter in range(slots):
        choices = [committee_order(VALIDATORS, committee_seed(RUN, "w", v, counter, ROOT))[:3] for v in (5, 6, 7)]
        friendly_one += VALIDATORS[0] in choices[0]
        friendly_two += len(colluders & set(choices[0])) >= 2
        any_of_three += any(len(colluders & set(c)) >= 2 for c in choices)
    assert 0.25 < friendly_one / slots < 0.35
    assert 0.04 < friendly_two / slots < 0.10  # C(8,1)/C(10,3) = 8/120
    assert 0.12 < any_of_three / slots < 0.26  # 1 - (1 - 1/15) ** 3 = 0.19


def test_a_committee_smaller_than_the_quorum_is_refused_naming_the_fix():
    with pytest.raises(ProtocolError, match="committee_size 2 is smaller than the quorum 3"):
        check_committee(2, 3, 10)
    check_committee(3, 2, 10)  # control
    check_committee(0, 6, 10)  # every validator
    check_committee(2, 3, 2)  # a committee at least as large as the set: every validator
    assert default_committee(2) == (0, 2) and default_committee(3) == (0, 2) and default_committee(10) == (3, 2)
