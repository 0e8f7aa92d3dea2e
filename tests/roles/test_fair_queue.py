"""The fair queue's pure core (node/roles/fair_queue.py) under random offers, takes and
verdicts: its books always agree with what it holds, and no lane rule is ever broken. The
two presets' behaviour is specified in test_announce_queue.py and test_verify_queue.py."""

from __future__ import annotations

import collections
import random

import pytest

from node.roles.fair_queue import FairLanes, LaneRules, Taken


@pytest.mark.parametrize("seed", range(6))
def test_random_event_sequences_keep_the_books_and_the_rules(seed):
    rng = random.Random(seed)
    proven_rules = LaneRules(
        rng.randint(2, 8), rng.choice(["displace", "refuse", "wait"]), rng.choice(["fifo", "round_robin"])
    )
    unproven_rules = LaneRules(
        rng.randint(1, 6),
        rng.choice(["displace", "refuse"]),
        rng.choice(["fifo", "round_robin"]),
        per_sender=rng.choice([None, 1, 2]),
    )
    slots = rng.choice([None, 1, 2])
    q: FairLanes[int] = FairLanes(
        proven_rules, unproven_rules, unproven_slots=slots, unproven_every=rng.choice([None, 2, 4]), remember=5
    )
    senders = [f"s{i}" for i in range(7)]
    inside: dict[int, str] = {}  # item -> sender, what the queue should hold
    busy: list[Taken[int]] = []
    for n in range(3000):
        op = rng.random()
        if op < 0.5:
            s = rng.choice(senders)
            lane_before = q._lanes[q.proven(s)]
            mine, full = lane_before.held(s), lane_before.n >= lane_before.rules.capacity
            out = q.offer(s, n)
            assert out.lane == q.proven(s)
            if out.queued:
                inside[n] = s
                assert not (lane_before.rules.per_sender and mine >= lane_before.rules.per_sender)
                if out.displaced is not None:
                    d_sender, d_item = out.displaced
                    assert full and lane_before.rules.when_full == "displace"
                    assert inside.pop(d_item) == d_sender != s
                else:
                    assert not full
            else:
                assert out.reason is not None and out.displaced is None
        elif op < 0.75:
            t = q.take()
            if t is not None:
                assert inside.pop(t.item) == t.sender
                busy.append(t)
            else:  # nothing takeable: the proven lane is empty and unproven items wait for a slot
                assert q.queued(True) == 0
                assert q.queued(False) == 0 or (slots is not None and sum(b.unproven for b in busy) >= slots)
        elif op < 0.85 and busy:
            q.done(busy.pop(rng.randrange(len(busy))))
        elif op < 0.92:
            q.mark_proven(rng.choice(senders))
        elif op < 0.97:
            q.forget(rng.choice(senders))
        else:
            s = rng.choice(senders)
            gone = q.discard(s)
            assert sorted(gone) == sorted(i for i, who in inside.items() if who == s)
            for i in gone:
                del inside[i]
        held = collections.Counter(inside.values())
        assert len(q) == len(inside) and all(q.held(s) == held[s] for s in senders)
        if slots is not None:
            assert sum(b.unproven for b in busy) <= slots
        assert q.queued(False) <= unproven_rules.capacity  # promotion only ever leaves this lane
