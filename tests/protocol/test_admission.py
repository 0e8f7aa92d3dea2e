"""Admission as one pure function (protocol/admission.py): each rule alone, in the order the
module states, with plain values; tests/roles/test_ledger*.py check the same through the
trainer's SQLite ledger."""

from __future__ import annotations

import dataclasses

from protocol.admission import BatchFacts, StepCandidate, StepSelection, admission, select_for_step
from protocol.committee import Ballot, CommitteeRule

VALIDATORS = ("v0", "v1", "v2")
ALL = CommitteeRule(size=0, quorum=2, deadline_s=60.0, tolerance=1e-6)
FACTS = BatchFacts(
    worker="w",
    version=5,
    counter=3,
    num_samples=2,
    policy_version=5,
    max_async=2,
    chain_head=3,
    previous_version=5,
    have_bytes=True,
    slot_holder=None,
)


def rule_on(votes: dict[str, Ballot], facts: BatchFacts = FACTS, rule: CommitteeRule = ALL, reject_reason: str = ""):
    order = tuple(sorted(VALIDATORS))
    d = rule.outcome(order, votes, 0.0, facts.num_samples)
    rewards = {v: list(b.rewards) for v, b in votes.items() if b.accept}
    return admission(facts, d, rule, len(VALIDATORS), rewards, reject_reason, committees=not rule.everyone(3))


def yes(*r: float) -> Ballot:
    return Ballot(True, tuple(r))


NO = Ballot(False)


def test_a_quorum_that_agrees_admits_with_the_median_rewards_control():
    r = rule_on({"v0": yes(1.0, 0.0), "v1": yes(1.0, 0.0), "v2": yes(0.5, 0.5)})
    assert (r.status, r.why) == ("admitted", "admitted")
    assert r.rewards == (1.0, 0.0)  # the agreeing pair's median, not the outlier's


def test_a_stale_batch_is_refused_whatever_its_votes():
    r = rule_on({"v0": yes(1, 1), "v1": yes(1, 1)}, dataclasses.replace(FACTS, version=2, policy_version=5))
    assert (r.status, r.why) == ("rejected", "stale") and "max_async 2" in r.reason


def test_rejects_quote_the_first_rejecting_validators_reason():
    r = rule_on({"v0": NO, "v1": NO}, reject_reason="proof mismatch at token 7")
    assert (r.status, r.why) == ("rejected", "votes")
    assert r.reason == "rejected by validators: proof mismatch at token 7"


def test_accepts_whose_rewards_disagree_wait_then_are_refused_when_no_quorum_can_agree():
    waiting = rule_on({"v0": yes(1, 0), "v1": yes(0, 1)})
    assert (waiting.status, waiting.why) == ("pending", "disagreeing")  # v2 may still agree with one
    refused = rule_on({"v0": yes(1, 0), "v1": yes(0, 1), "v2": yes(0.5, 0.5)})
    assert (refused.status, refused.why) == ("rejected", "disagreement")


def test_missing_votes_leave_a_batch_pending_and_a_committee_says_how_far_it_got():
    assert rule_on({"v0": yes(1, 1)}).why == "votes"
    k2 = CommitteeRule(size=2, quorum=2, deadline_s=60.0, tolerance=1e-6)
    split = rule_on({"v0": yes(1, 1), "v1": NO, "v2": NO}, rule=k2, reject_reason="bad proof")
    assert (split.status, split.why) == ("rejected", "votes")  # the members split; the third decided
    r = rule_on({"v0": yes(1, 1)}, rule=k2)
    assert (r.status, r.why) == ("pending", "committee") and r.reason == "committee: 1 accept, 0 reject of 2 called on"


def test_a_later_counter_waits_for_the_workers_batch_at_the_gap():
    r = rule_on({"v0": yes(1, 1), "v1": yes(1, 1)}, dataclasses.replace(FACTS, counter=5, chain_head=3))
    assert (r.status, r.why, r.reason) == ("pending", "chain", "waiting for the worker's batch counter 3")


def test_a_counter_made_with_an_older_version_than_the_previous_is_refused():
    r = rule_on({"v0": yes(1, 1), "v1": yes(1, 1)}, dataclasses.replace(FACTS, version=4, previous_version=5))
    assert (r.status, r.why) == ("rejected", "regression") and "counter 2 at 5" in r.reason


def test_an_accepted_batch_whose_bytes_were_evicted_waits_for_them():
    r = rule_on({"v0": yes(1, 1), "v1": yes(1, 1)}, dataclasses.replace(FACTS, have_bytes=False))
    assert (r.status, r.why) == ("pending", "bytes")


def test_a_second_batch_for_an_admitted_slot_is_refused():
    r = rule_on({"v0": yes(1, 1), "v1": yes(1, 1)}, dataclasses.replace(FACTS, slot_holder=b"\xab" * 4))
    assert (r.status, r.why) == ("rejected", "slot") and "abababab" in r.reason


def test_the_rules_apply_in_order_staleness_first_then_votes_then_the_chain():
    stale_and_gap = dataclasses.replace(FACTS, version=1, counter=9, chain_head=0)
    assert rule_on({"v0": NO, "v1": NO}, stale_and_gap).why == "stale"
    gap_and_slot = dataclasses.replace(FACTS, counter=9, chain_head=0, slot_holder=b"x")
    assert rule_on({"v0": NO, "v1": NO}, gap_and_slot).why == "votes"
    assert rule_on({"v0": yes(1, 1), "v1": yes(1, 1)}, gap_and_slot).why == "chain"


# ------------------------------------------------------------------ a step's batches


def cand(i: int, tokens: int, held: bool = True, version: int = 0) -> StepCandidate:
    return StepCandidate(bytes([i]) * 32, version, tokens, held)


def test_a_step_takes_the_oldest_batches_that_fit_its_token_budget():
    sel = select_for_step([cand(1, 400), cand(2, 400), cand(3, 400)], token_budget=1000)
    assert sel.chosen == (bytes([1]) * 32, bytes([2]) * 32) and sel.tokens == 800 and sel.unusable == ()


def test_the_first_batch_always_fits_and_a_later_small_one_does_not_overtake():
    # a batch over the budget alone is still trained (else it would stall training forever)
    sel = select_for_step([cand(1, 5000), cand(2, 10)], token_budget=1000)
    assert sel.chosen == (bytes([1]) * 32,) and sel.tokens == 5000
    # the step stops at the first batch that does not fit: the small one behind it waits its turn
    sel = select_for_step([cand(1, 900), cand(2, 500), cand(3, 50)], token_budget=1000)
    assert sel.chosen == (bytes([1]) * 32,)


def test_batches_whose_weights_are_gone_are_set_aside_and_cost_nothing():
    sel = select_for_step([cand(1, 0, held=False), cand(2, 600), cand(3, 0, held=False), cand(4, 400)], 1000)
    assert sel.chosen == (bytes([2]) * 32, bytes([4]) * 32) and sel.tokens == 1000
    assert sel.unusable == (bytes([1]) * 32, bytes([3]) * 32)


def test_max_batches_caps_a_step_and_candidates_are_read_only_as_far_as_needed():
    read = []

    def lazily():
        for i in range(1, 10):
            read.append(i)
            yield cand(i, 10)

    sel = select_for_step(lazily(), token_budget=10_000, max_batches=3)
    assert len(sel.chosen) == 3 and sel.tokens == 30
    assert read == [1, 2, 3, 4]  # the fourth is looked at (to stop), the rest never decoded
    assert select_for_step([], 1000) == StepSelection((), 0, ())
