"""The announce queue (node/roles/intake.py announce_queue, a fair queue): announcers that
served a batch before are fetched first, and unproven announcers (fresh identities that may
never serve) can occupy only some fetch tasks."""

from __future__ import annotations

import trio
import trio.testing

from node.roles.fair_queue import FairQueue
from node.roles.intake import announce_queue
from protocol import Envelope, RolloutAnnounce


def _env(sender: str, n: int) -> Envelope:
    ann = RolloutAnnounce(batch_id=bytes([n]) * 32, policy_version=0, batch_counter=n, num_samples=1, size_bytes=1)
    return Envelope(b"\0" * 32, RolloutAnnounce.TYPE_ID, sender, 0, n, ann, b"")


def _send(q: FairQueue[Envelope], env: Envelope) -> Envelope | None:
    """Offer an announce; the announce it displaced, if any (raises when it was refused)."""
    out = q.offer(env.sender, env)
    if not out.queued:
        raise trio.WouldBlock
    return None if out.displaced is None else out.displaced[1]


async def test_unproven_announcers_hold_at_most_their_slots_and_proven_ones_go_first():
    q = announce_queue(100, unproven_slots=2)
    q.mark_proven("honest")
    for i in range(10):
        _send(q, _env(f"stranger-{i}", i))
    _send(q, _env("honest", 50))
    taken = []
    async with trio.open_nursery() as nursery:

        async def fetcher() -> None:  # each "fetch" from a stranger hangs (never served)
            t = await q.get()
            taken.append(t.sender)
            if t.unproven:
                await trio.sleep_forever()
            q.done(t)

        for _ in range(4):  # one after another: a get is a checkpoint, so their order is trio's
            nursery.start_soon(fetcher)
            await trio.testing.wait_all_tasks_blocked()
        assert taken[0] == "honest"  # the proven lane first
        assert sum(s.startswith("stranger") for s in taken) == 2  # two slots held, two tasks free
        _send(q, _env("honest", 51))  # a free task takes it at once
        await trio.testing.wait_all_tasks_blocked()
        assert taken.count("honest") == 2
        nursery.cancel_scope.cancel()


async def test_an_announcer_that_stops_serving_loses_its_standing_and_the_queue_is_bounded():
    q = announce_queue(6, unproven_slots=1, remember=2)
    q.mark_proven("a")
    q.forget("a")
    assert not q.proven("a")
    for p in ("a", "b", "c"):
        q.mark_proven(p)
    assert not q.proven("a") and q.proven("b") and q.proven("c")  # remembered: 2
    for i in range(3):
        _send(q, _env("x", i))
    try:
        _send(q, _env("x", 9))
    except trio.WouldBlock:
        pass
    else:
        raise AssertionError("a full queue took one more announce")
    assert len(q) == 3  # the unproven lane holds half the queue ...
    for i in range(3):
        _send(q, _env("b", 10 + i))  # ... and a proven announcer still gets in
    assert len(q) == 6


async def test_announces_queued_before_their_sender_proved_itself_are_promoted():
    q = announce_queue(10, unproven_slots=1)
    _send(q, _env("stranger", 1))
    _send(q, _env("newcomer", 2))
    q.mark_proven("newcomer")  # its first batch (fetched elsewhere) checked out
    t = await q.get()
    assert t.sender == "newcomer" and not t.unproven


def test_a_full_lane_gives_a_newcomer_a_place_from_its_biggest_holder():
    """Per-sender shares: in a full lane, an announce from a sender that would hold fewer than
    the biggest holder displaces that holder's newest announce; once every holder has as few
    as the newcomer would, the newcomer is refused (and so is the biggest holder itself)."""
    q = announce_queue(8, unproven_slots=1)  # the unproven lane holds 4
    for i in range(4):
        assert _send(q, _env("flooder", i)) is None
    displaced = _send(q, _env("honest", 10))
    assert displaced is not None and (displaced.sender, displaced.seq) == ("flooder", 3)  # its newest
    assert q.held("honest") == 1 and q.held("flooder") == 3 and len(q) == 4
    assert _send(q, _env("second", 11)).sender == "flooder"
    assert _send(q, _env("third", 12)).sender == "flooder"
    assert [q.held(p) for p in ("flooder", "honest", "second", "third")] == [1, 1, 1, 1]
    for sender in ("fourth", "flooder", "honest"):  # nobody holds more than one place: refused
        try:
            _send(q, _env(sender, 13))
        except trio.WouldBlock:
            pass
        else:
            raise AssertionError(f"{sender} took a place from a sender holding as few as it")
    # control: the proven lane is apart; a proven announcer still gets in
    q.mark_proven("worker")
    assert _send(q, _env("worker", 20)) is None and q.held("worker") == 1
