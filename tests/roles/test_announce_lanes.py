"""AnnounceLanes: announcers that served a batch before are fetched first, and unproven
announcers (fresh identities that may never serve) can occupy only some fetch tasks."""

from __future__ import annotations

import trio
import trio.testing

from node.roles.intake import AnnounceLanes
from protocol import Envelope, RolloutAnnounce


def _env(sender: str, n: int) -> Envelope:
    ann = RolloutAnnounce(batch_id=bytes([n]) * 32, policy_version=0, batch_counter=n, num_samples=1, size_bytes=1)
    return Envelope(b"\0" * 32, RolloutAnnounce.TYPE_ID, sender, 0, n, ann, b"")


async def test_unproven_announcers_hold_at_most_their_slots_and_proven_ones_go_first():
    lanes = AnnounceLanes(size=100, unproven_slots=2)
    lanes.mark_served("honest")
    for i in range(10):
        lanes.send_nowait(_env(f"stranger-{i}", i))
    lanes.send_nowait(_env("honest", 50))
    taken = []
    async with trio.open_nursery() as nursery:

        async def fetcher() -> None:  # each "fetch" from a stranger hangs (never served)
            env, unproven = await lanes.receive()
            taken.append(env.sender)
            if unproven:
                await trio.sleep_forever()
            lanes.done(unproven)

        for _ in range(4):
            nursery.start_soon(fetcher)
        await trio.testing.wait_all_tasks_blocked()
        assert taken[0] == "honest"  # the proven lane first
        assert sum(s.startswith("stranger") for s in taken) == 2  # two slots held, two tasks free
        lanes.send_nowait(_env("honest", 51))  # a free task takes it at once
        await trio.testing.wait_all_tasks_blocked()
        assert taken.count("honest") == 2
        nursery.cancel_scope.cancel()


async def test_an_announcer_that_stops_serving_loses_its_standing_and_the_queue_is_bounded():
    lanes = AnnounceLanes(size=6, unproven_slots=1, remember=2)
    lanes.mark_served("a")
    lanes.mark_unserved("a")
    assert not lanes.proven("a")
    for p in ("a", "b", "c"):
        lanes.mark_served(p)
    assert not lanes.proven("a") and lanes.proven("b") and lanes.proven("c")  # remembered: 2
    for i in range(3):
        lanes.send_nowait(_env("x", i))
    try:
        lanes.send_nowait(_env("x", 9))
    except trio.WouldBlock:
        pass
    else:
        raise AssertionError("a full queue took one more announce")
    assert len(lanes) == 3  # the unproven lane holds half the queue ...
    for i in range(3):
        lanes.send_nowait(_env("b", 10 + i))  # ... and a proven announcer still gets in
    assert len(lanes) == 6


async def test_announces_queued_before_their_sender_proved_itself_are_promoted():
    lanes = AnnounceLanes(size=10, unproven_slots=1)
    lanes.send_nowait(_env("stranger", 1))
    lanes.send_nowait(_env("newcomer", 2))
    lanes.mark_served("newcomer")  # its first batch (fetched elsewhere) checked out
    env, unproven = await lanes.receive()
    assert env.sender == "newcomer" and not unproven


def test_a_full_lane_gives_a_newcomer_a_place_from_its_biggest_holder():
    """Per-sender shares: in a full lane, an announce from a sender that would hold fewer than
    the biggest holder displaces that holder's newest announce; once every holder has as few
    as the newcomer would, the newcomer is refused (and so is the biggest holder itself)."""
    lanes = AnnounceLanes(size=8, unproven_slots=1)  # the unproven lane holds 4
    for i in range(4):
        assert lanes.send_nowait(_env("flooder", i)) is None
    displaced = lanes.send_nowait(_env("honest", 10))
    assert displaced is not None and (displaced.sender, displaced.seq) == ("flooder", 3)  # its newest
    assert lanes.held("honest") == 1 and lanes.held("flooder") == 3 and len(lanes) == 4
    assert lanes.send_nowait(_env("second", 11)).sender == "flooder"
    assert lanes.send_nowait(_env("third", 12)).sender == "flooder"
    assert [lanes.held(p) for p in ("flooder", "honest", "second", "third")] == [1, 1, 1, 1]
    for sender in ("fourth", "flooder", "honest"):  # nobody holds more than one place: refused
        try:
            lanes.send_nowait(_env(sender, 13))
        except trio.WouldBlock:
            pass
        else:
            raise AssertionError(f"{sender} took a place from a sender holding as few as it")
    # control: the proven lane is apart; a proven announcer still gets in
    lanes.mark_served("worker")
    assert lanes.send_nowait(_env("worker", 20)) is None and lanes.held("worker") == 1
