"""The chunk server: grants tickets (called from the libp2p request handler) and serves
chunk bytes over raw TCP with ``sendfile`` (no Python copy of the payload), under the
node-wide upload cap.

Super-seeding: for a version this node holds entirely, the server remembers which
peer it last sent each chunk to. Another peer asking for that chunk within
``reseed_after_s`` of the moment that send started (or, once it finished, of its
end) is answered ``ELSEWHERE``: it should get the chunk from the peer that has it.
The hold-off runs from the start of a send, not from its end, so a peer that asks
for chunks and never reads them pins each one for at most ``reseed_after_s``. So the seeder's uplink carries each chunk
about once and the fetchers multiply it among themselves. Once every chunk has been
sent at least once the hold-off drops to ``reseed_after_all_s`` and the seed helps
finish the tail. A hold-off always ends, so a recipient that disappears costs its
chunks at most that long.

A copy sent to a slow recipient holds nothing off: a send that ran (or, still
running, has run) ``SLOW_RECIPIENT`` times as long as the same chunk takes at
a fair share of the fastest recent upload rate (a send's rate times the sends
running beside it: the upload cap and the uplink are shared, and that must not
make every recipient look slow). A send lasts as long as the link takes, not as long as
copying into the socket's buffer: data connections limit unsent bytes (wire.py,
``TCP_NOTSENT_LOWAT``). Such a peer's uplink is most likely as slow as its
downlink, and the others would wait on it for the chunk (bench/distribution.py
--link-caps: with a 20 Mbit/s fetcher in the swarm, the others' completion was
1.7x what it was without it).

Reverse connections (protocol/chunk_frames.py): a node behind NAT cannot be dialled, so a
reachable fetcher asks it over libp2p to dial in (:meth:`ChunkServer.expect_reverse` makes
the single-use ticket; :meth:`ChunkServer.grant_reverse` is the holder's answer). The
holder's connection then runs the same session as one it accepted: the same upload cap,
per-peer connection limit, super-seeding memory and bytes-served accounting. Bulk never
goes through a relay: only the small ``ReverseChunkRequest`` travels over libp2p.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import ipaddress
import logging
import os
import secrets
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import trio

from node.checkpoints.client import DataPlaneError
from node.checkpoints.ratelimit import UploadLimiter
from node.checkpoints.store import ChunkStore, VersionState
from node.checkpoints.wire import recv_exactly, send_all, tune
from node.util import aclose_shielded
from protocol import ChunkTicket, ChunkTicketRequest, ProtocolError, ReverseChunkAnswer, ReverseChunkRequest
from protocol import chunk_frames as F

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger(__name__)

SLOW_RECIPIENT = 3.0  # see the module docstring
FAST_DECAY = 0.9  # the fastest recent send rate decays by this factor per send
# Sends shorter than this are neither timed nor judged slow (SLOW_RECIPIENT): they finish into
# the upload cap's burst (512 KiB) and the socket's unsent queue (wire.py, 256 KiB), so their
# duration says nothing of the recipient's link. Timing them made a delta's 256 KiB chunks
# look sent at memory speed, every capped send after them "slow", and the seed sent a 5 MB
# delta 1.8-2.1 times over instead of once (docs/benchmarks.md, "Sparse deltas").
RATE_MIN_BYTES = 1024 * 1024
# A reverse ticket: how long the fetcher waits for the holder's connection (it is good once).
REVERSE_TICKET_TTL_S = 15.0
MAX_REVERSE_EXPECTED = 256  # reverse connections one fetcher node waits for at once


class SeedLog:
    """Super-seeding memory for one version held entirely: who got each chunk, and when."""

    __slots__ = ("ever", "running", "sent", "slow", "unsent")

    def __init__(self, n: int) -> None:
        self.sent: dict[int, tuple[str, float]] = {}  # index -> (peer, send started at, or finished at)
        self.running: dict[int, float] = {}  # index -> when its running send started
        self.slow: set[int] = set()  # chunks whose last copy went to a slow recipient
        self.ever = bytearray(n)
        self.unsent = n

    def held_off(
        self, idx: int, peer: str, now: float, hold_s: float, hold_all_s: float, slow_after_s: float = float("inf")
    ) -> bool:
        """Whether ``peer`` should get chunk ``idx`` elsewhere: someone else got it moments ago and
        that send was not slow (finished slow, or running for over ``slow_after_s``)."""
        rec = self.sent.get(idx)
        if rec is None or rec[0] == peer or idx in self.slow:
            return False
        started = self.running.get(idx)
        if started is not None and now - started > slow_after_s:
            return False
        return now < rec[1] + (hold_s if self.unsent else hold_all_s)

    def start(self, idx: int, peer: str, now: float) -> None:
        self.sent[idx] = (peer, now)
        self.running[idx] = now
        self.slow.discard(idx)

    def finish(self, idx: int, peer: str, ok: bool, now: float, slow: bool = False) -> None:
        self.running.pop(idx, None)
        if not ok:
            if self.sent.get(idx, ("",))[0] == peer:
                del self.sent[idx]
            return
        self.sent[idx] = (peer, now)
        if slow:
            self.slow.add(idx)
        if not self.ever[idx]:
            self.ever[idx] = 1
            self.unsent -= 1


class SendPace:
    """The fastest recent upload rate, and which sends went to a slow recipient
    (``SLOW_RECIPIENT``). Pure: the server passes each send's length, seconds and the sends
    running beside it; ``bench/simulate.py`` drives the same object."""

    __slots__ = ("fast_bps",)

    def __init__(self) -> None:
        self.fast_bps = 0.0  # all sends together (decays by FAST_DECAY per send)

    def slow_after_s(self, length: int, sending: int) -> float:
        """A send of ``length`` bytes running longer than this (beside ``sending`` - 1 others)
        goes to a slow recipient."""
        fair = self.fast_bps / max(1, sending)
        if length < RATE_MIN_BYTES or fair <= 0:
            return float("inf")
        return SLOW_RECIPIENT * length / fair

    def sent(self, length: int, seconds: float, share: int) -> bool:
        """Record a finished send that ran beside ``share`` - 1 others; whether its recipient
        was slow."""
        if length < RATE_MIN_BYTES:
            return False
        total = length / max(seconds, 1e-6) * share
        self.fast_bps = max(total, self.fast_bps * FAST_DECAY)
        return total * SLOW_RECIPIENT < self.fast_bps


@dataclasses.dataclass
class Ticket:
    peer_id: str
    version: int
    root: bytes
    expires: float  # trio clock
    expires_ms: int
    reverse: bool = False  # a session on a connection we opened (we are behind NAT)


@dataclasses.dataclass
class ReverseSlot:
    """A reverse connection this node (a reachable fetcher) waits for from ``peer_id``."""

    peer_id: str
    version: int
    root: bytes
    expires: float  # trio clock
    send: trio.MemorySendChannel[trio.SocketStream]
    recv: trio.MemoryReceiveChannel[trio.SocketStream]
    used: bool = False  # a connection presented the ticket (it may arrive before we wait for it)


class ChunkServer:
    def __init__(
        self,
        store: ChunkStore,
        listen_host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        max_upload_mbps: float = 0.0,
        ticket_ttl_s: float = 120.0,
        max_connections: int = 128,
        idle_timeout_s: float = 60.0,
        stall_timeout_s: float = 20.0,
        send_slice: int = 256 * 1024,
        superseed: bool = True,
        reseed_after_s: float = 10.0,
        reseed_after_all_s: float = 1.0,
    ) -> None:
        self.store = store
        self.listen_host = listen_host
        self.port = port
        self.advertise_host = advertise_host or listen_host
        self.bucket = UploadLimiter.from_mbps(max_upload_mbps)
        self.ticket_ttl_s = ticket_ttl_s
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.send_slice = send_slice
        self.superseed = superseed
        self.reseed_after_s = reseed_after_s
        self.reseed_after_all_s = reseed_after_all_s
        self._seeding: dict[tuple[int, bytes], SeedLog] = {}
        self.pace = SendPace()  # the fastest recent upload rate; slow recipients (SLOW_RECIPIENT)
        self._sending = 0  # chunk sends running now
        self.tickets: dict[bytes, Ticket] = {}
        self.max_tickets = 8192  # bounded: tickets that are never used expire, and a peer holds at most
        self.max_tickets_per_peer = 32  # this many at once (its oldest is replaced)
        self.connections = 0
        self.max_connections_per_peer = 8
        self._per_peer: collections.Counter[str] = collections.Counter()
        # stats
        self.bytes_served = 0
        self.chunks_served = 0
        self.bytes_served_by_version: collections.Counter[int] = collections.Counter()
        self.bytes_served_to: collections.Counter[str] = collections.Counter()
        self.tickets_granted = 0
        self.chunks_elsewhere = 0  # GETs answered ELSEWHERE (super-seeding)
        self.have_pushes = 0
        self._started = trio.Event()
        # Reverse connections. ``reachable``: whether peers can dial our data port (the p2p
        # wiring says False while AutoNAT finds us behind NAT); only then do we ask holders
        # behind NAT to dial us.
        self.reachable: Callable[[], bool] = lambda: True
        self._expected: dict[bytes, ReverseSlot] = {}  # fetcher side: ticket -> slot
        self._dialling: collections.Counter[str] = collections.Counter()  # holder side, per fetcher
        self._nursery: trio.Nursery | None = None
        self.bytes_served_reverse = 0
        self.reverse_last_error = ""
        self.reverse: collections.Counter[str] = collections.Counter()  # see status()
        self.reverse_served_to: collections.Counter[str] = collections.Counter()  # fetcher host -> connections

    def set_max_upload_mbps(self, mbps: float) -> None:
        self.bucket = UploadLimiter.from_mbps(mbps)

    # ------------------------------------------------------------ tickets
    def grant_ticket(self, peer_id: str, req: ChunkTicketRequest) -> ChunkTicket:
        """Answer a ChunkTicketRequest from ``peer_id`` (authenticated by libp2p).

        The ticket covers the whole (version, root) for ``ticket_ttl_s``: the
        requested indices are a hint; chunks not held are answered NOT_HELD on
        the data plane, and the fetcher can ask for the current bitmap there.
        """
        st = self.store.get(req.version, req.root)
        if st is None:
            return ChunkTicket(ok=False, reason="version not held", ticket=b"", host="", port=0, expires_ms=0)
        if self.port == 0:
            return ChunkTicket(ok=False, reason="data plane not running", ticket=b"", host="", port=0, expires_ms=0)
        now = trio.current_time()
        self._expire(now)
        mine = [k for k, t in self.tickets.items() if t.peer_id == peer_id] if len(self.tickets) > 64 else []
        if len(mine) >= self.max_tickets_per_peer:
            # a peer asking for tickets it never uses replaces its own oldest, not others'
            del self.tickets[mine[0]]
        if len(self.tickets) >= self.max_tickets:
            return ChunkTicket(
                ok=False, reason="busy: too many outstanding tickets", ticket=b"", host="", port=0, expires_ms=0
            )
        tok = secrets.token_bytes(32)
        expires_ms = int((time.time() + self.ticket_ttl_s) * 1000)
        self.tickets[tok] = Ticket(peer_id, req.version, req.root, now + self.ticket_ttl_s, expires_ms)
        self.tickets_granted += 1
        return ChunkTicket(
            ok=True, reason="", ticket=tok, host=self.advertise_host, port=self.port, expires_ms=expires_ms
        )

    def _expire(self, now: float) -> None:
        if len(self.tickets) > 64:
            for k in [k for k, t in self.tickets.items() if t.expires < now]:
                del self.tickets[k]

    # ------------------------------------------------------------ reverse connections
    def expect_reverse(self, peer_id: str, version: int, root: bytes, ttl_s: float = REVERSE_TICKET_TTL_S) -> bytes:
        """Fetcher side: a fresh ticket for one connection from ``peer_id`` (a holder behind NAT),
        to send it over libp2p in a ``ReverseChunkRequest``; then :meth:`accept_reverse`."""
        now = trio.current_time()
        for k in [k for k, sl in self._expected.items() if sl.expires < now]:
            self._expected.pop(k).send.close()
        if len(self._expected) >= MAX_REVERSE_EXPECTED:
            raise DataPlaneError(F.BUSY, "too many reverse connections expected")
        tok = secrets.token_bytes(F.TICKET_LEN)
        send, recv = trio.open_memory_channel[trio.SocketStream](1)
        self._expected[tok] = ReverseSlot(peer_id, version, root, now + ttl_s, send, recv)
        self.reverse["expected"] += 1
        return tok

    async def accept_reverse(self, ticket: bytes, timeout: float) -> trio.SocketStream:
        """Fetcher side: the connection the holder opened with ``ticket`` (its HELLO read);
        TooSlowError after ``timeout``. The ticket is void afterwards, used or not."""
        slot = self._expected.get(ticket)
        if slot is None:
            raise DataPlaneError(F.BAD_TICKET, "reverse ticket unknown or expired")
        try:
            with trio.fail_after(timeout):
                return await slot.recv.receive()
        finally:
            self._expected.pop(ticket, None)
            try:  # delivered just as we gave up: nobody will read it
                late = slot.recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                pass
            else:
                await aclose_shielded(late.aclose)
            slot.recv.close()

    def void_reverse(self, ticket: bytes) -> None:
        """Fetcher side: forget ``ticket`` (the holder refused, or could not be asked)."""
        slot = self._expected.pop(ticket, None)
        if slot is not None:
            slot.send.close()

    def grant_reverse(
        self, peer_id: str, req: ReverseChunkRequest, allowed_hosts: Collection[str] | None = None
    ) -> ReverseChunkAnswer:
        """Holder side: answer ``peer_id``'s request to be dialled (``ok``: dialling now).

        We dial only an IP address among ``allowed_hosts`` (the requester's own advertised
        addresses; None: no check, in-process overlays), at most ``max_connections_per_peer``
        connections per requester, and only for a version we hold."""
        refuse = self._reverse_refusal(peer_id, req, allowed_hosts)
        if refuse:
            self.reverse["refused"] += 1
            return ReverseChunkAnswer(ok=False, reason=refuse)
        assert self._nursery is not None  # _reverse_refusal checked it
        self._dialling[peer_id] += 1
        self.reverse["granted"] += 1
        st = self.store.get(req.version, req.root)
        if st is not None and st.bitmap.count == 0:
            self.reverse["granted_holding_none"] += 1  # the fetcher asked early: it may poll HAVE
        self._nursery.start_soon(self._reverse_dial, peer_id, req)
        return ReverseChunkAnswer(ok=True, reason="")

    def _reverse_refusal(self, peer_id: str, req: ReverseChunkRequest, allowed: Collection[str] | None) -> str:
        if self.store.get(req.version, req.root) is None:
            return "version not held"
        if self._nursery is None:
            return "data plane not running"
        try:
            ipaddress.ip_address(req.host)
        except ValueError:
            return "host must be an IP address"
        if allowed is not None and req.host not in allowed:
            return "host is not one of your advertised addresses"
        if self._per_peer[peer_id] + self._dialling[peer_id] >= self.max_connections_per_peer:
            return "busy: too many connections to you"
        if self.connections >= self.max_connections:
            return "busy: too many connections"
        return ""

    async def _reverse_dial(self, peer_id: str, req: ReverseChunkRequest) -> None:
        """Holder side: dial the fetcher, present its ticket, check it echoes the ticket back
        (we serve only the fetcher that asked), then serve it as if it had dialled us."""
        stream = None
        try:
            try:
                with trio.fail_after(self.stall_timeout_s):
                    stream = await trio.open_tcp_stream(req.host, req.port)
            finally:
                self._dialling[peer_id] -= 1
                if self._dialling[peer_id] <= 0:
                    del self._dialling[peer_id]
            self.reverse["dials_ok"] += 1
            sock = stream.socket
            self.connections += 1
            try:
                tune(sock)
                await send_all(sock, F.pack_hello(F.FLAG_REVERSE, req.ticket), self.stall_timeout_s)
                try:
                    hello = F.parse_hello(await recv_exactly(sock, F.HELLO.size, self.stall_timeout_s))
                except ProtocolError as exc:
                    self.reverse["bad_echo"] += 1
                    log.info("reverse connection to %s: %s", peer_id, exc)
                    return
                if hello.reverse or not hmac.compare_digest(hello.ticket, req.ticket):
                    self.reverse["bad_echo"] += 1
                    return
                self.reverse["served_connections"] += 1
                self.reverse_served_to[req.host] += 1
                t = Ticket(peer_id, req.version, req.root, float("inf"), 0, reverse=True)
                await self._serve_session(sock, t, hello.flags)
            finally:
                self.connections -= 1
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError) as exc:
            if stream is None:
                self.reverse["dials_failed"] += 1
            self.reverse_last_error = f"{type(exc).__name__}: {exc}"[:200]
            log.debug("reverse data connection to %s ended: %r", peer_id, exc)
        finally:
            if stream is not None:
                await aclose_shielded(stream.aclose)

    def _take_reverse(self, stream: trio.SocketStream, ticket: bytes) -> bool:
        """Fetcher side: a reverse HELLO arrived; hand the stream to the fetcher that expects it.
        A ticket is good once, before its expiry: a replay, a guess or a late one is refused."""
        slot = self._expected.get(ticket)
        if slot is None or slot.used or slot.expires < trio.current_time():
            self.reverse["bad_tickets"] += 1
            return False
        slot.used = True
        # trio closes an accepted stream when its handler returns: the fetcher gets its own
        # descriptor of the same connection (closing one of two does not end the connection)
        mine = trio.SocketStream(stream.socket.dup())
        try:
            slot.send.send_nowait(mine)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            mine.socket.close()
            return False
        self.reverse["accepted"] += 1
        return True

    # ------------------------------------------------------------ serving
    async def run(self, task_status: TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host=self.listen_host, backlog=256)
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(trio.serve_listeners, self._handle, listeners)
            task_status.started(self.port)
            self._started.set()

    async def _handle(self, stream: trio.SocketStream) -> None:
        sock = stream.socket
        peer = "?"
        try:
            if self.connections >= self.max_connections:
                return
            self.connections += 1
            try:
                tune(sock)
                try:
                    hello = F.parse_hello(await recv_exactly(sock, F.HELLO.size, self.stall_timeout_s))
                except ProtocolError:
                    return
                if hello.reverse:  # a holder behind NAT dialled us: hand it to our fetcher
                    self._take_reverse(stream, hello.ticket)
                    return  # refused: closed without a word (the holder reads no HELLO back)
                t = self.tickets.get(hello.ticket)
                if t is None or t.expires < trio.current_time():
                    await send_all(sock, F.WELCOME.pack(F.MAGIC, F.BAD_TICKET, 0, 0), self.stall_timeout_s)
                    return
                peer = t.peer_id
                await self._serve_session(sock, t, hello.flags)
            finally:
                self.connections -= 1
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError) as exc:
            log.debug("data connection from %s ended: %r", peer, exc)
        finally:
            await aclose_shielded(stream.aclose)

    async def _serve_session(self, sock: trio.socket.SocketType, t: Ticket, flags: int) -> None:
        """WELCOME and requests until BYE or idle, whichever side dialled."""
        peer = t.peer_id
        st = self.store.get(t.version, t.root)
        if st is None:
            await send_all(sock, F.WELCOME.pack(F.MAGIC, F.GONE, 0, 0), self.stall_timeout_s)
            return
        if self._per_peer[peer] >= self.max_connections_per_peer:
            # one identity may not take every slot (e.g. requesting chunks it never reads)
            await send_all(sock, F.WELCOME.pack(F.MAGIC, F.BUSY, 0, 0), self.stall_timeout_s)
            return
        self._per_peer[peer] += 1
        try:
            await send_all(sock, F.WELCOME.pack(F.MAGIC, F.OK, st.bitmap.n, 0), self.stall_timeout_s)
            await self._serve(sock, t, flags)
        finally:
            self._per_peer[peer] -= 1
            if self._per_peer[peer] <= 0:
                del self._per_peer[peer]

    def _seed_log(self, st: VersionState) -> SeedLog | None:
        if not self.superseed or not st.bitmap.complete:
            return None
        key = (st.version, st.root)
        sl = self._seeding.get(key)
        if sl is None:
            for k in [k for k in self._seeding if self.store.get(*k) is None]:
                del self._seeding[k]  # versions garbage-collected since
            sl = self._seeding[key] = SeedLog(st.bitmap.n)
        return sl

    async def _serve(self, sock: trio.socket.SocketType, t: Ticket, flags: int = 0) -> None:
        push = bool(flags & F.FLAG_PUSH_HAVE)
        pushed = b""
        while True:
            req = None
            with trio.move_on_after(self.idle_timeout_s):
                req = await recv_exactly(sock, F.REQUEST.size, self.idle_timeout_s + 1)
            if req is None:
                return  # idle: the fetcher will reconnect when it needs more
            op, idx, _ = F.REQUEST.unpack(req)
            if op == F.OP_BYE:
                return
            st = self.store.get(t.version, t.root)
            if st is None:
                await send_all(sock, F.REPLY.pack(op, F.GONE, idx, 0), self.stall_timeout_s)
                return
            if t.reverse:  # what a fetcher asked over a connection we opened (status: reverse)
                self.reverse["asked_have" if op == F.OP_HAVE else "asked_get" if op == F.OP_GET else "asked_other"] += 1
            if op == F.OP_HAVE:
                bm = pushed = st.bitmap.to_bytes()
                await send_all(sock, F.REPLY.pack(op, F.OK, 0, len(bm)) + bm, self.stall_timeout_s)
            elif op == F.OP_GET:
                if push:
                    bm = st.bitmap.to_bytes()
                    if bm != pushed:  # fresh chunks since the last bitmap this fetcher saw
                        pushed = bm
                        self.have_pushes += 1
                        await send_all(
                            sock, F.REPLY.pack(F.OP_HAVE, F.OK, F.PUSH_INDEX, len(bm)) + bm, self.stall_timeout_s
                        )
                sl = self._seed_log(st) if idx < st.bitmap.n else None
                if idx >= st.bitmap.n:
                    await send_all(sock, F.REPLY.pack(op, F.BAD_INDEX, idx, 0), self.stall_timeout_s)
                elif idx not in st.bitmap:
                    if t.reverse:
                        self.reverse["answered_not_held"] += 1
                    await send_all(sock, F.REPLY.pack(op, F.NOT_HELD, idx, 0), self.stall_timeout_s)
                elif sl is not None and sl.held_off(
                    idx,
                    t.peer_id,
                    trio.current_time(),
                    self.reseed_after_s,
                    self.reseed_after_all_s,
                    self.pace.slow_after_s(st.chunks[idx][2], self._sending),
                ):
                    self.chunks_elsewhere += 1
                    if t.reverse:
                        self.reverse["answered_elsewhere"] += 1
                    await send_all(sock, F.REPLY.pack(op, F.ELSEWHERE, idx, 0), self.stall_timeout_s)
                else:
                    ok = False
                    started = trio.current_time()
                    if sl is not None:
                        sl.start(idx, t.peer_id, started)
                    self._sending += 1
                    beside = self._sending
                    try:
                        with self.store.pin(t.version):
                            await self._send_chunk(sock, st, idx, t.peer_id)
                        ok = True
                        if t.reverse:  # whole chunks sent over connections we opened
                            self.bytes_served_reverse += st.chunks[idx][2]
                    finally:
                        now = trio.current_time()
                        share = max(beside, self._sending)
                        self._sending -= 1
                        slow = ok and self.pace.sent(st.chunks[idx][2], now - started, share)
                        if sl is not None:
                            sl.finish(idx, t.peer_id, ok, now, slow)
            else:
                await send_all(sock, F.REPLY.pack(op, F.BAD_REQUEST, idx, 0), self.stall_timeout_s)
                return

    async def _send_chunk(self, sock: trio.socket.SocketType, st: VersionState, idx: int, peer: str) -> None:
        # the chunk's range of the version's file (written in place as it was verified)
        fd, base, length = self.store.open_chunk(st, idx)
        try:
            await send_all(sock, F.REPLY.pack(F.OP_GET, F.OK, idx, length), self.stall_timeout_s)
            off = 0
            out = sock.fileno()
            while off < length:
                n = min(self.send_slice, length - off)
                await self.bucket.take(n)
                end = off + n
                while off < end:
                    try:
                        w = os.sendfile(out, fd, base + off, end - off)
                    except BlockingIOError:
                        with trio.fail_after(self.stall_timeout_s):
                            await trio.lowlevel.wait_writable(out)
                        continue
                    if w == 0:
                        raise trio.BrokenResourceError("sendfile wrote nothing")
                    off += w
                    self.bytes_served += w
                    self.bytes_served_by_version[st.version] += w
                    self.bytes_served_to[peer] += w
                await trio.lowlevel.checkpoint()
            self.chunks_served += 1
        finally:
            os.close(fd)

    def status(self) -> dict[str, Any]:
        return {
            "port": self.port,
            "connections": self.connections,
            "bytes_served": self.bytes_served,
            "chunks_served": self.chunks_served,
            "bytes_served_by_version": dict(self.bytes_served_by_version),
            "bytes_served_to": dict(self.bytes_served_to),
            "tickets_granted": self.tickets_granted,
            "chunks_elsewhere": self.chunks_elsewhere,
            "have_pushes": self.have_pushes,
            "max_upload_bytes_per_s": self.bucket.rate,
            # reverse connections: as a holder behind NAT (granted, refused, dials_ok,
            # dials_failed, served_connections, bad_echo) and as a reachable fetcher
            # (expected, accepted, bad_tickets: replayed, guessed or late tickets refused)
            "reverse": dict(self.reverse),
            "bytes_served_reverse": self.bytes_served_reverse,
            "reverse_served_to": dict(self.reverse_served_to),
            "reverse_last_error": self.reverse_last_error,
        }
