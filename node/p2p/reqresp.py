"""Request/response over libp2p streams: "ask peer X for object H".

One stream per exchange: the requester writes one frame, the responder writes
one frame and closes. The frames, their caps, the pre-run rule and the error
codes on the wire are ``protocol.reqresp``; this module owns the streams. Both
sides verify the envelope and require its signer to be the peer at the other
end of the authenticated (Noise) connection. Every read and write has a
deadline; frames over the cap are refused before they are read.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

import protocol
from node.p2p.clock import ClockSkew
from node.p2p.metrics import NodeMetrics
from node.p2p.rrlimits import StreamAccounting, StreamLimits
from node.p2p.standing import PeerStanding
from node.util import aclose_shielded, now_ms
from protocol import Envelope, ErrorResponse, Message, NodeKey, ProtocolError, ReplayGuard, SequenceCounter
from protocol import reqresp as frames

log = logging.getLogger(__name__)

RR_PROTOCOL = TProtocol(frames.PROTOCOL_ID)

# handler(envelope, peer_id) -> response message (or ErrorResponse); may be async
RequestHandler = Callable[[Envelope, str], Any]


class RequestError(Exception):
    """A request failed: ``code`` is "timeout", "unreachable", "unsupported" (a libp2p peer
    that does not speak primenode's request/response protocol), "refused", "bad_response",
    "too_large", "closed", or the remote's ErrorResponse code."""

    def __init__(self, code: str, detail: str = "") -> None:
        self.code = code
        self.detail = detail
        super().__init__(f"{code}: {detail}" if detail else code)


def protocol_refused(exc: BaseException) -> bool:
    """The remote answered multistream-select with "na": it is up but does not speak the
    protocol. py-libp2p says so only in the *cause* of the StreamFailure it raises."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if "not supported" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def foreign_peer_detail(peer_id: str, protocol_id: str = RR_PROTOCOL) -> str:
    """The one line an operator sees when a peer is libp2p but not primenode."""
    return f"{peer_id} is a libp2p node but does not speak primenode ({protocol_id} not supported)"


async def write_frame(stream: INetStream, data: bytes) -> None:
    await stream.write(frames.encode_frame(data))


async def read_exactly(stream: INetStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = await stream.read(n - len(buf))
        if not part:
            raise RequestError("closed", f"stream ended after {len(buf)} of {n} bytes")
        buf += part
    return bytes(buf)


async def read_frame(stream: INetStream, max_bytes: int) -> bytes:
    try:
        n = frames.frame_size(await read_exactly(stream, frames.LEN_BYTES), max_bytes)
    except ProtocolError as exc:
        raise RequestError("too_large", exc.detail) from None
    return await read_exactly(stream, n)


class ReqResp:
    """Request/response for one node.

    * ``register(RequestType, handler)``: answer requests of that type;
      ``handler(envelope, peer_id)`` returns the response message (or an
      ``ErrorResponse``); exceptions become ``ErrorResponse("internal")``.
    * ``await request(peer_id, message, expect=ResponseType, timeout=10)``:
      returns the verified response ``Envelope``; raises :class:`RequestError`.
    """

    def __init__(
        self,
        host: IHost,
        key: NodeKey,
        run_id: bytes,
        *,
        standing: PeerStanding,
        metrics: NodeMetrics,
        seq: SequenceCounter,
        handler_timeout: float = 30.0,
        io_timeout: float = 30.0,
        max_concurrent: int = 64,
        limits: StreamLimits | None = None,
        wall_ms: Callable[[], int] = now_ms,
    ) -> None:
        self.host = host
        # the wall clock envelopes are sealed and judged by (tests shift it: node/p2p/clock.py)
        self.wall_ms = wall_ms
        self.clock_skew: ClockSkew | None = None
        self.key = key
        self.run_id = run_id
        self.standing = standing
        self.metrics = metrics
        self.seq = seq
        self.handler_timeout = handler_timeout
        self.io_timeout = io_timeout
        self._handlers: dict[int, tuple[type[Message], RequestHandler]] = {}
        self._guard_in = ReplayGuard()
        self._guard_out = ReplayGuard()
        # Inbound streams and handler slots per peer and in total (node/p2p/rrlimits.py):
        # one peer can neither hold another's share nor make it wait for a slot.
        if limits is None:
            limits = StreamLimits(
                total_slots=max_concurrent,
                slots_per_peer=min(StreamLimits.slots_per_peer, max_concurrent),
                max_read_s=io_timeout,
            )
        self.streams = StreamAccounting(limits)
        self._live: dict[int, tuple[trio.CancelScope, trio.Event]] = {}
        self._preempted: set[int] = set()
        self.rtt_ms: dict[str, float] = {}
        # Called before a request to a peer we hold no connection to (the node's NatService:
        # a NAT'd peer known only by relay circuit addresses is dialled through its relay).
        self.before_dial: Callable[[str], Awaitable[None]] | None = None
        host.set_stream_handler(RR_PROTOCOL, self._serve)

    def register(self, request_type: type[Message], handler: RequestHandler) -> None:
        self._handlers[request_type.TYPE_ID] = (request_type, handler)

    # ---------------------------------------------------------------- client
    async def _open_stream(self, peer_id: str, redial: bool = True):
        """A new request stream to ``peer_id``. With ``redial``, if opening it on the existing
        connection fails (a connection gone dead under load: "handshake write failed"), that
        connection is closed and one fresh dial is tried, so a live peer is not reported
        unreachable (and, by the roles, charged for not serving a batch) because of a stale
        connection of ours. A peer that answers but does not speak the protocol is not redialled."""
        pid = ID.from_base58(peer_id)
        for attempt in (0, 1) if redial else (1,):
            had_connection = attempt == 0 and bool(self.host.get_network().get_connections(pid))
            if not had_connection and self.before_dial is not None:
                await self.before_dial(peer_id)
            try:
                return await self.host.new_stream(pid, [RR_PROTOCOL])
            except trio.Cancelled:
                raise
            except Exception as exc:
                if protocol_refused(exc):  # a live peer that is not primenode: no redial
                    raise RequestError("unsupported", foreign_peer_detail(peer_id)) from None
                if attempt == 1 or not had_connection:
                    raise RequestError("unreachable", f"{type(exc).__name__}: {exc}") from None
                self.metrics.on_request("stream", "client", "redial")
                with trio.move_on_after(2) as cs:
                    cs.shield = True
                    try:
                        await self.host.disconnect(pid)
                    except Exception:
                        log.debug("closing a dead connection to %s failed", peer_id, exc_info=True)
        raise AssertionError("unreachable")  # pragma: no cover

    async def request(
        self,
        peer_id: str,
        message: Message,
        expect: type[Message] | Iterable[type[Message]],
        *,
        timeout: float = 10.0,
        max_bytes: int | None = None,
        redial: bool = False,
    ) -> Envelope:
        expected = (expect,) if isinstance(expect, type) else tuple(expect)
        allowed = {c.TYPE_ID for c in expected} | {ErrorResponse.TYPE_ID}
        cap = frames.response_cap(expected, max_bytes)
        tname = type(message).__name__
        if self.standing.is_banned(peer_id):
            raise RequestError("refused", f"{peer_id} is banned")
        if not self.standing.reachable(peer_id):
            self.metrics.on_request(tname, "client", "unreachable")
            raise RequestError("unreachable", f"{peer_id}: link cut (fault layer)")
        run_id = frames.exchange_run_id(type(message), self.run_id)
        data = protocol.seal(self.key, run_id, message, self.wall_ms(), self.seq.next())
        t0 = time.monotonic()  # wall time: a round trip measured, not a timer
        stream = None
        try:
            with trio.fail_after(timeout):
                stream = await self._open_stream(peer_id, redial)
                try:
                    await write_frame(stream, data)
                    raw = await read_frame(stream, cap)
                except RequestError:
                    raise
                except Exception as exc:
                    raise RequestError("closed", f"{type(exc).__name__}: {exc}") from None
        except trio.TooSlowError:
            self.metrics.on_request(tname, "client", "timeout")
            raise RequestError("timeout", f"{tname} to {peer_id} took over {timeout} s") from None
        except RequestError as exc:
            self.metrics.on_request(tname, "client", exc.code)
            if exc.code == "too_large":
                self.standing.penalise(peer_id, "bad_response")
            raise
        finally:
            if stream is not None:
                await aclose_shielded(stream.close, 2)
        now = self.wall_ms()
        try:
            env = protocol.open_envelope(
                raw, run_id=self.run_id, now_ms=now, guard=self._guard_out, allowed_types=allowed
            )
        except ProtocolError as exc:
            self.metrics.on_request(tname, "client", "bad_response")
            if exc.rule == "timestamp" and self._signed_by(raw, allowed, peer_id, now) is not None:
                # signed by the peer, only its time is off: our clock or its, no charge
                raise RequestError("bad_response", f"{exc.rule}: {exc.detail}") from None
            self.standing.penalise(peer_id, "bad_response")
            raise RequestError("bad_response", f"{exc.rule}: {exc.detail}") from None
        if env.sender != peer_id:
            self.metrics.on_request(tname, "client", "bad_response")
            self.standing.penalise(peer_id, "sender_mismatch")
            raise RequestError("bad_response", "response signed by another peer")
        rtt = (time.monotonic() - t0) * 1000
        prev = self.rtt_ms.get(peer_id)
        if prev is None and len(self.rtt_ms) >= 4096:
            self.rtt_ms.pop(next(iter(self.rtt_ms)))  # bounded: forget the oldest entry
        self.rtt_ms[peer_id] = rtt if prev is None else 0.7 * prev + 0.3 * rtt
        if isinstance(env.body, ErrorResponse) and ErrorResponse not in expected:
            self.metrics.on_request(tname, "client", "error")
            ahead = frames.clock_skew_offset(env.body)
            if ahead is not None:  # the peer refused our timestamp and says by how much
                if self.clock_skew is not None:
                    self.clock_skew.sample(peer_id, ahead)
                side = "ahead of" if ahead > 0 else "behind"
                raise RequestError(
                    frames.CLOCK_SKEW, f"{peer_id} says our clock is {abs(ahead) / 1000:.1f} s {side} its; enable NTP"
                )
            raise RequestError(env.body.code, env.body.detail)
        self.metrics.on_request(tname, "client", "ok")
        return env

    def _signed_by(self, raw: bytes, allowed: set[int], peer: str, now: int) -> Envelope | None:
        """An envelope refused for its timestamp, if ``peer`` signed it; how far our clock is
        ahead of ``peer``'s is then a :class:`ClockSkew` sample."""
        try:
            env = protocol.open_envelope(raw, run_id=self.run_id, now_ms=now, guard=None, allowed_types=allowed)
        except ProtocolError:
            return None
        if env.sender != peer:
            return None
        if self.clock_skew is not None:
            self.clock_skew.sample(peer, now - env.timestamp_ms)
        return env

    # ---------------------------------------------------------------- server
    def _max_request_bytes(self) -> int:
        return frames.request_cap(c for c, _ in self._handlers.values())

    async def _serve(self, stream: INetStream) -> None:
        """The driver of :class:`StreamAccounting` for one inbound stream: admit it or reset
        it at once, read the request under deadlines that fit its size, wait for a fair
        slot, answer, and give everything back."""
        peer = stream.muxed_conn.peer_id.to_base58()
        ticket = None
        reset = False
        try:
            if self.standing.refuses(peer) or not self.standing.allow(peer):
                reset = True
                return
            adm = self.streams.open(peer)
            if adm.preempt is not None:
                self._preempt(adm.preempt)
            if adm.ticket is None:
                reset = True
                self.metrics.on_request("stream", "server", "refused")
                log.debug("request stream from %s refused: %s", peer, adm.reason)
                if adm.charge:
                    self.standing.penalise(peer, "stream_limit", self.streams.limits.refusal_points)
                return
            ticket = adm.ticket
            scope = trio.CancelScope()
            self._live[ticket] = (scope, trio.Event())
            with scope, trio.move_on_after(self.io_timeout + self.handler_timeout):
                await self._serve_one(stream, peer, ticket)
            reset = ticket in self._preempted
        except Exception as exc:
            log.debug("request from %s failed: %s", peer, exc)
        finally:
            if ticket is not None:
                self._live.pop(ticket, None)
                self._preempted.discard(ticket)
                for t in self.streams.close(ticket):
                    self._wake(t)
            await aclose_shielded(stream.reset if reset else stream.close, 2)

    def _wake(self, ticket: int) -> None:
        live = self._live.get(ticket)
        if live is not None:
            live[1].set()

    def _preempt(self, ticket: int) -> None:
        """Another peer needs the room: end this (slot-less) stream; its task resets it."""
        self.metrics.on_request("stream", "server", "preempted")
        live = self._live.get(ticket)
        if live is not None:
            self._preempted.add(ticket)
            live[0].cancel()

    async def _read_request(self, stream: INetStream) -> bytes:
        """The request frame: its length prefix within ``first_byte_s``, then a body deadline
        that fits the announced size (a small request gets a short one)."""
        lim = self.streams.limits
        try:
            with trio.fail_after(lim.first_byte_s):
                header = await read_exactly(stream, frames.LEN_BYTES)
        except trio.TooSlowError:
            self.metrics.on_request("stream", "server", "read_timeout")
            raise RequestError("timeout", f"no request within {lim.first_byte_s:g} s") from None
        try:
            n = frames.frame_size(header, self._max_request_bytes())
        except ProtocolError as exc:
            raise RequestError("too_large", exc.detail) from None
        deadline = self.streams.read_deadline(n)
        try:
            with trio.fail_after(deadline):
                return await read_exactly(stream, n)
        except trio.TooSlowError:
            self.metrics.on_request("stream", "server", "read_timeout")
            raise RequestError("timeout", f"request of {n} bytes not read within {deadline:.2f} s") from None

    async def _serve_one(self, stream: INetStream, peer: str, ticket: int) -> None:
        tname = "?"
        raw = await self._read_request(stream)
        if not self.streams.want_slot(ticket):
            await self._live[ticket][1].wait()
        now = self.wall_ms()
        try:
            env = protocol.open_envelope(
                raw, run_id=self.run_id, now_ms=now, guard=self._guard_in, allowed_types=set(self._handlers)
            )
            if env.sender != peer:
                raise ProtocolError("sender_mismatch", "request signed by another peer than the connection's")
        except ProtocolError as exc:
            self.metrics.on_request(tname, "server", "bad_request")
            self.standing.penalise(peer, exc.rule)
            reply: Message = frames.bad_request(exc)
            run_id = self.run_id
            if exc.rule == "timestamp":  # tell the requester the offset we saw (protocol.reqresp)
                signed = self._signed_by(raw, set(self._handlers), peer, now)
                if signed is not None:
                    reply = frames.clock_skew(signed.timestamp_ms - now)
                    # a pre-run request (a joiner's GenesisRequest) is answered in the zero run,
                    # the only one its sender can open yet
                    run_id = signed.run_id
        else:
            cls, handler = self._handlers[env.type_id]
            tname = cls.__name__
            run_id = env.run_id
            try:
                with trio.fail_after(self.handler_timeout):
                    reply = handler(env, peer)
                    if inspect.isawaitable(reply):
                        reply = await reply
                outcome = "ok" if not isinstance(reply, ErrorResponse) else "error"
            except trio.TooSlowError:
                reply, outcome = frames.handler_timeout(), "timeout"
            except Exception as exc:
                log.exception("handler for %s failed", tname)
                reply, outcome = frames.internal_error(exc), "internal"
            self.metrics.on_request(tname, "server", outcome)
        data = protocol.seal(self.key, run_id, reply, self.wall_ms(), self.seq.next())
        # the answer at the same minimum pace: a peer that does not read gives its slot back soon
        with trio.fail_after(min(self.io_timeout, self.streams.read_deadline(len(data)))):
            await write_frame(stream, data)
