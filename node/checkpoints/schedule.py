"""The fetch schedule: which chunk of a version to ask which peer for, and when (sans-I/O).

:class:`FetchSchedule` holds every decision of a version fetch and none of its I/O: no
sockets, no tasks, no clock of its own. Its inputs are what the data connections and
heartbeats report (a peer's have-set, a reply's status, a payload's arrival, a chunk's
check, a session's failure) together with the current time; its outputs are chunk indices
to ask for, peers to start sessions with, the back-off of a failed peer and verdicts ("charge
this peer", "ban it now"). :class:`node.checkpoints.fetcher.VersionFetcher` drives it over
real connections; ``bench/simulate.py`` drives the same object over simulated links, so
what the simulator reports at 1,000 nodes is this code's behaviour, not a model of it.

The rules (each one's reason is in the method that applies it):

* **Rarest first**: a free request slot takes the missing chunk that the fewest known peers
  hold; a per-node random order breaks ties, so fetchers spread out and the original seeder
  sends each chunk about once before peers take over.
* **Super-seeding**: a seed (a peer holding the whole version) is asked only for chunks that
  no other known peer holds, until every chunk is held by some non-seed peer; then it helps
  like any peer. A seed that sent a chunk to someone else moments ago refuses with
  ``ELSEWHERE``; the chunk is not asked of it again for two chunk times at our receive rate
  (:meth:`FetchSchedule.elsewhere_retry`).
* **Strikes**: a bad chunk is a strike; ``max_strikes`` of them ban the peer (its have-set
  stops counting).
* **Cool-downs**: a failed session (stall, refused ticket, broken connection) returns the
  peer's chunks to the pool and keeps the peer out for an exponential back-off; a ticket
  that did not come (the control plane's trouble, not the peer's) for a short one.
* **End game**: once every missing chunk is on its way, a seed with a free slot is also
  asked for the chunk requested longest ago from a *straggler* (its current reply has taken
  ``STRAGGLER`` times a chunk's time at a fair share of our receive rate).
* **Rates**: payload bytes over the last ``RATE_WINDOW_S`` (all connections: our receive
  rate), and per peer an exponentially weighted rate that ranks the peers to start.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from collections.abc import Callable
from typing import Any

from protocol import chunk_frames as F
from protocol.bitmap import Bitmap

# Peers one fetch keeps track of: heartbeats from any identity add peers while a fetch runs.
MAX_KNOWN_PEERS = 1024
# End game: a peer whose reply takes STRAGGLER times as long as a chunk at its fair share of our
# receive rate is a straggler (its chunks may be asked from a seed as well); below that, our own
# downlink is the likelier bottleneck and a second copy would only compete with the first.
STRAGGLER = 3.0
RATE_WINDOW_S = 5.0
ELSEWHERE_RETRY_MIN_S = 0.1  # see FetchSchedule.elsewhere_retry
ELSEWHERE_RETRY_FIRST_S = 0.25  # the same, before a chunk's worth of payload arrived


@dataclasses.dataclass
class FetchPeer:
    """What one fetch knows of one peer: its have-set, its standing and its open requests."""

    peer_id: str
    bitmap: Bitmap | None = None
    reverse: bool = False  # behind NAT: it dials us (a reverse connection), we cannot dial it
    running: bool = False  # a session with it is open (or opening)
    banned: bool = False
    strikes: int = 0
    failures: int = 0
    cooldown_until: float = 0.0
    ewma_bps: float = 0.0
    bytes: int = 0
    chunks: int = 0
    inflight: set[int] = dataclasses.field(default_factory=set)
    last_error: str = ""
    refused: dict[int, float] = dataclasses.field(default_factory=dict)  # chunk -> retry after (ELSEWHERE)
    elsewhere: int = 0
    # When the reply now due on this connection began to be served: the previous reply's end,
    # or the GET sent to an idle connection (replies come one after another).
    service_start: float = 0.0

    def straggles(self, fair_bps: float, chunk_bytes: int, now: float) -> bool:
        """Whether this peer's current reply is far slower than ``fair_bps`` (its fair share of our
        receive rate) would make it."""
        return bool(self.inflight) and now - self.service_start > STRAGGLER * chunk_bytes / fair_bps

    @property
    def seed(self) -> bool:
        return self.bitmap is not None and self.bitmap.complete

    def score(self) -> float:
        return (self.ewma_bps + 1.0) / (1 + self.failures + 3 * self.strikes)

    def to_json(self) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id,
            "bytes": self.bytes,
            "chunks": self.chunks,
            "mib_per_s": round(self.ewma_bps / 2**20, 1),
            "failures": self.failures,
            "strikes": self.strikes,
            "banned": self.banned,
            "holds": self.bitmap.count if self.bitmap else None,
            "elsewhere": self.elsewhere,
            "reverse": self.reverse,
            "last_error": self.last_error,
        }


class FetchSchedule:
    """The decisions of one version's fetch, driven by explicit events and times.

    ``held`` is the version's have-set in this node's store (the driver marks chunks held in
    it once written; the schedule only reads it). ``wake`` is called whenever a peer could
    now be asked for something it could not before (a new peer or have-set, a chunk back in
    the pool): the driver's sessions wait on it. ``banned`` is shared with the caller, so a
    peer banned by one fetch is skipped by the next.
    """

    def __init__(
        self,
        held: Bitmap,
        chunk_len: int,
        *,
        depth: int = 4,
        max_verifying: int = 16,
        max_strikes: int = 3,
        superseed: bool = True,
        elsewhere_retry_s: float = 1.0,
        endgame_after_s: float | None = 0.5,
        banned: set[str] | None = None,
        rng: random.Random | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.held = held
        self.n = n = held.n
        self.chunk_len = chunk_len
        self.depth = depth
        self.max_verifying = max_verifying
        self.max_strikes = max_strikes
        self.superseed = superseed
        self.elsewhere_retry_s = elsewhere_retry_s
        self.endgame_after_s = endgame_after_s
        self.banned = banned if banned is not None else set()
        self.wake = wake or (lambda: None)
        order = list(range(n))
        (rng or random.Random()).shuffle(order)
        self.tiebreak = [0] * n
        for rank, i in enumerate(order):
            self.tiebreak[i] = rank
        self.avail = [0] * n  # known peers holding each chunk (seeds included)
        self.nseeds = 0  # peers whose bitmap is complete (they count in every avail[i])
        self.peers: dict[str, FetchPeer] = {}
        self.missing: set[int] = {i for i in range(n) if i not in held}  # not held, not asked
        self.inflight: dict[int, str] = {}  # chunk -> the peer it was first asked from
        self.inflight_since: dict[int, float] = {}
        self.verifying: set[int] = set()  # arrived, being checked and written
        self.started: float | None = None
        # Payloads received (duplicates too: they took the link), for receive_bps().
        self.received: collections.deque[tuple[float, int]] = collections.deque()
        self._last_receive_bps = 0.0
        self.chunks_elsewhere = 0
        self.chunks_endgame = 0  # second requests sent to a seed in the end game
        self.chunks_duplicate = 0  # payloads that arrived after another copy of the chunk
        self.bytes_from_seeds = 0

    @property
    def complete(self) -> bool:
        return self.held.complete

    def start(self, now: float) -> None:
        """The fetch begins (rates are measured from here); chunks held by now are not missing."""
        self.started = now
        self.missing = {i for i in self.missing if i not in self.held}

    # ------------------------------------------------------------ peers and have-sets
    def add_peer(self, peer_id: str, reverse: bool | None = None) -> FetchPeer | None:
        """A peer to try (``reverse``: it is behind NAT and dials us; None: as known so far).
        Bounded (``MAX_KNOWN_PEERS``): at the cap an idle peer that never showed a bitmap
        makes room, else the newcomer is ignored (None)."""
        p = self.peers.get(peer_id)
        if p is None:
            if len(self.peers) >= MAX_KNOWN_PEERS and not self._evict_idle_peer():
                return None
            p = self.peers[peer_id] = FetchPeer(peer_id, banned=peer_id in self.banned)
            self.wake()
        if reverse is not None and reverse != p.reverse:
            p.reverse = reverse
            self.wake()
        return p

    def _evict_idle_peer(self) -> bool:
        for pid, q in self.peers.items():
            if q.bitmap is None and not q.running and not q.inflight:
                del self.peers[pid]
                return True
        return False

    def update_have(self, peer_id: str, bitmap: bytes) -> bool:
        """A peer's have-bitmap for this version (heartbeat or HAVE reply). False when the
        bitmap is malformed: the caller charges the peer (``bad_bitmap``)."""
        p = self.add_peer(peer_id)
        if p is None or p.banned:
            return True
        try:
            new = Bitmap(self.n, bitmap)
        except ValueError:
            return False
        self.apply_bitmap(p, new)
        self.wake()
        return True

    def apply_bitmap(self, p: FetchPeer, new: Bitmap | None) -> None:
        """Replace ``p``'s have-set, keeping ``avail`` and ``nseeds`` in step. Only the bits that
        changed are visited (a heartbeat of a 16,000-chunk version changes a few)."""
        old_i = int.from_bytes(p.bitmap.raw(), "little") if p.bitmap is not None else 0
        new_i = int.from_bytes(new.raw(), "little") if new is not None else 0
        diff = old_i ^ new_i
        if diff:
            avail = self.avail
            for bits, step in ((diff & new_i, 1), (diff & old_i, -1)):
                while bits:
                    low = bits & -bits
                    avail[low.bit_length() - 1] += step
                    bits ^= low
        was_seed = p.seed
        p.bitmap = new
        self.nseeds += int(p.seed) - int(was_seed)

    def to_start(self, now: float, max_peers: int, can_reach: Callable[[FetchPeer], bool]) -> list[FetchPeer]:
        """Peers to open a session with now, best score first, up to ``max_peers`` running in
        all; each is marked running (the driver calls :meth:`ended` when its session ends)."""
        active = sum(1 for p in self.peers.values() if p.running)
        out = []
        for p in sorted(self.peers.values(), key=lambda q: -q.score()):
            if active >= max_peers:
                break
            if p.running or p.banned or p.peer_id in self.banned or now < p.cooldown_until or not can_reach(p):
                continue
            p.running = True
            active += 1
            out.append(p)
        return out

    def hint(self, p: FetchPeer) -> tuple[int, ...]:
        """Chunks to name in a ticket request: up to 16 missing ones ``p`` holds (a holder's
        server may use them to refuse a fetcher it cannot help)."""
        if p.bitmap is not None:
            idx = [i for i in list(self.missing)[:4096] if i in p.bitmap][:16]
            if idx:
                return tuple(idx)
        return tuple(sorted(self.missing)[:16]) or (0,)

    def depth_for(self, p: FetchPeer) -> int:
        """Requests kept in flight on ``p``'s connection: half after any failure or strike."""
        if p.failures or p.strikes:
            return max(1, self.depth // 2)
        return self.depth

    # ------------------------------------------------------------ requests
    def next_request(self, p: FetchPeer, now: float) -> int | None:
        """The chunk to ask ``p`` for now, or None (its pipeline is full, too many chunks are
        being checked, or it holds nothing we may ask it for)."""
        if len(p.inflight) >= self.depth_for(p) or len(self.verifying) >= self.max_verifying:
            return None
        idle = not p.inflight
        i = self.pick(p, now)
        if i is not None and idle:
            p.service_start = now
        return i

    def pick(self, p: FetchPeer, now: float) -> int | None:
        """The next chunk to ask ``p`` for: rarest first; from a seed, only chunks no other peer holds
        (until every chunk is held by some non-seed peer; then the seed helps like any peer)."""
        bm = p.bitmap
        if bm is None:
            return None
        held = self.held
        avail, tiebreak = self.avail, self.tiebreak
        seed = self.superseed and p.seed
        nseeds = self.nseeds
        refused = p.refused
        best = None
        best_key = None
        best_only = None  # seeds: the rarest chunk that only seeds hold
        best_only_key = None
        seed_only_left = False
        stale = []
        hb, bb = held.raw(), bm.raw()  # (the hot loop of a fetch: bits tested in place)
        for i in self.missing:
            if hb[i >> 3] >> (i & 7) & 1:
                stale.append(i)
                continue
            if bb[i >> 3] >> (i & 7) & 1:
                if refused and refused.get(i, 0.0) > now:
                    if seed and avail[i] <= nseeds:
                        seed_only_left = True
                    continue
                key = (avail[i], tiebreak[i])
                if best_key is None or key < best_key:
                    best, best_key = i, key
                if seed and avail[i] <= nseeds:
                    seed_only_left = True
                    if best_only_key is None or key < best_only_key:
                        best_only, best_only_key = i, key
        for i in stale:
            self.missing.discard(i)
        if seed and seed_only_left:
            best = best_only  # None while the seed-only chunks were all just refused: wait
        elif best is None and p.seed and self.endgame_after_s is not None:
            best = self.endgame_pick(p, now)
            if best is not None:
                self.chunks_endgame += 1
                p.inflight.add(best)  # a second request; the first owner stays in inflight
            return best
        if best is not None:
            self.missing.discard(best)
            self.inflight[best] = p.peer_id
            self.inflight_since[best] = now
            p.inflight.add(best)
        return best

    def endgame_pick(self, p: FetchPeer, now: float) -> int | None:
        """End game: nothing is left to pick, every missing chunk is on its way from some peer.
        A seed with a free slot also asks for the chunk requested longest ago (at least
        ``endgame_after_s``) from a straggler, so the tail does not wait on one slow, busy peer.
        Why not every late chunk: a fetcher whose own downlink is the bottleneck sees every
        chunk as late (replies on one connection come one after another, and all connections
        share the link), while each source sends its fair share; a second copy then only takes
        link from the first (a 20 Mbit/s fetcher received 10 duplicate 4 MiB chunks of a
        64 MiB checkpoint and took 1.78x its bound, bench/distribution.py --link-caps)."""
        if self.endgame_after_s is None:
            return None
        rate = self.receive_bps(now)
        if rate <= 0:
            return None  # no chunk has arrived yet: nothing to compare with (stalls are cut anyway)
        fair = rate / max(1, self.busy_connections())
        held, verifying, owner = self.held, self.verifying, self.inflight
        peers = self.peers
        best, oldest = None, now - self.endgame_after_s
        for i, since in self.inflight_since.items():
            q = peers.get(owner.get(i, ""))
            if (
                since <= oldest
                and (q is None or q.straggles(fair, self.chunk_len, now))
                and owner.get(i) != p.peer_id
                and i not in p.inflight
                and i not in verifying
                and i not in held
                and p.refused.get(i, 0.0) <= now
            ):
                best, oldest = i, since
        return best

    def busy_connections(self) -> int:
        return sum(1 for q in self.peers.values() if q.running and q.inflight)

    def release(self, i: int, p: FetchPeer | None = None) -> None:
        """Chunk ``i`` is no longer on its way (from ``p``; None: from anyone): back to the pool
        unless held, and off ``p``'s requests."""
        if p is None or self.inflight.get(i) == p.peer_id:
            self.inflight.pop(i, None)
            self.inflight_since.pop(i, None)
            if i not in self.held:
                self.missing.add(i)
        if p is not None:
            p.inflight.discard(i)
        self.wake()

    # ------------------------------------------------------------ replies
    def refused_reply(self, p: FetchPeer, i: int, status: int, now: float) -> bool:
        """``p`` answered the GET of chunk ``i`` with ``status`` (not OK). True when the session
        goes on (a super-seeding refusal, or a chunk its have-set claimed by mistake); False
        when the status ends the session (the driver raises it)."""
        p.service_start = now  # the next reply's service starts now
        self.release(i, p)
        if status == F.ELSEWHERE:  # a super-seeding seed: someone else just got it from there
            p.elsewhere += 1
            self.chunks_elsewhere += 1
            p.refused[i] = now + self.elsewhere_retry(now)
            return True
        if status == F.NOT_HELD and p.bitmap is not None and i in p.bitmap:
            nb = p.bitmap.copy()
            nb.clear(i)
            self.apply_bitmap(p, nb)
            return True
        return False

    def payload(self, p: FetchPeer, i: int, length: int, now: float, read_s: float) -> bool:
        """Chunk ``i``'s payload (``length`` bytes, read in ``read_s``) arrived from ``p`` at
        ``now``. True: check and write it, then call :meth:`checked`; False: another copy
        (an end-game request's) won, drop it."""
        p.service_start = now
        self.received.append((now, length))
        if i in self.held or i in self.verifying:
            self.chunks_duplicate += 1
            p.inflight.discard(i)
            return False
        rate = length / max(read_s, 1e-6)
        p.ewma_bps = rate if p.ewma_bps == 0 else 0.7 * p.ewma_bps + 0.3 * rate
        if p.seed:
            self.bytes_from_seeds += length
        p.refused.pop(i, None)
        p.inflight.discard(i)
        self.verifying.add(i)
        return True

    def checked(self, p: FetchPeer, i: int, length: int, ok: bool) -> None:
        """Chunk ``i`` from ``p`` was checked: written and held (``ok``; the driver marked it
        held first), or refused (``ok`` False, after :meth:`strike`)."""
        if ok:
            p.bytes += length
            p.chunks += 1
        self.verifying.discard(i)
        self.release(i)

    def strike(self, p: FetchPeer, reason: str) -> bool:
        """A bad chunk from ``p`` (wrong size or hash). True when this strike bans it: its
        have-set stops counting and the driver ends its session and bans it node-wide."""
        p.strikes += 1
        p.last_error = reason
        if p.strikes >= self.max_strikes and not p.banned:
            p.banned = True
            self.banned.add(p.peer_id)
            self.apply_bitmap(p, None)
            return True
        return False

    def failed(self, p: FetchPeer, now: float, error: str, *, ticket: bool = False) -> None:
        """``p``'s session failed (``ticket``: no ticket came, the control plane's trouble rather
        than the peer's): it cools down, exponentially with its failures (30 s at most), or
        briefly (5 s at most) after a missing ticket."""
        p.failures += 1
        p.last_error = error[:200]
        p.cooldown_until = now + min(30.0, 0.25 * 2 ** min(p.failures, 7))
        if ticket:
            p.cooldown_until = now + min(5.0, 0.2 * p.failures)

    def ended(self, p: FetchPeer) -> None:
        """``p``'s session is over (for any reason): its requests go back to the pool."""
        for i in list(p.inflight):
            self.release(i, p)
        p.running = False
        self.wake()

    # ------------------------------------------------------------ rates
    def receive_bps(self, now: float) -> float:
        """Payload bytes per second over the last ``RATE_WINDOW_S``; while nothing arrived in
        that window, the last rate measured (0.0 before anything arrived)."""
        w = self.received
        while w and w[0][0] < now - RATE_WINDOW_S:
            w.popleft()
        if w:
            began = self.started if self.started is not None else now
            span = min(RATE_WINDOW_S, max(now - began, 1e-3))
            self._last_receive_bps = sum(b for _, b in w) / span
        return self._last_receive_bps

    def elsewhere_retry(self, now: float) -> float:
        """How long a chunk a seed answered ``ELSEWHERE`` is not asked of it again: two chunk
        times at our receive rate, between ``ELSEWHERE_RETRY_MIN_S`` and ``elsewhere_retry_s``.
        A fixed second was twice the whole fetch of a 64 MiB checkpoint over a 1000 Mbit/s
        link (bench/distribution.py --link-caps): the seed had sent the chunk to a slow host
        and lets it go again once that send proves slow, and the fast fetcher's last chunk
        waited out the second. A retry costs one small request and its refusal."""
        rate = self.receive_bps(now)
        if rate <= 0 or sum(b for _, b in self.received) < self.chunk_len:
            # nothing received yet, or less than one chunk (a checkpoint's small files, e.g. an
            # 88-byte config, arrive in a moment): a "rate" from those says nothing about a
            # chunk's time, and read as one it held a refused chunk back for the whole second
            return min(ELSEWHERE_RETRY_FIRST_S, self.elsewhere_retry_s)
        return max(
            min(ELSEWHERE_RETRY_MIN_S, self.elsewhere_retry_s), min(self.elsewhere_retry_s, 2 * self.chunk_len / rate)
        )
