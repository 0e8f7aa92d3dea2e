"""The version fetcher: get every chunk of one checkpoint version from many peers at once.

* One worker task per useful peer (up to ``max_peers``): it gets a ticket over
  the overlay, opens one TCP connection and keeps ``depth`` GETs pipelined.
* Rarest first: each free slot takes the missing chunk that the fewest known
  peers hold (a per-node random order breaks ties, so fetchers spread out and
  the original seeder sends each chunk about once before peers take over).
* Have-sets come from heartbeats (:meth:`update_have`) and, fresher, from the
  data connections: the server pushes its bitmap ahead of a GET reply whenever
  it changed (``FLAG_PUSH_HAVE``), and an idle connection polls HAVE every
  ``have_poll_s``.
* Super-seeding: a seed (a peer holding the whole version) is asked only for
  chunks that no other known peer holds, so the seed's uplink carries each
  chunk about once and the fetchers trade the rest; a seed that sent a chunk
  to someone else moments ago answers ``ELSEWHERE`` and the chunk is left to
  the peers (and asked of the seed again after two chunk times at our receive
  rate, 0.1-1 s: :meth:`VersionFetcher._elsewhere_retry`). Once every chunk is
  held by some non-seed peer, a seed is used like any other peer (rarest
  first), which speeds up the tail.
* Every chunk is size- and hash-checked in a worker thread (the event loop
  never hashes), written once at its offset in the version's preallocated file
  (store.py) and marked held - from that moment the node's own chunk server
  offers it to others, read from that same file.
* A bad chunk: thrown away, the chunk goes back to the pool (another peer will
  serve it), the sender is penalised; ``max_strikes`` bad chunks -> banned.
* A stall (no byte for ``stall_timeout`` s), a refused ticket or a broken
  connection: the peer's outstanding chunks go back to the pool and the peer
  cools down (exponential back-off) before it is tried again.
* End game: once every missing chunk is on its way and a seed has a free slot,
  the seed is also asked for the chunk requested longest ago whose peer is a
  *straggler*: its current reply has taken ``STRAGGLER`` times as long as a
  chunk takes at a fair share of what this fetcher receives in all (payload
  bytes in the last ``RATE_WINDOW_S`` over the connections busy now; not one
  connection's rate while a payload arrives: the kernel buffers whole chunks
  while the fetcher reads other connections, and such a read looks instant). Whichever copy arrives first is kept, the other is read
  and dropped. Why not every late chunk: a fetcher whose own downlink is the
  bottleneck sees every chunk as late (replies on one connection come one after
  another, and all connections share the link), while each source sends its fair
  share; a second copy then only takes link from the first. Measured
  (bench/distribution.py --link-caps, docs/benchmarks.md): a 20 Mbit/s fetcher
  received 10 duplicate 4 MiB chunks of a 64 MiB checkpoint and took 1.78x its
  bound.
* Peers are ranked by measured throughput, discounted by failures.
* Resume: the fetcher starts from whatever the store already holds (its journal
  of written chunks), after copying in chunks other versions here share.
* Holders behind NAT (``reverse`` peers: their heartbeat says data port 0 but lists
  chunks) cannot be dialled. When this node's own data port is reachable, it makes a
  single-use ticket (:meth:`ChunkServer.expect_reverse`), sends it in a
  ``ReverseChunkRequest`` over libp2p, and the holder dials in; from there the session is
  the same as with any peer (chunks hash-checked, bad ones charged). A fetcher that is
  itself behind NAT leaves such peers alone: two NAT'd nodes exchange no bulk.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from node.checkpoints.client import DataConnection, DataPlaneError
from node.checkpoints.control import ControlPlane
from node.checkpoints.store import ChunkRejected, ChunkStore, VersionState
from protocol import ChunkTicketRequest, ReverseChunkRequest
from protocol import chunk_frames as F
from protocol.bitmap import Bitmap

if TYPE_CHECKING:
    from node.checkpoints.server import ChunkServer

log = logging.getLogger(__name__)


class TicketError(Exception):
    """No ticket from a peer (timeout, unreachable over the control plane, refused).

    Control flow inside the fetcher (the peer cools down briefly and is tried again),
    never shown to an operator: not a :class:`node.errors.NodeError`."""


# Peers one fetch keeps track of: heartbeats from any identity add peers while a fetch runs.
MAX_KNOWN_PEERS = 1024
# End game: a peer whose reply takes STRAGGLER times as long as a chunk at its fair share of our
# receive rate is a straggler (its chunks may be asked from a seed as well); below that, our own
# downlink is the likelier bottleneck and a second copy would only compete with the first.
STRAGGLER = 3.0
RATE_WINDOW_S = 5.0
ELSEWHERE_RETRY_MIN_S = 0.1  # see VersionFetcher._elsewhere_retry
ELSEWHERE_RETRY_FIRST_S = 0.25  # the same, before any payload arrived
HAVE_POLL_CHUNK = 4 * 1024 * 1024  # chunks this big or bigger: HAVE polled every have_poll_s
HAVE_POLL_MIN_S = 0.02  # smaller chunks: in proportion, but not more often than this


@dataclasses.dataclass
class FetchPeer:
    peer_id: str
    bitmap: Bitmap | None = None
    reverse: bool = False  # behind NAT: it dials us (a reverse connection), we cannot dial it
    running: bool = False
    banned: bool = False
    strikes: int = 0
    failures: int = 0
    cooldown_until: float = 0.0
    ewma_bps: float = 0.0
    bytes: int = 0
    chunks: int = 0
    inflight: set[int] = dataclasses.field(default_factory=set)
    scope: trio.CancelScope | None = None
    last_error: str = ""
    refused: dict[int, float] = dataclasses.field(default_factory=dict)  # chunk -> retry after (ELSEWHERE)
    elsewhere: int = 0
    # When the reply now due on this connection began to be served (trio clock): the previous
    # reply's end, or the GET sent to an idle connection (replies come one after another).
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


@dataclasses.dataclass(frozen=True)
class FetchProgress:
    version: int
    held: int
    total: int
    bytes_fetched: int
    mib_per_s: float
    elapsed_s: float
    done: bool


class VersionFetcher:
    def __init__(
        self,
        store: ChunkStore,
        version: int,
        control: ControlPlane,
        *,
        max_peers: int = 16,
        depth: int = 4,
        max_verifying: int = 16,
        stall_timeout: float = 10.0,
        ticket_timeout: float = 5.0,
        max_strikes: int = 3,
        have_poll_s: float = 0.25,
        superseed: bool = True,
        elsewhere_retry_s: float = 1.0,
        endgame_after_s: float | None = 0.5,
        on_progress: Callable[[FetchProgress], None] | None = None,
        banned: set[str] | None = None,
        rng: random.Random | None = None,
        reverse: ChunkServer | None = None,
        trace: bool = False,
    ) -> None:
        self.store = store
        self.st: VersionState = store.versions[version]
        self.version = version
        self.control = control
        self.max_peers = max_peers
        self.depth = depth
        self.max_verifying = max_verifying
        self.stall_timeout = stall_timeout
        self.ticket_timeout = ticket_timeout
        self.max_strikes = max_strikes
        self.have_poll_s = have_poll_s
        self.superseed = superseed
        self.elsewhere_retry_s = elsewhere_retry_s
        self.endgame_after_s = endgame_after_s
        self.on_progress = on_progress
        self.banned = banned if banned is not None else set()
        # our own chunk server: it takes the connections holders behind NAT open to us
        self.reverse = reverse
        n = self.st.bitmap.n
        self.n = n
        rng = rng or random.Random()
        order = list(range(n))
        rng.shuffle(order)
        self._tiebreak = [0] * n
        for rank, i in enumerate(order):
            self._tiebreak[i] = rank
        self.avail = [0] * n
        self.nseeds = 0  # peers whose bitmap is complete (they count in every avail[i])
        self.peers: dict[str, FetchPeer] = {}
        self._missing: set[int] = {i for i in range(n) if i not in self.st.bitmap}
        self._inflight: dict[int, str] = {}  # chunk -> the peer it was first asked from
        self._inflight_since: dict[int, float] = {}
        self._verifying: set[int] = set()
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        # receive buffers are reused: a fresh 4 MiB bytearray per chunk costs a zero-fill and,
        # from glibc's mmap threshold up, an mmap/munmap with a page fault per 4 KiB page
        self._chunk_len = max((c[2] for c in self.st.chunks), default=0)
        self._free_bufs: list[bytearray] = []
        # an idle connection polls HAVE every have_poll_s for chunks of HAVE_POLL_CHUNK, in
        # proportion for smaller ones: a delta's 256 KiB chunks take ~21 ms at 100 Mbit/s, and
        # a peer's fresh chunk went unseen for up to 0.25 s, 12 chunk times (bench/delta.py)
        if 0 < self._chunk_len < HAVE_POLL_CHUNK:
            scaled = have_poll_s * self._chunk_len / HAVE_POLL_CHUNK
            self.have_poll_s = max(scaled, min(have_poll_s, HAVE_POLL_MIN_S))
        # stats
        self.started = time.monotonic()
        # trio's clock when run() began (a fetcher may be built outside trio: set there)
        self.started_trio: float | None = None
        self.finished: float | None = None
        self.bytes_fetched = 0
        self.chunks_fetched = 0
        self.chunks_rejected = 0
        self.chunks_elsewhere = 0
        self.chunks_endgame = 0  # second requests sent to a seed in the end game
        self.chunks_duplicate = 0  # payloads that arrived after another copy of the chunk
        self.bytes_from_seeds = 0
        # Payloads received (duplicates too: they took the link), for receive_bps().
        self._received: collections.deque[tuple[float, int]] = collections.deque()
        self._last_receive_bps = 0.0
        self.held_at_start = self.st.bitmap.count
        self._rate_window: collections.deque[tuple[float, int]] = collections.deque()
        # When each phase of the fetch first happened, seconds after run() began (trio clock):
        # where a fetch's fixed costs go (ticket, connection, first bitmap, first byte, hashing
        # and writing), see :meth:`_mark`.
        self.phases: dict[str, float] = {}
        # ``trace``: every GET, refusal and payload as (seconds, event, chunk, peer), for
        # benchmarks that need to see the schedule (off by default: it grows with the chunks)
        self.trace: list[tuple[float, str, int, str]] | None = [] if trace else None
        self.verify_s = 0.0  # thread time spent hashing and writing chunks, all chunks

    # ------------------------------------------------------------ inputs
    def add_peer(self, peer_id: str, reverse: bool | None = None) -> FetchPeer | None:
        """A peer to try (``reverse``: it is behind NAT and dials us; None: as known so far).
        Bounded (``MAX_KNOWN_PEERS``): at the cap an idle peer that never showed a bitmap
        makes room, else the newcomer is ignored (None)."""
        p = self.peers.get(peer_id)
        if p is None:
            if len(self.peers) >= MAX_KNOWN_PEERS and not self._evict_idle_peer():
                return None
            p = self.peers[peer_id] = FetchPeer(peer_id, banned=peer_id in self.banned)
            self._poke()
        if reverse is not None and reverse != p.reverse:
            p.reverse = reverse
            self._poke()
        return p

    def _can_reach(self, p: FetchPeer) -> bool:
        """A peer behind NAT only while our own data port is reachable (it must dial us)."""
        return not p.reverse or (self.reverse is not None and self.reverse.reachable())

    def _evict_idle_peer(self) -> bool:
        for pid, q in self.peers.items():
            if q.bitmap is None and not q.running and not q.inflight:
                del self.peers[pid]
                return True
        return False

    def update_have(self, peer_id: str, bitmap: bytes) -> None:
        """A peer's have-bitmap for this version (heartbeat or HAVE reply)."""
        p = self.add_peer(peer_id)
        if p is None or p.banned:
            return
        try:
            new = Bitmap(self.n, bitmap)
        except ValueError:
            self.control.penalise(peer_id, "bad_bitmap")
            return
        self._apply_bitmap(p, new)
        self._poke()

    def _apply_bitmap(self, p: FetchPeer, new: Bitmap | None) -> None:
        old_b = p.bitmap.to_bytes() if p.bitmap is not None else bytes((self.n + 7) // 8)
        new_b = new.to_bytes() if new is not None else bytes(len(old_b))
        if old_b != new_b:
            avail = self.avail
            for bi, (a, b) in enumerate(zip(old_b, new_b)):
                if a != b:
                    for bit in range(8):
                        d = ((b >> bit) & 1) - ((a >> bit) & 1)
                        if d:
                            avail[bi * 8 + bit] += d
        was_seed = p.seed
        p.bitmap = new
        self.nseeds += int(p.seed) - int(was_seed)

    def _poke(self) -> None:
        self._changed.set()

    def _trace(self, event: str, idx: int, p: FetchPeer) -> None:
        if self.trace is not None and self.started_trio is not None:
            self.trace.append((round(trio.current_time() - self.started_trio, 4), event, idx, p.peer_id))

    def _mark(self, phase: str) -> None:
        """Record the first time ``phase`` happened (``status()["phases"]``)."""
        if phase not in self.phases and self.started_trio is not None:
            self.phases[phase] = round(trio.current_time() - self.started_trio, 4)

    # ------------------------------------------------------------ scheduling
    def _pick(self, p: FetchPeer) -> int | None:
        """The next chunk to ask ``p`` for: rarest first; from a seed, only chunks no other peer holds
        (until every chunk is held by some non-seed peer; then the seed helps like any peer)."""
        bm = p.bitmap
        if bm is None:
            return None
        held = self.st.bitmap
        avail, tiebreak = self.avail, self._tiebreak
        seed = self.superseed and p.seed
        nseeds = self.nseeds
        refused = p.refused
        now = trio.current_time() if refused else 0.0
        best = None
        best_key = None
        best_only = None  # seeds: the rarest chunk that only seeds hold
        best_only_key = None
        seed_only_left = False
        stale = []
        for i in self._missing:
            if i in held:
                stale.append(i)
                continue
            if i in bm:
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
            self._missing.discard(i)
        if seed and seed_only_left:
            best = best_only  # None while the seed-only chunks were all just refused: wait
        elif best is None and p.seed and self.endgame_after_s is not None:
            best = self._endgame_pick(p)
            if best is not None:
                self.chunks_endgame += 1
                p.inflight.add(best)  # a second request; the first owner stays in _inflight
            return best
        if best is not None:
            self._missing.discard(best)
            self._inflight[best] = p.peer_id
            self._inflight_since[best] = trio.current_time()
            p.inflight.add(best)
        return best

    def _endgame_pick(self, p: FetchPeer) -> int | None:
        """End game: nothing is left to pick, every missing chunk is on its way from some peer.
        A seed with a free slot also asks for the chunk requested longest ago (at least
        ``endgame_after_s``) from a straggler, so the tail does not wait on one slow, busy peer
        (see the module docstring for why not from any peer)."""
        if self.endgame_after_s is None:
            return None
        now = trio.current_time()
        rate = self.receive_bps()
        if rate <= 0:
            return None  # no chunk has arrived yet: nothing to compare with (stalls are cut anyway)
        fair = rate / max(1, self._busy_connections())
        held, verifying, owner = self.st.bitmap, self._verifying, self._inflight
        peers = self.peers
        best, oldest = None, now - self.endgame_after_s
        for i, since in self._inflight_since.items():
            q = peers.get(owner.get(i, ""))
            if (
                since <= oldest
                and (q is None or q.straggles(fair, self._chunk_len, now))
                and owner.get(i) != p.peer_id
                and i not in p.inflight
                and i not in verifying
                and i not in held
                and p.refused.get(i, 0.0) <= now
            ):
                best, oldest = i, since
        return best

    def receive_bps(self) -> float:
        """Payload bytes per second over the last ``RATE_WINDOW_S`` (trio clock); while nothing
        arrived in that window, the last rate measured (0.0 before anything arrived)."""
        now = trio.current_time()
        w = self._received
        while w and w[0][0] < now - RATE_WINDOW_S:
            w.popleft()
        if w:
            began = self.started_trio if self.started_trio is not None else now
            span = min(RATE_WINDOW_S, max(now - began, 1e-3))
            self._last_receive_bps = sum(b for _, b in w) / span
        return self._last_receive_bps

    def _elsewhere_retry(self) -> float:
        """How long a chunk a seed answered ``ELSEWHERE`` is not asked of it again: two chunk
        times at our receive rate, between ``ELSEWHERE_RETRY_MIN_S`` and ``elsewhere_retry_s``.
        A fixed second was twice the whole fetch of a 64 MiB checkpoint over a 1000 Mbit/s
        link (bench/distribution.py --link-caps): the seed had sent the chunk to a slow host
        and lets it go again once that send proves slow, and the fast fetcher's last chunk
        waited out the second. A retry costs one small request and its refusal."""
        rate = self.receive_bps()
        if rate <= 0 or sum(b for _, b in self._received) < self._chunk_len:
            # nothing received yet, or less than one chunk (a checkpoint's small files, e.g. an
            # 88-byte config, arrive in a moment): a "rate" from those says nothing about a
            # chunk's time, and read as one it held a refused chunk back for the whole second
            return min(ELSEWHERE_RETRY_FIRST_S, self.elsewhere_retry_s)
        return max(
            min(ELSEWHERE_RETRY_MIN_S, self.elsewhere_retry_s), min(self.elsewhere_retry_s, 2 * self._chunk_len / rate)
        )

    def _busy_connections(self) -> int:
        return sum(1 for q in self.peers.values() if q.running and q.inflight)

    def _release(self, i: int, p: FetchPeer | None = None) -> None:
        if p is None or self._inflight.get(i) == p.peer_id:
            self._inflight.pop(i, None)
            self._inflight_since.pop(i, None)
            if i not in self.st.bitmap:
                self._missing.add(i)
        if p is not None:
            p.inflight.discard(i)
        self._poke()

    def _depth(self, p: FetchPeer) -> int:
        if p.failures or p.strikes:
            return max(1, self.depth // 2)
        return self.depth

    @property
    def complete(self) -> bool:
        return self.st.bitmap.complete

    async def run(self) -> None:
        """Fetch until the version is complete (cancel the caller's scope to give up)."""
        self.started_trio = trio.current_time()
        if not self.complete:  # chunks another version here shares are copied, not fetched
            for h in await trio.to_thread.run_sync(self.store.adopt_blocking, self.st):
                self.store.mark_held(h)
            self._missing = {i for i in self._missing if i not in self.st.bitmap}
        self._report()
        if self.complete:
            self.finished = time.monotonic()
            return
        self._mark("scheduled")
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            while not self.complete:
                self._changed = trio.Event()
                self._schedule(nursery)
                with trio.move_on_after(0.5):
                    await self._changed.wait()
            nursery.cancel_scope.cancel()
        self.finished = time.monotonic()
        self._mark("done")
        self._report(force=True)

    def _schedule(self, nursery: trio.Nursery) -> None:
        now = trio.current_time()
        active = sum(1 for p in self.peers.values() if p.running)
        for p in sorted(self.peers.values(), key=lambda q: -q.score()):
            if active >= self.max_peers:
                break
            if p.running or p.banned or p.peer_id in self.banned or now < p.cooldown_until or not self._can_reach(p):
                continue
            p.running = True
            active += 1
            nursery.start_soon(self._peer_worker, p)

    # ------------------------------------------------------------ one peer
    def _hint(self, p: FetchPeer) -> tuple[int, ...]:
        if p.bitmap is not None:
            idx = [i for i in list(self._missing)[:4096] if i in p.bitmap][:16]
            if idx:
                return tuple(idx)
        return tuple(sorted(self._missing)[:16]) or (0,)

    async def _peer_worker(self, p: FetchPeer) -> None:
        conn: DataConnection | None = None
        outstanding: collections.deque[tuple[int, int]] = collections.deque()
        try:
            with trio.CancelScope() as scope:
                p.scope = scope
                if p.reverse:
                    conn = await self._reverse_connection(p)
                else:
                    conn = await self._connection(p)
                if conn.num_chunks != self.n:
                    self.control.penalise(p.peer_id, "bad_chunk_count")
                    raise DataPlaneError(F.BAD_REQUEST, f"peer says {conn.num_chunks} chunks, manifest {self.n}")
                await self._session(p, conn, outstanding)
        except Exception as exc:  # network, protocol or control-plane failure: cool down, retry later
            p.failures += 1
            p.last_error = f"{type(exc).__name__}: {exc}"[:200]
            p.cooldown_until = trio.current_time() + min(30.0, 0.25 * 2 ** min(p.failures, 7))
            if isinstance(exc, TicketError):  # the control plane's problem, not the peer's fault: retry soon
                p.cooldown_until = trio.current_time() + min(5.0, 0.2 * p.failures)
            elif isinstance(exc, trio.TooSlowError):
                self.control.penalise(p.peer_id, "chunk_stall")
            log.debug("peer %s: %s", p.peer_id[-8:], p.last_error)
        finally:
            p.scope = None
            for i in list(p.inflight):
                self._release(i, p)
            p.running = False
            if conn is not None:
                await conn.aclose()
            self._poke()

    async def _connection(self, p: FetchPeer) -> DataConnection:
        """A ticket over the overlay, then our TCP connection to the peer's data port."""
        req = ChunkTicketRequest(version=self.version, root=self.st.root, chunk_indices=self._hint(p))
        try:
            with trio.fail_after(self.ticket_timeout):
                ticket = await self.control.request_ticket(p.peer_id, req, self.ticket_timeout)
        except Exception as exc:
            raise TicketError(f"{type(exc).__name__}: {exc}") from None
        if not ticket.ok:
            raise DataPlaneError(F.BAD_TICKET, f"ticket refused: {ticket.reason}")
        self._mark("first_ticket")
        return await DataConnection.open(
            ticket.host,
            ticket.port,
            ticket.ticket,
            connect_timeout=self.ticket_timeout,
            stall_timeout=self.stall_timeout,
            flags=F.FLAG_PUSH_HAVE,
        )

    async def _reverse_connection(self, p: FetchPeer) -> DataConnection:
        """A peer behind NAT: our single-use ticket goes to it over the overlay, and it dials
        our data port with it (see protocol/chunk_frames.py)."""
        server = self.reverse
        assert server is not None  # _schedule starts reverse peers only with a server
        tok = server.expect_reverse(p.peer_id, self.version, self.st.root)
        req = ReverseChunkRequest(
            version=self.version,
            root=self.st.root,
            chunk_indices=self._hint(p),
            ticket=tok,
            host=server.advertise_host,
            port=server.port,
        )
        try:
            try:
                with trio.fail_after(self.ticket_timeout):
                    answer = await self.control.request_reverse(p.peer_id, req, self.ticket_timeout)
            except Exception as exc:
                raise TicketError(f"{type(exc).__name__}: {exc}") from None
            if not answer.ok:
                raise DataPlaneError(F.BAD_TICKET, f"reverse connection refused: {answer.reason}")
            try:
                stream = await server.accept_reverse(tok, self.ticket_timeout)
            except trio.TooSlowError:
                # not a stall of a chunk: maybe our data port is not reachable after all
                # (no charge), or the holder lied; either way it cools down (back-off)
                raise DataPlaneError(F.BUSY, "the holder did not dial in") from None
        finally:
            server.void_reverse(tok)  # used, refused or unreachable: good for nothing now
        return await DataConnection.over(stream, tok, stall_timeout=self.stall_timeout, flags=F.FLAG_PUSH_HAVE)

    async def _session(self, p: FetchPeer, conn: DataConnection, outstanding: deque[tuple[int, int]]) -> None:
        self._mark("first_connected")
        await conn.send(F.OP_HAVE)
        outstanding.append((F.OP_HAVE, 0))
        last_have = trio.current_time()
        have_pending = True
        while not self.complete and not p.banned:
            while len(p.inflight) < self._depth(p) and len(self._verifying) < self.max_verifying:
                idle = not p.inflight
                i = self._pick(p)
                if i is None:
                    break
                if idle:
                    p.service_start = trio.current_time()
                self._mark("first_get")
                self._trace("get", i, p)
                await conn.send(F.OP_GET, i)
                outstanding.append((F.OP_GET, i))
            now = trio.current_time()
            if not have_pending and now - last_have >= self.have_poll_s and (not outstanding or len(outstanding) < 2):
                await conn.send(F.OP_HAVE)
                outstanding.append((F.OP_HAVE, 0))
                last_have, have_pending = now, True
            if not outstanding:
                wait = self.have_poll_s - (now - last_have)
                if p.refused:  # a refused chunk may be asked again before the next HAVE poll
                    for k in [k for k, until in p.refused.items() if until <= now]:
                        del p.refused[k]  # expired (else an idle session would wake every 10 ms)
                    if p.refused:
                        wait = min(wait, min(p.refused.values()) - now)
                with trio.move_on_after(max(0.01, wait)):
                    await self._changed.wait()
                continue
            rop, status, ridx, length = await conn.read_header()
            pushed = rop == F.OP_HAVE and ridx == F.PUSH_INDEX
            if not pushed:
                op, idx = outstanding.popleft()
                if rop != op or (op == F.OP_GET and ridx != idx):
                    self.control.penalise(p.peer_id, "bad_frame")
                    raise DataPlaneError(F.BAD_REQUEST, "reply out of order")
            if rop == F.OP_HAVE:
                if not pushed:
                    have_pending = False
                if status != F.OK:
                    raise DataPlaneError(status)
                if length != (self.n + 7) // 8:
                    self.control.penalise(p.peer_id, "bad_bitmap")
                    raise DataPlaneError(F.BAD_REQUEST, "bitmap of the wrong size")
                buf = bytearray(length)
                await conn.read_payload_into(memoryview(buf))
                self._mark("first_have")
                self.update_have(p.peer_id, bytes(buf))
                continue
            if status != F.OK:
                p.service_start = trio.current_time()  # the next reply's service starts now
                self._release(idx, p)
                self._trace(F.STATUS_NAMES.get(status, str(status)), idx, p)
                if status == F.ELSEWHERE:  # a super-seeding seed: someone else just got it from there
                    p.elsewhere += 1
                    self.chunks_elsewhere += 1
                    p.refused[idx] = trio.current_time() + self._elsewhere_retry()
                    continue
                if status == F.NOT_HELD and p.bitmap is not None and idx in p.bitmap:
                    nb = p.bitmap.copy()
                    nb.clear(idx)
                    self._apply_bitmap(p, nb)
                    continue
                raise DataPlaneError(status, f"chunk {idx}")
            expected = self.st.chunks[idx][2]
            if length != expected:
                self.chunks_rejected += 1
                self._strike(p, f"chunk {idx}: {length} bytes announced, manifest says {expected}")
                self._release(idx, p)
                raise DataPlaneError(F.BAD_REQUEST, "wrong chunk size")  # cannot resync the stream
            buf = self._free_bufs.pop() if length == self._chunk_len and self._free_bufs else bytearray(length)
            t0 = time.monotonic()
            await conn.read_payload_into(memoryview(buf))
            p.service_start = trio.current_time()
            self._received.append((p.service_start, length))
            self._mark("first_payload")
            self._trace("payload", idx, p)
            self.phases["last_payload"] = round(p.service_start - (self.started_trio or 0.0), 4)
            if idx in self.st.bitmap or idx in self._verifying:  # the other copy of an end-game request won
                self.chunks_duplicate += 1
                p.inflight.discard(idx)
                if length == self._chunk_len and len(self._free_bufs) < 2 * self.max_verifying:
                    self._free_bufs.append(buf)
                continue
            dt = max(time.monotonic() - t0, 1e-6)
            rate = length / dt
            p.ewma_bps = rate if p.ewma_bps == 0 else 0.7 * p.ewma_bps + 0.3 * rate
            if p.seed:
                self.bytes_from_seeds += length
            p.refused.pop(idx, None)
            p.inflight.discard(idx)
            self._verifying.add(idx)
            assert self._nursery is not None  # set by run(), which runs every session
            self._nursery.start_soon(self._verify, p, idx, buf)

    def _strike(self, p: FetchPeer, reason: str) -> None:
        p.strikes += 1
        p.last_error = reason
        self.control.penalise(p.peer_id, "bad_chunk")
        log.warning("bad chunk from %s: %s (strike %d)", p.peer_id[-8:], reason, p.strikes)
        if p.strikes >= self.max_strikes and not p.banned:
            p.banned = True
            self.banned.add(p.peer_id)
            self._apply_bitmap(p, None)
            self.control.ban(p.peer_id, f"{p.strikes} bad chunks")
            if p.scope is not None:
                p.scope.cancel()

    async def _verify(self, p: FetchPeer, idx: int, buf: bytearray) -> None:
        try:
            try:
                h, spent = await trio.to_thread.run_sync(self._put_timed, idx, buf)
                self.verify_s += spent
            except ChunkRejected as exc:
                self.chunks_rejected += 1
                self._strike(p, exc.reason)
                return
            self.store.mark_held(h)
            self._mark("first_held")
            self.bytes_fetched += len(buf)
            self.chunks_fetched += 1
            p.bytes += len(buf)
            p.chunks += 1
            self._rate_window.append((time.monotonic(), len(buf)))
        finally:
            if len(buf) == self._chunk_len and len(self._free_bufs) < 2 * self.max_verifying:
                self._free_bufs.append(buf)
            self._verifying.discard(idx)
            self._release(idx)
            self._report()

    def _put_timed(self, idx: int, buf: bytearray) -> tuple[bytes, float]:
        """Hash-check and write one chunk (worker thread); its hash and the seconds it took."""
        t0 = time.perf_counter()
        h = self.store.put_chunk_blocking(self.st, idx, buf)
        return h, time.perf_counter() - t0

    # ------------------------------------------------------------ progress and stats
    def mib_per_s(self) -> float:
        now = time.monotonic()
        w = self._rate_window
        while w and w[0][0] < now - 3.0:
            w.popleft()
        if not w:
            return 0.0
        span = max(now - max(w[0][0], self.started), 0.25) if len(w) > 1 else max(now - self.started, 0.25)
        return sum(b for _, b in w) / span / 2**20

    def progress(self) -> FetchProgress:
        return FetchProgress(
            version=self.version,
            held=self.st.bitmap.count,
            total=self.n,
            bytes_fetched=self.bytes_fetched,
            mib_per_s=self.mib_per_s(),
            elapsed_s=(self.finished or time.monotonic()) - self.started,
            done=self.complete,
        )

    def _report(self, force: bool = False) -> None:
        if self.on_progress is not None:
            try:
                self.on_progress(self.progress())
            except Exception:
                log.exception("progress callback failed")

    def status(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "chunks_held": self.st.bitmap.count,
            "chunks_total": self.n,
            "bytes_fetched": self.bytes_fetched,
            "chunks_fetched": self.chunks_fetched,
            "chunks_rejected": self.chunks_rejected,
            "chunks_elsewhere": self.chunks_elsewhere,
            "chunks_endgame": self.chunks_endgame,
            "chunks_duplicate": self.chunks_duplicate,
            "bytes_from_seeds": self.bytes_from_seeds,
            "held_at_start": self.held_at_start,
            "seconds": round((self.finished or time.monotonic()) - self.started, 3),
            "phases": dict(self.phases),
            "verify_s": round(self.verify_s, 3),
            **({"trace": list(self.trace)} if self.trace is not None else {}),
            "peers": {pid: p.to_json() for pid, p in self.peers.items() if p.bytes or p.failures or p.strikes},
            "fed_from": sorted(pid for pid, p in self.peers.items() if p.bytes),
        }
