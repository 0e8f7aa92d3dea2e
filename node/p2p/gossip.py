"""Validated gossip over our own libp2p streams: eager push on a tree, lazy repair.

Why not py-libp2p's GossipSub: measured here (see docs/architecture.md), its
mesh logic and per-peer stream handling lost most messages at 12 nodes in one
process (peers forgotten when one of their streams failed, one-sided meshes,
a 60 s back-off after a prune), on top of the silent-drop traps in the notes
(spam limit, 32-slot queues, 1 MiB cap, 120 s heartbeat).

Dissemination follows Plumtree (Leitão, Pereira, Rodrigues: "Epidemic
Broadcast Trees", 2007), because a plain flood costs every node one frame per
message per connection, and through py-libp2p's Python Noise + yamux a frame
costs ~1 ms of CPU (bench/gossip.py: 20 nodes at 100 msg/s needed 3 cores):

* every connected peer starts *eager*: a new valid message is pushed to all
  eager peers (except the one it came from and its origin);
* a peer that sends us a message we already have is moved to *lazy* and sent
  PRUNE (it moves us to lazy too): the eager links shrink to a spanning tree,
  so each node receives about one copy of each message;
* lazy peers get the message *ids* instead, batched every ``ihave_interval_s``
  (IHAVE); an id still missing ``graft_timeout_s`` after its first IHAVE is
  requested with GRAFT, which also makes that link eager again: a tree broken
  by a dead node heals itself;
* recent messages are kept (bounded by count and age) to answer GRAFTs.

Wire: one long-lived outbound stream per connected peer, fed by a bounded
per-peer queue; every frame waiting in the queue goes out in one stream write
(so under load one Noise + yamux frame carries many gossip frames); frames
whose write fails are re-sent on a fresh stream, and a peer whose queue
overflows is disconnected and counted (never a silent drop). The frames
(``[topic, envelope]`` messages, IHAVE / GRAFT / PRUNE, their caps) are
``protocol.gossip``; the tree's state machine is ``plumtree.Plumtree`` (no I/O); this module
is the streams, the timers and validation around it.

On arrival of a message: de-duplicate by id (no charge), then the per-peer
rate limit, then ``protocol.open_envelope`` (size, type for the topic, run id,
time window, signature, canonical form, replay guard); an invalid message is
dropped, counted by reason, charged to the *forwarding* peer, and never relayed
(an honest peer validates before relaying); a kind restricted by the genesis
(checkpoint announces: the trainer; votes: the validators; bans: either) from
anyone else is dropped and charged; a valid message is delivered once to this
node's handlers (per-kind queue, its own task) and passed on as above. Control
frames count against the same per-peer rate limit; malformed ones are charged.
"""

from __future__ import annotations

import collections
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

import protocol
from node.p2p.clock import ClockSkew
from node.p2p.metrics import NodeMetrics
from node.p2p.plumtree import Plumtree, Send
from node.p2p.standing import PeerStanding
from node.util import aclose_shielded, now_ms
from protocol import Envelope, Message, NodeKey, ProtocolError, ReplayGuard, SequenceCounter
from protocol import gossip as frames
from protocol.gossip import GRAFT, MAX_IDS_PER_FRAME, PRUNE, Control
from protocol.topics import TOPIC_TYPES
from protocol.topics import topic as topic_name

log = logging.getLogger(__name__)

GOSSIP_PROTOCOL = TProtocol(frames.PROTOCOL_ID)
KIND_OF_TYPE = {t: k for k, t in TOPIC_TYPES.items()}
WRITE_BATCH_BYTES = 256 * 1024  # frames coalesced into one stream write, at most
READ_CHUNK_BYTES = 256 * 1024
PARTIAL_FRAME_TIMEOUT_S = 30.0  # a frame that has started must be complete by then (slow senders are cut)
# A peer whose identify lists protocols but not ours (a generic libp2p relay we hold a
# reservation on) is not sent gossip; we look again this often (it may add the protocol).
NO_GOSSIP_RECHECK_S = 30.0
# Every protocol of ours starts so (gossip, request/response): a peer listing none is not primenode.
PRIMENODE_PROTOCOL_PREFIX = "/primenode/"
# Inbound gossip streams one peer may hold open at once. An honest peer keeps one (a second
# one briefly while it replaces a failed stream); each held stream may buffer a frame of up to
# 1 MiB for PARTIAL_FRAME_TIMEOUT_S, so without a cap one peer could hold memory without bound.
MAX_INBOUND_STREAMS_PER_PEER = 4

Handler = Callable[[Envelope], Any]


class GossipError(Exception):
    """A message this node tried to publish cannot be gossiped (not a gossip type, or too large)."""


class _Link:
    """Outbound side of gossip to one peer."""

    def __init__(self, peer_id: str, queue_size: int) -> None:
        self.peer_id = peer_id
        self.send, self.recv = trio.open_memory_channel[bytes](queue_size)
        self.scope = trio.CancelScope()
        self.stream_ok = False
        self.foreign = False  # identify says the peer does not speak our gossip
        self.sent = 0


class Gossip:
    """Signed, validated publish/subscribe for one run.

    * ``on(kind, handler)``: call ``handler(envelope)`` (sync or async) for every
      valid message of ``kind`` ("heartbeat", "checkpoint", "rollout", "vote",
      "ban") from another node, exactly once, in arrival order per kind.
    * ``await publish(message)``: seal and publish (the kind follows from the type).
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
        queue_size: int = 100_000,
        peer_queue_size: int = 8192,
        guard: ReplayGuard | None = None,
        seen_capacity: int = 200_000,
        seen_ttl_s: float = 180.0,
        write_timeout: float = 10.0,
        authorised: dict[str, frozenset[str]] | None = None,
        is_known_origin: Callable[[str], bool] = lambda peer_id: True,
        ihave_interval_s: float = 0.5,
        graft_timeout_s: float = 0.25,
        cache_capacity: int = 20_000,
        cache_max_bytes: int = 64 * 1024 * 1024,
        cache_ttl_s: float = 120.0,
        missing_capacity: int = 20_000,
        missing_per_peer: int = MAX_IDS_PER_FRAME,
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
        self.guard = guard or ReplayGuard()
        self.my_id = key.peer_id
        self.peer_queue_size = peer_queue_size
        self.write_timeout = write_timeout
        self.ihave_interval_s = ihave_interval_s
        # Plumtree's state (eager and lazy links, ids seen, the GRAFT cache, missing ids): the
        # rules live there, without I/O; this class moves its frames and runs its timers.
        self.tree = Plumtree(
            seen_capacity=seen_capacity,
            seen_ttl_s=seen_ttl_s,
            graft_timeout_s=graft_timeout_s,
            cache_capacity=cache_capacity,
            cache_max_bytes=cache_max_bytes,
            cache_ttl_s=cache_ttl_s,
            missing_capacity=missing_capacity,
            missing_per_peer=missing_per_peer,
        )
        self._inbound: collections.Counter[str] = collections.Counter()  # open inbound streams per peer
        # kind -> the only senders whose messages of that kind count (from the genesis):
        # checkpoints from the trainer, votes from validators, bans from either.
        self.authorised = authorised or {}
        self.is_known_origin = is_known_origin
        self._topic_kind = {topic_name(run_id, k): (k, t) for k, t in TOPIC_TYPES.items()}
        self._kind_topic = {k: tp for tp, (k, _t) in self._topic_kind.items()}
        self._handlers: dict[str, list[Handler]] = {k: [] for k in TOPIC_TYPES}
        self._queues = {k: trio.open_memory_channel[tuple[Envelope, str]](queue_size) for k in TOPIC_TYPES}
        # kind -> the peer that forwarded the message its handlers are being called with (read
        # by a sync handler during the call: the swarm view charges a new entry to it).
        self.delivered_from: dict[str, str] = {}
        self._links: dict[str, _Link] = {}  # every peer with a link is in tree.eager or tree.lazy
        self.counters = self.tree.counters  # the tree's and the streams' counters, one table
        self._ready = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.relayed_frames = 0
        host.set_stream_handler(GOSSIP_PROTOCOL, self._handle_stream)
        self.standing.ban_listeners.append(self._on_ban)

    # ------------------------------------------------------------------ API
    def on(self, kind: str, handler: Handler) -> None:
        if kind not in self._handlers:
            raise ValueError(f"unknown gossip kind {kind!r}; one of {sorted(self._handlers)}")
        self._handlers[kind].append(handler)

    def topic(self, kind: str) -> str:
        return self._kind_topic[kind]

    async def publish(self, message: Message) -> bytes:
        """Seal ``message`` and flood it on its topic; returns the envelope bytes."""
        type_id = type(message).TYPE_ID
        kind = KIND_OF_TYPE.get(type_id)
        if kind is None:
            raise GossipError(f"{type(message).__name__} is not a gossip message (fetch it by request)")
        data = protocol.seal(self.key, self.run_id, message, self.wall_ms(), self.seq.next())
        if len(data) > frames.MAX_GOSSIP_ENVELOPE_BYTES:
            raise GossipError(f"{type(message).__name__} envelope is {len(data)} bytes, over the gossip cap")
        await self._ready.wait()
        frame = frames.encode_message(self._kind_topic[kind], data)
        self._sync_links()
        self._do(self.tree.publish(frames.message_id(data), frame, trio.current_time()))
        self.metrics.on_published(kind)
        return data

    def mesh_peers(self, kind: str) -> set[str]:
        """Peers we currently push gossip to (every topic goes to every connected peer)."""
        return {pid for pid, link in self._links.items() if link.stream_ok}

    def has_stream(self, peer_id: str) -> bool:
        """Whether gossip can flow to ``peer_id`` (connection watchdog)."""
        link = self._links.get(peer_id)
        return link is not None and link.stream_ok

    @property
    def duplicates(self) -> int:
        """Messages received again (no charge: honest peers relay what we already have)."""
        return self.tree.duplicates

    def status(self) -> dict[str, Any]:
        return {
            "links": len(self._links),
            **self.tree.status(),
            "relayed_frames": self.relayed_frames,
            **{k: v for k, v in sorted(self.counters.items())},
        }

    # ------------------------------------------------------------- running
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for kind, (_send, recv) in self._queues.items():
                nursery.start_soon(self._dispatch, kind, recv)
            nursery.start_soon(self._link_loop)
            nursery.start_soon(self._ihave_loop)
            nursery.start_soon(self._graft_loop)
            self._ready.set()
            task_status.started()
            await trio.sleep_forever()

    async def _dispatch(self, kind: str, recv: trio.MemoryReceiveChannel) -> None:
        async for env, fwd in recv:
            for h in list(self._handlers[kind]):
                self.delivered_from[kind] = fwd
                try:
                    r = h(env)
                    if inspect.isawaitable(r):
                        await r
                except Exception:
                    log.exception("gossip handler for %s failed", kind)

    # ------------------------------------------------------------- outbound
    def _spawn(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Start a task in the nursery of :meth:`run` (links exist only while it runs)."""
        assert self._nursery is not None, "Gossip.run is not running"
        self._nursery.start_soon(fn, *args)

    def _sync_links(self) -> None:
        connected = {p.to_base58() for p in self.host.get_connected_peers()}
        for pid in connected - set(self._links):
            if self.standing.refuses(pid):
                continue
            link = _Link(pid, self.peer_queue_size)
            self._links[pid] = link
            self.tree.add_link(pid)
            self._spawn(self._sender, link)
        for pid in set(self._links):
            if pid not in connected or not self.standing.reachable(pid):
                self._close_link(pid)

    def _close_link(self, pid: str) -> None:
        link = self._links.pop(pid, None)
        self.tree.remove_link(pid)
        if link is not None:
            link.scope.cancel()

    async def _link_loop(self) -> None:
        while True:
            self._sync_links()
            await trio.sleep(0.1)

    def _send(self, pid: str, frame: bytes) -> None:
        link = self._links.get(pid)
        if link is None or link.foreign:
            return  # a peer that does not speak gossip: nothing to queue (it would only fill up)
        try:
            link.send.send_nowait(frame)
        except trio.WouldBlock:
            # A peer that cannot keep up would make us buffer without bound: cut it loose.
            self.metrics.on_dropped("peer_queue_full")
            log.warning("gossip queue to %s overflowed; disconnecting it", pid)
            self._close_link(pid)
            self._spawn(self._disconnect, pid)

    def _fanout(self, frame: bytes, exclude: tuple[str, ...]) -> None:
        """Push ``frame`` to every linked peer (tests use it to play a misbehaving relay)."""
        self._sync_links()
        for pid in list(self._links):
            if pid not in exclude:
                self._send(pid, frame)

    def _do(self, sends: list[Send]) -> None:
        """Queue the tree's frames to their peers."""
        for send in sends:
            self._send(send.peer, send.frame)

    async def _ihave_loop(self) -> None:
        while True:
            await trio.sleep(self.ihave_interval_s)
            self._do(self.tree.flush_ihave())

    async def _graft_loop(self) -> None:
        """Ask an announcer for every id still missing after ``graft_timeout_s``."""
        while True:
            await trio.sleep(min(0.05, self.tree.graft_timeout_s / 2))
            self._do(self.tree.due_grafts(trio.current_time()))

    async def _disconnect(self, pid: str) -> None:
        try:
            with trio.move_on_after(5):
                await self.host.disconnect(ID.from_base58(pid))
        except Exception:
            pass

    def _may_speak_gossip(self, peer_id: str) -> bool:
        """False only when identify listed the peer's protocols and none is primenode's.

        Not "gossip is missing": a primenode peer's list can be stale without it (a joiner's
        genesis fetch is identified before its gossip handler exists, and identify only adds
        to the list), and judging it foreign then left the bootstrap and the joiner without
        a gossip link for good. Every primenode host serves request/response from the start.
        """
        try:
            protos = self.host.get_peerstore().get_protocols(ID.from_base58(peer_id))
        except Exception:
            return True  # nothing known yet: try
        return not protos or any(str(p).startswith(PRIMENODE_PROTOCOL_PREFIX) for p in protos)

    @staticmethod
    def _take_batch(link: _Link, first: bytes) -> tuple[bytes, int]:
        """``first`` plus every frame already queued (up to WRITE_BATCH_BYTES), length-prefixed."""
        parts = [frames.frame_header(len(first)), first]
        size, count = frames.LEN_BYTES + len(first), 1
        while size < WRITE_BATCH_BYTES:
            try:
                frame = link.recv.receive_nowait()
            except trio.WouldBlock:
                break
            parts += [frames.frame_header(len(frame)), frame]
            size += frames.LEN_BYTES + len(frame)
            count += 1
        return b"".join(parts), count

    async def _sender(self, link: _Link) -> None:
        pending: tuple[bytes, int] | None = None  # a batch not yet written (kept across stream failures)
        backoff = 0.05
        with link.scope:
            while True:
                if not self._may_speak_gossip(link.peer_id):
                    # Opening a stream would fail every time (and py-libp2p logs each failure
                    # at ERROR); the connection manager decides whether to keep the peer.
                    link.foreign, link.stream_ok, pending = True, False, None
                    self.tree.mute(link.peer_id)
                    while True:
                        try:
                            link.recv.receive_nowait()
                        except trio.WouldBlock:
                            break
                    await trio.sleep(NO_GOSSIP_RECHECK_S)
                    continue
                link.foreign = False
                stream = None
                try:
                    with trio.fail_after(self.write_timeout):
                        stream = await self.host.new_stream(ID.from_base58(link.peer_id), [GOSSIP_PROTOCOL])
                    link.stream_ok = True
                    backoff = 0.05
                    while True:
                        if pending is None:
                            pending = self._take_batch(link, await link.recv.receive())
                        with trio.fail_after(self.write_timeout):
                            await stream.write(pending[0])
                        link.sent += pending[1]
                        pending = None
                except trio.Cancelled:
                    raise
                except BaseException as exc:
                    link.stream_ok = False
                    log.debug("gossip stream to %s failed: %r", link.peer_id, exc)
                    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                        raise
                finally:
                    if stream is not None:
                        await aclose_shielded(stream.close, 1)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    # ------------------------------------------------------------- inbound
    async def _handle_stream(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        if self._inbound[peer] >= MAX_INBOUND_STREAMS_PER_PEER:
            # Not charged: an honest peer replacing failed streams can briefly hold several.
            self.counters["streams_refused"] += 1
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                try:
                    await stream.reset()
                except Exception:
                    pass
            return
        self._inbound[peer] += 1
        try:
            await self._read_stream(peer, stream)
        finally:
            self._inbound[peer] -= 1
            if self._inbound[peer] <= 0:
                del self._inbound[peer]

    async def _read_stream(self, peer: str, stream: INetStream) -> None:
        buf = bytearray()
        partial_deadline: float | None = None
        try:
            while True:
                # Cut every complete frame out of the buffer, then read more. A frame
                # that has started must complete within 30 s (a stalled sender is cut).
                while len(buf) >= frames.LEN_BYTES:
                    try:
                        n = frames.frame_size(bytes(buf[: frames.LEN_BYTES]))
                    except ProtocolError as exc:
                        self._drop(exc.rule, peer)
                        return
                    end = frames.LEN_BYTES + n
                    if len(buf) < end:
                        break
                    frame = bytes(buf[frames.LEN_BYTES : end])
                    del buf[:end]
                    partial_deadline = None
                    if self.standing.refuses(peer):
                        return
                    self._on_frame(peer, frame)
                if buf:
                    if partial_deadline is None:
                        partial_deadline = trio.current_time() + PARTIAL_FRAME_TIMEOUT_S
                    with trio.fail_at(partial_deadline):
                        part = await stream.read(READ_CHUNK_BYTES)
                else:
                    partial_deadline = None
                    part = await stream.read(READ_CHUNK_BYTES)
                if not part:
                    return
                buf += part
        except trio.Cancelled:
            raise
        except Exception as exc:
            log.debug("gossip stream from %s ended: %r", peer, exc)
        finally:
            await aclose_shielded(stream.close, 1)

    def _drop(self, reason: str, forwarder: str | None, charge: bool = True) -> bool:
        self.metrics.on_dropped(reason)
        if charge and forwarder is not None:
            self.standing.penalise(forwarder, reason)
        return False

    def _on_frame(self, fwd: str, frame: bytes) -> bool:
        try:
            return self._on_frame_inner(fwd, frame)
        except Exception:  # a bug here must not kill the stream handler
            log.exception("gossip validation failed")
            return self._drop("internal", None, charge=False)

    def _on_frame_inner(self, fwd: str, frame: bytes) -> bool:
        try:
            decoded = frames.decode_frame(frame)
        except ProtocolError as exc:  # "encoding" or "frame"
            return self._drop(exc.rule, fwd)
        if isinstance(decoded, Control):
            return self._on_control(fwd, decoded)
        topic, data = decoded
        if topic not in self._topic_kind:
            return self._drop("topic", fwd)
        kind, type_id = self._topic_kind[topic]
        msg_id = frames.message_id(data)
        if self.tree.is_seen(msg_id):
            self._do(self.tree.duplicate(fwd))
            return False  # an honest peer relays what we already have: no charge
        self.metrics.on_received(kind)
        if not self.standing.allow(fwd):
            return self._drop("rate_limit", fwd)
        now = self.wall_ms()
        try:
            env = protocol.open_envelope(
                data, run_id=self.run_id, now_ms=now, guard=self.guard, allowed_types=(type_id,)
            )
        except ProtocolError as exc:
            if exc.rule == "timestamp":
                self._clock_sample(data, type_id, now)
            rule = "topic_type" if exc.rule == "envelope.type" else exc.rule
            return self._drop(rule, fwd)
        self.tree.mark_seen(msg_id, trio.current_time())
        allowed = self.authorised.get(kind)
        if allowed is not None and env.sender not in allowed:
            return self._drop("unauthorised", fwd)  # an honest peer would not have relayed it
        if env.sender == self.my_id:
            return False  # our own message came back (after a restart): do not deliver it to ourselves
        known = self.is_known_origin(env.sender)
        if not known and not self.standing.allow_unknown_origin_via(fwd):
            # Many fresh signers through one peer: not delivered, not relayed, not charged
            # (an honest relay may be passing on someone else's burst).
            return self._drop("unknown_origin_rate", fwd, charge=False)
        if not self.standing.allow_origin(env.sender, known=known):
            # One signer flooding valid messages: not delivered, not relayed. Only the origin
            # itself is charged (an honest relay may pass on a burst before its own limit bites).
            return self._drop("origin_rate", fwd, charge=fwd == env.sender)
        self.metrics.on_accepted(kind)
        try:
            self._queues[kind][0].send_nowait((env, fwd))
        except trio.WouldBlock:
            self.metrics.on_dropped("local_queue_full")
        self.relayed_frames += 1
        self._sync_links()
        self._do(self.tree.deliver(fwd, env.sender, msg_id, frame, trio.current_time()))
        return True

    def _clock_sample(self, data: bytes, type_id: int, now: int) -> None:
        """A message refused for its timestamp: if its signature holds, how far our clock is
        from its signer's is a sample for :class:`ClockSkew` (how a node whose clock is behind
        learns it: every peer's message looks to come from the future)."""
        if self.clock_skew is None:
            return
        try:
            env = protocol.open_envelope(data, run_id=self.run_id, now_ms=now, guard=None, allowed_types=(type_id,))
        except ProtocolError:
            return
        self.clock_skew.sample(env.sender, now - env.timestamp_ms)

    def _on_control(self, fwd: str, control: Control) -> bool:
        kind, ids = control
        if not self.standing.allow(fwd):
            return self._drop("rate_limit", fwd)
        if kind == PRUNE:
            self.tree.on_prune(fwd)
        elif kind == GRAFT:
            self._do(self.tree.on_graft(fwd, ids))
        else:
            self.tree.on_ihave(fwd, ids, trio.current_time())
        return False

    def _on_ban(self, peer_id: str, reason: str) -> None:
        self._close_link(peer_id)
