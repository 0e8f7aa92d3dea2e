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
  rate, 0.1-1 s: :meth:`FetchSchedule.elsewhere_retry`). Once every chunk is
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
from node.checkpoints.schedule import FetchPeer, FetchSchedule
from node.checkpoints.store import ChunkRejected, ChunkStore, VersionState
from protocol import ChunkTicketRequest, ReverseChunkRequest
from protocol import chunk_frames as F

if TYPE_CHECKING:
    from node.checkpoints.server import ChunkServer

log = logging.getLogger(__name__)


class TicketError(Exception):
    """No ticket from a peer (timeout, unreachable over the control plane, refused).

    Control flow inside the fetcher (the peer cools down briefly and is tried again),
    never shown to an operator: not a :class:`node.errors.NodeError`."""


HAVE_POLL_CHUNK = 4 * 1024 * 1024  # chunks this big or bigger: HAVE polled every have_poll_s
HAVE_POLL_MIN_S = 0.02  # smaller chunks: in proportion, but not more often than this


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
    """Drives one version's :class:`FetchSchedule` over real connections: a session task per
    peer the schedule starts, tickets over the control plane, GETs and replies on the data
    connection, chunk checks in worker threads. Every decision is the schedule's."""

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
        self.stall_timeout = stall_timeout
        self.ticket_timeout = ticket_timeout
        self.have_poll_s = have_poll_s
        self.on_progress = on_progress
        # our own chunk server: it takes the connections holders behind NAT open to us
        self.reverse = reverse
        self.n = self.st.bitmap.n
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        # receive buffers are reused: a fresh 4 MiB bytearray per chunk costs a zero-fill and,
        # from glibc's mmap threshold up, an mmap/munmap with a page fault per 4 KiB page
        self._chunk_len = max((c[2] for c in self.st.chunks), default=0)
        self.schedule = FetchSchedule(
            self.st.bitmap,
            self._chunk_len,
            depth=depth,
            max_verifying=max_verifying,
            max_strikes=max_strikes,
            superseed=superseed,
            elsewhere_retry_s=elsewhere_retry_s,
            endgame_after_s=endgame_after_s,
            banned=banned,
            rng=rng,
            wake=self._poke,
        )
        self.banned = self.schedule.banned
        self._scopes: dict[str, trio.CancelScope] = {}  # peer -> its running session
        self._free_bufs: list[bytearray] = []
        # an idle connection polls HAVE every have_poll_s for chunks of HAVE_POLL_CHUNK, in
        # proportion for smaller ones: a delta's 256 KiB chunks take ~21 ms at 100 Mbit/s, and
        # a peer's fresh chunk went unseen for up to 0.25 s, 12 chunk times (bench/delta.py)
        if 0 < self._chunk_len < HAVE_POLL_CHUNK:
            scaled = have_poll_s * self._chunk_len / HAVE_POLL_CHUNK
            self.have_poll_s = max(scaled, min(have_poll_s, HAVE_POLL_MIN_S))
        # trio's clock when run() began and ended (a fetcher may be built outside trio: set
        # there); a finished fetcher's stats read no clock, so they can be read after trio ends
        self.started: float | None = None
        self.finished: float | None = None
        self.bytes_fetched = 0
        self.chunks_fetched = 0
        self.chunks_rejected = 0
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

    @property
    def peers(self) -> dict[str, FetchPeer]:
        return self.schedule.peers

    # ------------------------------------------------------------ inputs
    def add_peer(self, peer_id: str, reverse: bool | None = None) -> FetchPeer | None:
        """A peer to try (see :meth:`FetchSchedule.add_peer`)."""
        return self.schedule.add_peer(peer_id, reverse)

    def update_have(self, peer_id: str, bitmap: bytes) -> None:
        """A peer's have-bitmap for this version (heartbeat or HAVE reply); a malformed one is
        charged."""
        if not self.schedule.update_have(peer_id, bitmap):
            self.control.penalise(peer_id, "bad_bitmap")

    def _can_reach(self, p: FetchPeer) -> bool:
        """A peer behind NAT only while our own data port is reachable (it must dial us)."""
        return not p.reverse or (self.reverse is not None and self.reverse.reachable())

    def _poke(self) -> None:
        self._changed.set()

    def _trace(self, event: str, idx: int, p: FetchPeer) -> None:
        if self.trace is not None and self.started is not None:
            self.trace.append((round(trio.current_time() - self.started, 4), event, idx, p.peer_id))

    def _mark(self, phase: str) -> None:
        """Record the first time ``phase`` happened (``status()["phases"]``)."""
        if phase not in self.phases and self.started is not None:
            self.phases[phase] = round(trio.current_time() - self.started, 4)

    @property
    def complete(self) -> bool:
        return self.st.bitmap.complete

    async def run(self) -> None:
        """Fetch until the version is complete (cancel the caller's scope to give up)."""
        self.started = trio.current_time()
        if not self.complete:  # chunks another version here shares are copied, not fetched
            for h in await trio.to_thread.run_sync(self.store.adopt_blocking, self.st):
                self.store.mark_held(h)
        self.schedule.start(trio.current_time())
        self._report()
        if self.complete:
            self.finished = trio.current_time()
            return
        self._mark("scheduled")
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            while not self.complete:
                self._changed = trio.Event()
                for p in self.schedule.to_start(trio.current_time(), self.max_peers, self._can_reach):
                    nursery.start_soon(self._peer_worker, p)
                with trio.move_on_after(0.5):
                    await self._changed.wait()
            nursery.cancel_scope.cancel()
        self.finished = trio.current_time()
        self._mark("done")
        self._report(force=True)

    # ------------------------------------------------------------ one peer
    async def _peer_worker(self, p: FetchPeer) -> None:
        conn: DataConnection | None = None
        outstanding: collections.deque[tuple[int, int]] = collections.deque()
        try:
            with trio.CancelScope() as scope:
                self._scopes[p.peer_id] = scope
                if p.reverse:
                    conn = await self._reverse_connection(p)
                else:
                    conn = await self._connection(p)
                if conn.num_chunks != self.n:
                    self.control.penalise(p.peer_id, "bad_chunk_count")
                    raise DataPlaneError(F.BAD_REQUEST, f"peer says {conn.num_chunks} chunks, manifest {self.n}")
                await self._session(p, conn, outstanding)
        except Exception as exc:  # network, protocol or control-plane failure: cool down, retry later
            ticket = isinstance(exc, TicketError)  # the control plane's problem, not the peer's: retry soon
            self.schedule.failed(p, trio.current_time(), f"{type(exc).__name__}: {exc}", ticket=ticket)
            if isinstance(exc, trio.TooSlowError):
                self.control.penalise(p.peer_id, "chunk_stall")
            log.debug("peer %s: %s", p.peer_id[-8:], p.last_error)
        finally:
            self._scopes.pop(p.peer_id, None)
            self.schedule.ended(p)
            if conn is not None:
                await conn.aclose()

    async def _connection(self, p: FetchPeer) -> DataConnection:
        """A ticket over the overlay, then our TCP connection to the peer's data port."""
        req = ChunkTicketRequest(version=self.version, root=self.st.root, chunk_indices=self.schedule.hint(p))
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
        assert server is not None  # the schedule starts reverse peers only with a server
        tok = server.expect_reverse(p.peer_id, self.version, self.st.root)
        req = ReverseChunkRequest(
            version=self.version,
            root=self.st.root,
            chunk_indices=self.schedule.hint(p),
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
        sched = self.schedule
        self._mark("first_connected")
        await conn.send(F.OP_HAVE)
        outstanding.append((F.OP_HAVE, 0))
        last_have = trio.current_time()
        have_pending = True
        while not self.complete and not p.banned:
            while (i := sched.next_request(p, trio.current_time())) is not None:
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
                self._trace(F.STATUS_NAMES.get(status, str(status)), idx, p)
                if sched.refused_reply(p, idx, status, trio.current_time()):
                    continue
                raise DataPlaneError(status, f"chunk {idx}")
            expected = self.st.chunks[idx][2]
            if length != expected:
                self.chunks_rejected += 1
                self._strike(p, f"chunk {idx}: {length} bytes announced, manifest says {expected}")
                sched.release(idx, p)
                raise DataPlaneError(F.BAD_REQUEST, "wrong chunk size")  # cannot resync the stream
            buf = self._free_bufs.pop() if length == self._chunk_len and self._free_bufs else bytearray(length)
            t0 = time.perf_counter()  # one payload's read time, for the peer's rate: a measurement
            await conn.read_payload_into(memoryview(buf))
            read_s = time.perf_counter() - t0
            now = trio.current_time()
            self._mark("first_payload")
            self._trace("payload", idx, p)
            self.phases["last_payload"] = round(now - (self.started or 0.0), 4)
            if not sched.payload(p, idx, length, now, read_s):  # the other copy of an end-game request won
                if length == self._chunk_len and len(self._free_bufs) < 2 * sched.max_verifying:
                    self._free_bufs.append(buf)
                continue
            assert self._nursery is not None  # set by run(), which runs every session
            self._nursery.start_soon(self._verify, p, idx, buf)

    def _strike(self, p: FetchPeer, reason: str) -> None:
        self.control.penalise(p.peer_id, "bad_chunk")
        banned = self.schedule.strike(p, reason)
        log.warning("bad chunk from %s: %s (strike %d)", p.peer_id[-8:], reason, p.strikes)
        if banned:
            self.control.ban(p.peer_id, f"{p.strikes} bad chunks")
            scope = self._scopes.get(p.peer_id)
            if scope is not None:
                scope.cancel()

    async def _verify(self, p: FetchPeer, idx: int, buf: bytearray) -> None:
        ok = False
        try:
            try:
                h, spent = await trio.to_thread.run_sync(self._put_timed, idx, buf)
                self.verify_s += spent
            except ChunkRejected as exc:
                self.chunks_rejected += 1
                self._strike(p, exc.reason)
                return
            self.store.mark_held(h)
            ok = True
            self._mark("first_held")
            self.bytes_fetched += len(buf)
            self.chunks_fetched += 1
            self._rate_window.append((trio.current_time(), len(buf)))
        finally:
            if len(buf) == self._chunk_len and len(self._free_bufs) < 2 * self.schedule.max_verifying:
                self._free_bufs.append(buf)
            self.schedule.checked(p, idx, len(buf), ok)
            self._report()

    def _put_timed(self, idx: int, buf: bytearray) -> tuple[bytes, float]:
        """Hash-check and write one chunk (worker thread); its hash and the seconds it took."""
        t0 = time.perf_counter()
        h = self.store.put_chunk_blocking(self.st, idx, buf)
        return h, time.perf_counter() - t0

    # ------------------------------------------------------------ progress and stats
    def _now(self) -> float:
        """trio's clock, or the finish time once the fetch is over (read after trio ended)."""
        return self.finished if self.finished is not None else trio.current_time()

    def elapsed_s(self) -> float:
        """Seconds since :meth:`run` began (until it ended); 0 before."""
        return 0.0 if self.started is None else self._now() - self.started

    def mib_per_s(self) -> float:
        """The receive rate over the last 3 s (the whole fetch once it ended)."""
        w = self._rate_window
        if not w or self.started is None:
            return 0.0
        now = self._now()
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
            elapsed_s=self.elapsed_s(),
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
            "chunks_elsewhere": self.schedule.chunks_elsewhere,
            "chunks_endgame": self.schedule.chunks_endgame,
            "chunks_duplicate": self.schedule.chunks_duplicate,
            "bytes_from_seeds": self.schedule.bytes_from_seeds,
            "held_at_start": self.held_at_start,
            "seconds": round(self.elapsed_s(), 3),
            "phases": dict(self.phases),
            "verify_s": round(self.verify_s, 3),
            **({"trace": list(self.trace)} if self.trace is not None else {}),
            "peers": {pid: p.to_json() for pid, p in self.peers.items() if p.bytes or p.failures or p.strikes},
            "fed_from": sorted(pid for pid, p in self.peers.items() if p.bytes),
        }
