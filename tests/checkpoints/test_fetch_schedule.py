"""The fetch schedule as a pure object (node/checkpoints/schedule.py): plain calls with
explicit times, no sockets, no clock. The socket tests in test_checkpoints_*.py test the
driver (VersionFetcher) that moves its decisions over real connections."""

from __future__ import annotations

import random

import pytest

from node.checkpoints.schedule import MAX_KNOWN_PEERS, FetchSchedule
from protocol import chunk_frames as F
from protocol.bitmap import Bitmap

CHUNK = 1 << 20


def bits(n: int, held: set[int] | range) -> bytes:
    b = Bitmap(n)
    for i in held:
        b.set(i)
    return b.to_bytes()


def schedule(n: int = 8, held: set[int] = frozenset(), **kw) -> FetchSchedule:  # type: ignore[assignment]
    bm = Bitmap(n)
    for i in held:
        bm.set(i)
    kw.setdefault("rng", random.Random(0))
    s = FetchSchedule(bm, CHUNK, **kw)
    s.start(0.0)
    return s


def invariants(s: FetchSchedule) -> None:
    """What must hold after any sequence of events: have-set counts match the bitmaps, and
    every chunk is held, in the pool, on its way or being checked."""
    for i in range(s.n):
        assert s.avail[i] == sum(1 for q in s.peers.values() if q.bitmap is not None and i in q.bitmap)
        assert i in s.held or i in s.missing or i in s.inflight or i in s.verifying, f"chunk {i} lost"
    assert s.nseeds == sum(1 for q in s.peers.values() if q.seed)


def test_the_rarest_chunk_is_asked_first_and_ties_are_broken_per_node():
    s = schedule(4)
    s.update_have("a", bits(4, {0, 1, 2, 3}))
    s.update_have("b", bits(4, {0, 1, 2}))
    s.update_have("c", bits(4, {0, 1}))
    s.superseed = False  # "a" is a seed; here it is asked like anyone
    a = s.peers["a"]
    assert s.pick(a, 1.0) == 3  # held by one peer
    assert s.pick(a, 1.0) == 2  # by two
    assert s.inflight == {3: "a", 2: "a"} and s.inflight_since[3] == 1.0
    # a tie between chunks 0 and 1 (three holders each): each node's own random order decides,
    # so fetchers spread over the tied chunks instead of all asking for the same one
    firsts = set()
    for seed in range(20):
        t = schedule(4, rng=random.Random(seed), superseed=False)
        t.update_have("a", bits(4, {0, 1, 2, 3}))
        t.update_have("b", bits(4, {0, 1}))
        firsts.add(t.pick(t.peers["b"], 0.0))
    assert firsts == {0, 1}
    invariants(s)


def test_a_seed_is_asked_only_for_chunks_no_other_peer_holds_until_every_chunk_is_out():
    s = schedule(4)
    s.update_have("seed", bits(4, range(4)))
    s.update_have("peer", bits(4, {0, 1, 2}))
    seed, peer = s.peers["seed"], s.peers["peer"]
    assert s.pick(seed, 0.0) == 3  # only the seed holds it
    assert s.refused_reply(seed, 3, F.ELSEWHERE, 0.0)  # it just sent chunk 3 to someone else
    assert s.pick(seed, 0.1) is None  # 0-2 are for the other peer, not the seed's uplink: wait
    assert s.pick(peer, 0.1) in {0, 1, 2}
    # control: once every chunk is held by some non-seed peer, the seed helps like any peer
    t = schedule(4)
    t.update_have("seed", bits(4, range(4)))
    t.update_have("peer", bits(4, {0, 1, 2}))
    t.update_have("other", bits(4, {0, 1, 3}))
    t.update_have("third", bits(4, {0, 1, 2}))
    assert t.pick(t.peers["seed"], 0.0) == 3  # rarest (two holders) and no longer seed-only
    # and with super-seeding off, the seed is asked for anything
    u = schedule(4, superseed=False)
    u.update_have("seed", bits(4, range(4)))
    u.update_have("peer", bits(4, {0, 1, 2}))
    assert u.pick(u.peers["seed"], 0.0) == 3 and u.pick(u.peers["seed"], 0.0) in {0, 1, 2}
    invariants(s)


def test_a_chunk_a_seed_sent_elsewhere_waits_its_hold_off_then_is_asked_again():
    s = schedule(4, held={1, 2, 3})
    s.update_have("seed", bits(4, range(4)))
    seed = s.peers["seed"]
    assert s.next_request(seed, 0.0) == 0
    assert s.refused_reply(seed, 0, F.ELSEWHERE, 0.1) is True  # the session goes on
    assert 0 in s.missing and 0 not in s.inflight and s.chunks_elsewhere == seed.elsewhere == 1
    retry = seed.refused[0]
    assert retry == pytest.approx(0.1 + 0.25)  # nothing received yet: the first guess
    assert s.next_request(seed, retry - 0.01) is None  # only the seed holds it: wait, no other pick
    assert s.next_request(seed, retry) == 0  # the hold-off passed
    invariants(s)


def test_a_refusal_after_only_small_files_arrived_is_asked_again_soon():
    """A checkpoint's first payloads are often its small files (an 88-byte config); a receive
    rate measured from those alone put "two chunk times" at the whole second, and a refused
    chunk waited that long. Until a chunk's worth of bytes has arrived the retry is the
    first-guess 0.25 s; then it scales by the rate. (Every payload here arrives at t=0.)"""
    bm = Bitmap(4)
    s = FetchSchedule(bm, 512 * 1024)
    s.start(0.0)
    assert s.elsewhere_retry(0.0) == 0.25  # nothing received
    s.received.append((0.0, 88))
    assert s.elsewhere_retry(0.0) == 0.25  # a small file is no chunk time (was 1.0)
    s.received.append((0.0, 512 * 1024))
    assert s.elsewhere_retry(0.0) == 0.1  # a whole chunk in no time: the floor
    # a measured rate: two chunk times at it, capped at elsewhere_retry_s
    t = FetchSchedule(Bitmap(4), CHUNK)
    t.start(0.0)
    t.received.append((0.5, CHUNK))
    t.received.append((1.0, CHUNK))
    assert t.elsewhere_retry(1.0) == pytest.approx(1.0)  # 2 MiB/s: two chunk times are 1 s
    t.received.append((1.0, 6 * CHUNK))
    assert t.elsewhere_retry(1.0) == pytest.approx(0.25)  # 8 MiB/s


def test_a_chunk_the_peer_does_not_hold_corrects_its_have_set_and_other_errors_end_the_session():
    s = schedule(4)
    s.update_have("a", bits(4, {0, 1}))
    a = s.peers["a"]
    i = s.pick(a, 0.0)
    assert s.refused_reply(a, i, F.NOT_HELD, 0.1) is True
    assert i not in a.bitmap and s.avail[i] == 0 and i in s.missing
    j = s.pick(a, 0.2)
    assert j is not None and j != i
    assert s.refused_reply(a, j, F.BUSY, 0.3) is False  # the driver raises it: the session ends
    assert j in s.missing
    invariants(s)


def test_bad_chunks_strike_and_the_last_strike_bans():
    shared: set[str] = set()
    s = schedule(4, banned=shared, max_strikes=3)
    s.update_have("liar", bits(4, range(4)))
    s.update_have("honest", bits(4, {0}))
    liar = s.peers["liar"]
    assert s.to_start(0.0, 16, lambda p: True) == [liar, s.peers["honest"]]  # equal scores: as known
    assert [s.strike(liar, f"chunk {k}: bad hash") for k in range(3)] == [False, False, True]
    assert liar.banned and "liar" in shared and liar.bitmap is None
    assert s.avail == [1, 0, 0, 0] and s.nseeds == 0  # its have-set no longer counts
    s.ended(liar)
    s.ended(s.peers["honest"])
    assert [p.peer_id for p in s.to_start(100.0, 16, lambda p: True)] == ["honest"]
    assert s.strike(liar, "again") is False  # banned once
    # a later fetch sharing the set skips it from the start
    t = schedule(4, banned=shared)
    t.update_have("liar", bits(4, range(4)))
    assert t.peers["liar"].banned and t.to_start(0.0, 16, lambda p: True) == []
    invariants(s)


def test_a_failed_session_returns_its_chunks_and_the_peer_cools_down():
    s = schedule(8, depth=4)
    s.update_have("a", bits(8, range(8)))
    s.superseed = False
    (a,) = s.to_start(0.0, 16, lambda p: True)
    asked = [s.next_request(a, 0.0) for _ in range(5)]
    assert asked[4] is None and len(a.inflight) == 4  # the pipeline depth
    s.failed(a, 10.0, "OSError: connection reset")
    s.ended(a)
    assert not a.inflight and not s.inflight and s.missing == set(range(8)) and not a.running
    assert a.cooldown_until == 10.5  # 0.25 x 2^1
    assert s.to_start(10.4, 16, lambda p: True) == []
    assert s.to_start(10.5, 16, lambda p: True) == [a]
    s.failed(a, 20.0, "stall")
    s.ended(a)
    assert a.cooldown_until == 21.0  # doubled
    assert s.depth_for(a) == 2  # a peer that failed keeps half the requests in flight
    for _ in range(10):
        s.failed(a, 100.0, "stall")
    assert a.cooldown_until == 130.0  # at most 30 s
    s.failed(a, 200.0, "TicketError: timeout", ticket=True)
    assert a.cooldown_until == pytest.approx(200.0 + min(5.0, 0.2 * a.failures))  # not the peer's fault
    invariants(s)


def test_peers_start_best_first_up_to_the_cap_and_reverse_peers_only_when_reachable():
    s = schedule(4)
    for pid, bps in (("slow", 1e6), ("fast", 1e8), ("mid", 1e7), ("nat", 1e9)):
        s.add_peer(pid, reverse=pid == "nat").ewma_bps = bps
    started = s.to_start(0.0, 2, lambda p: not p.reverse)
    assert [p.peer_id for p in started] == ["fast", "mid"]
    assert s.to_start(0.0, 2, lambda p: not p.reverse) == []  # two running: the cap
    s.ended(started[0])
    assert [p.peer_id for p in s.to_start(0.0, 3, lambda p: True)] == ["nat", "fast"]


def test_the_end_game_asks_a_seed_for_a_stragglers_chunk_but_not_a_busy_fair_peers():
    s = schedule(2, endgame_after_s=0.5)
    s.update_have("seed", bits(2, range(2)))
    s.update_have("slow", bits(2, range(2)))
    s.update_have("other", bits(2, {0}))
    seed, slow = s.peers["seed"], s.peers["slow"]
    for p in s.to_start(0.0, 16, lambda p: True):
        assert p.running
    assert s.next_request(s.peers["other"], 0.0) == 0
    assert s.next_request(seed, 0.0) == 1  # seed-only chunk
    assert s.refused_reply(seed, 1, F.ELSEWHERE, 0.0) is True
    assert s.next_request(slow, 0.0) == 1
    s.payload(s.peers["other"], 0, CHUNK, 0.2, 0.2)  # 5 MiB/s received so far
    s.held.set(0)
    s.checked(s.peers["other"], 0, CHUNK, True)
    seed.refused.clear()
    # 0.3 s later the slow peer's reply is not late enough to call it a straggler
    assert s.next_request(seed, 0.6) is None
    # at 10 s it has taken far more than STRAGGLER chunk times at its fair share: ask the seed too
    assert s.next_request(seed, 10.0) == 1 and s.chunks_endgame == 1
    assert s.inflight[1] == "slow"  # the first owner stays
    assert s.payload(seed, 1, CHUNK, 10.1, 0.1) is True
    assert s.payload(slow, 1, CHUNK, 10.2, 10.0) is False  # the other copy won: dropped
    assert s.chunks_duplicate == 1
    s.held.set(1)
    s.checked(seed, 1, CHUNK, True)
    assert s.complete and not s.inflight and not s.verifying
    invariants(s)


def test_payloads_feed_the_peer_rate_and_a_checked_chunk_counts_once():
    s = schedule(4)
    s.update_have("a", bits(4, range(4)))
    s.superseed = False
    a = s.peers["a"]
    i = s.next_request(a, 0.0)
    assert s.payload(a, i, CHUNK, 0.5, 0.5) is True
    assert a.ewma_bps == 2 * CHUNK and i in s.verifying and s.bytes_from_seeds == CHUNK
    assert s.next_request(a, 0.5) is not None
    s.checked(a, i, CHUNK, ok=False)  # refused by the check (the driver struck the peer)
    assert i in s.missing and a.chunks == 0
    assert s.receive_bps(0.5) == pytest.approx(CHUNK / 0.5)
    assert s.receive_bps(100.0) == pytest.approx(CHUNK / 0.5)  # nothing new: the last rate


def test_a_malformed_have_set_is_refused_and_the_peers_tracked_are_bounded():
    s = schedule(12)
    assert s.update_have("a", b"\xff") is False  # one byte for 12 chunks
    assert s.update_have("a", bits(12, {11})) is True and s.avail[11] == 1
    for k in range(3 * MAX_KNOWN_PEERS):
        s.add_peer(f"stranger-{k}")
    assert len(s.peers) <= MAX_KNOWN_PEERS and "a" in s.peers  # a useful peer is never pushed out


def test_random_event_sequences_keep_the_books():
    """Any order of have-sets, requests, refusals, payloads, checks and failures leaves every
    chunk accounted for and the have-set counts right (the socket fuzzers check the same
    through a hostile seed; here every branch is reached in milliseconds)."""
    for seed in range(40):
        r = random.Random(seed)
        n = r.randint(1, 20)
        s = schedule(n, held=set(r.sample(range(n), r.randint(0, n // 2))), endgame_after_s=0.0)
        t = 0.0
        for _ in range(300):
            t += r.random() * 0.2
            pid = f"p{r.randint(0, 4)}"
            p = s.add_peer(pid)
            assert p is not None
            what = r.random()
            if what < 0.2:
                s.update_have(pid, bits(n, set(r.sample(range(n), r.randint(0, n)))))
            elif what < 0.45:
                p.running = True
                s.next_request(p, t)
            elif what < 0.75 and p.inflight:
                i = r.choice(sorted(p.inflight))
                if r.random() < 0.3:
                    if not s.refused_reply(p, i, r.choice([F.ELSEWHERE, F.NOT_HELD, F.BUSY]), t):
                        s.failed(p, t, "busy")
                        s.ended(p)
                elif s.payload(p, i, CHUNK, t, 0.01):
                    ok = r.random() < 0.8
                    if ok:
                        s.held.set(i)
                    elif s.strike(p, "bad"):
                        s.ended(p)
                    s.checked(p, i, CHUNK, ok)
            elif what < 0.8:
                s.failed(p, t, "reset")
                s.ended(p)
            invariants(s)
            assert all(not q.inflight for q in s.peers.values() if not q.running)
