"""The request/response accounting core (node/p2p/rrlimits.py), driven with a fake clock:
per-peer stream caps, charging only a peer that keeps going over, fair slots, preemption
when the node is full, and deadlines that fit the request."""

from __future__ import annotations

import pytest

from node.p2p.rrlimits import StreamAccounting, StreamLimits


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def acct(**kw) -> tuple[StreamAccounting, Clock]:
    clock = Clock()
    return StreamAccounting(StreamLimits(**kw), clock=clock), clock


def test_a_peer_over_its_stream_cap_is_refused_while_another_peer_is_admitted():
    a, _ = acct(streams_per_peer=3, free_refusals=100)
    held = [a.open("hostile").ticket for _ in range(3)]
    assert all(t is not None for t in held)
    over = a.open("hostile")
    assert over.ticket is None and not over.charge and "per-peer cap" in over.reason
    assert a.open("honest").ticket is not None  # control: another peer is not affected
    a.close(held[0])
    assert a.open("hostile").ticket is not None  # a closed stream gives its place back
    assert a.holding("hostile") == (3, 0)


def test_refusals_are_free_for_a_burst_then_charged_and_the_allowance_refills():
    a, clock = acct(streams_per_peer=1, free_refusals=4, refusal_refill_per_s=1.0)
    a.open("p")
    assert [a.open("p").charge for _ in range(6)] == [False] * 4 + [True] * 2
    clock.t += 2.0  # two refusals' worth refilled
    assert [a.open("p").charge for _ in range(3)] == [False, False, True]
    assert a.open("honest").ticket is not None and not a.open("honest").charge


def test_slots_are_capped_per_peer_and_a_peer_holding_none_goes_first():
    a, _ = acct(total_slots=4, slots_per_peer=2, streams_per_peer=10)
    hostile = [a.open("h").ticket for _ in range(6)]
    granted = [a.want_slot(t) for t in hostile]
    assert granted == [True, True, False, False, False, False]  # its per-peer slot cap
    assert a.holding("h") == (6, 2)
    b = a.open("b").ticket
    c = a.open("c").ticket
    assert a.want_slot(b) and a.want_slot(c)  # the node's other slots go to others at once
    d = a.open("d").ticket
    assert not a.want_slot(d)  # every slot busy: d waits ...
    # ... and when one of the hostile peer's slots frees, d (holding none) gets it, not "h"
    assert a.close(hostile[0]) == [d]
    assert a.counters["slot_waits"] == 5


def test_waiters_of_equal_standing_are_served_first_come():
    a, _ = acct(total_slots=1, slots_per_peer=1)
    first = a.open("x").ticket
    assert a.want_slot(first)
    w1, w2 = a.open("y").ticket, a.open("z").ticket
    assert not a.want_slot(w1) and not a.want_slot(w2)
    assert a.close(first) == [w1]
    assert a.close(w1) == [w2]


def test_a_waiter_that_goes_away_leaves_the_queue():
    a, _ = acct(total_slots=1, slots_per_peer=1)
    t = a.open("x").ticket
    a.want_slot(t)
    w = a.open("y").ticket
    a.want_slot(w)
    assert a.close(w) == []
    assert a.close(t) == []
    assert a.sizes() == {"streams": 0, "peers": 0, "slots": 0, "waiting": 0, "refusal_entries": 0}


def test_a_full_node_takes_room_from_the_biggest_holder_for_a_peer_holding_none():
    a, clock = acct(total_streams=6, streams_per_peer=4, total_slots=8, slots_per_peer=4)
    h = []
    for _ in range(4):
        h.append(a.open("h").ticket)
        clock.t += 1
    serving = h[0]
    a.want_slot(serving)  # h's oldest stream is being answered: it is never preempted
    o = [a.open("o").ticket for _ in range(2)]
    assert len(a._streams) == 6
    adm = a.open("honest")
    assert adm.ticket is not None and adm.preempt == h[1]  # h's oldest stream without a slot
    assert a.holding("h") == (3, 1) and a.counters["preempted"] == 1
    # two holders of equal size: no preemption (it would only move unfairness around)
    adm2 = a.open("o")
    assert adm2.ticket is None and adm2.preempt is None and not adm2.charge
    assert o[0] is not None
    # the preempted stream's task may finish its read before it sees the cancellation: no slot
    assert not a.want_slot(h[1]) and a.holding("h") == (3, 1)
    assert a.close(h[1]) == []


def test_read_deadlines_fit_the_request_size():
    a, _ = acct(read_base_s=2.0, min_rate_bps=1000.0, max_read_s=30.0)
    assert a.read_deadline(64) == pytest.approx(2.064)
    assert a.read_deadline(10_000) == pytest.approx(12.0)
    assert a.read_deadline(10**9) == 30.0  # capped


def test_the_refusal_table_is_bounded():
    a, clock = acct(streams_per_peer=1, max_peers=8, free_refusals=2)
    for i in range(50):
        a.open(f"p{i}")
        a.open(f"p{i}")  # one refusal each
        clock.t += 0.01
    assert a.sizes()["refusal_entries"] <= 8


def test_limits_reject_a_per_peer_cap_above_the_total():
    with pytest.raises(ValueError):
        StreamLimits(total_slots=4, slots_per_peer=8)
