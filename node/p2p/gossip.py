"""Validated flood gossip over our own libp2p streams.

Why not py-libp2p's GossipSub: measured here (see docs/architecture.md), its
mesh logic and per-peer stream handling lost most messages at 12 nodes in one
process (peers forgotten when one of their streams failed, one-sided meshes,
a 60 s back-off after a prune), on top of the silent-drop traps in the notes
(spam limit, 32-slot queues, 1 MiB cap, 120 s heartbeat). Our announcements
are small and few, so a plain flood over the ~6 connections each node keeps
costs little and is easy to make lossless and to reason about:

* one long-lived outbound stream per connected peer (protocol
  ``/primenode/gossip/1.0.0``), fed by a bounded per-peer queue; a frame
  whose write fails is re-sent on a fresh stream, and a peer whose queue
  overflows is disconnected and counted (never a silent drop);
* a frame is ``len(4 bytes) || msgpack([topic, envelope])``; the topic must be
  one of this run's and allow exactly the envelope's type;
* on arrival: de-duplicate by sha256 of the envelope (no charge), then the
  per-peer rate limit, then ``protocol.open_envelope`` (size, type for the
  topic, run id, time window, signature, canonical form, replay guard); an
  invalid message is dropped, counted by reason, charged to the *forwarding*
  peer, and never relayed (an honest peer validates before relaying);
* a kind restricted by the genesis (checkpoint announces: the trainer; votes:
  the validators; bans: either) from anyone else is dropped and charged;
* a valid message is delivered once to this node's handlers (per-kind queue,
  its own task) and relayed to every other connected peer.
"""

from __future__ import annotations

import collections
import inspect
import logging
import time
from typing import Any, Callable

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

import protocol
from protocol import Envelope, Message, NodeKey, ProtocolError, ReplayGuard, SequenceCounter, sha256
from protocol.schema import pack, unpack
from protocol.topics import TOPIC_TYPES, topic as topic_name

from .metrics import NodeMetrics
from .policy import PeerPolicy
from .reqresp import read_exactly

log = logging.getLogger("primenode.p2p.gossip")

GOSSIP_PROTOCOL = TProtocol("/primenode/gossip/1.0.0")
KIND_OF_TYPE = {t: k for k, t in TOPIC_TYPES.items()}
PUBSUB_CAP = 1024 * 1024 - 4096  # gossip stays under 1 MiB; bulk data is fetched by request
FRAME_CAP = PUBSUB_CAP + 1024

Handler = Callable[[Envelope], Any]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class GossipError(Exception):
    pass


class _Link:
    """Outbound side of gossip to one peer."""

    def __init__(self, peer_id: str, queue_size: int) -> None:
        self.peer_id = peer_id
        self.send, self.recv = trio.open_memory_channel[bytes](queue_size)
        self.scope = trio.CancelScope()
        self.stream_ok = False
        self.created = time.monotonic()
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
        policy: PeerPolicy,
        metrics: NodeMetrics,
        seq: SequenceCounter,
        queue_size: int = 100_000,
        peer_queue_size: int = 8192,
        guard: ReplayGuard | None = None,
        seen_capacity: int = 200_000,
        seen_ttl_s: float = 180.0,
        write_timeout: float = 10.0,
        authorised: dict[str, frozenset[str]] | None = None,
        **_ignored: Any,  # GossipSub-era knobs (degree, heartbeat) are accepted and unused
    ) -> None:
        self.host = host
        self.key = key
        self.run_id = run_id
        self.policy = policy
        self.metrics = metrics
        self.seq = seq
        self.guard = guard or ReplayGuard()
        self.my_id = key.peer_id
        self.peer_queue_size = peer_queue_size
        self.write_timeout = write_timeout
        self.seen_capacity = seen_capacity
        self.seen_ttl_s = seen_ttl_s
        # kind -> the only senders whose messages of that kind count (from the genesis):
        # checkpoints from the trainer, votes from validators, bans from either.
        self.authorised = authorised or {}
        self._topic_kind = {topic_name(run_id, k): (k, t) for k, t in TOPIC_TYPES.items()}
        self._kind_topic = {k: tp for tp, (k, _t) in self._topic_kind.items()}
        self._handlers: dict[str, list[Handler]] = {k: [] for k in TOPIC_TYPES}
        self._queues = {k: trio.open_memory_channel[Envelope](queue_size) for k in TOPIC_TYPES}
        self._seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._links: dict[str, _Link] = {}
        self._ready = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.relayed_frames = 0
        self.duplicates = 0
        host.set_stream_handler(GOSSIP_PROTOCOL, self._handle_stream)
        self.policy.ban_listeners.append(self._on_ban)

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
        data = protocol.seal(self.key, self.run_id, message, now_ms(), self.seq.next())
        if len(data) > PUBSUB_CAP:
            raise GossipError(f"{type(message).__name__} envelope is {len(data)} bytes, over the gossip cap")
        await self._ready.wait()
        self._mark_seen(sha256(data))
        self._fanout(pack([self._kind_topic[kind], data]), exclude=())
        self.metrics.on_published(kind)
        return data

    def mesh_peers(self, kind: str) -> set[str]:
        """Peers we currently push gossip to (every topic goes to every connected peer)."""
        return {pid for pid, link in self._links.items() if link.stream_ok}

    topic_peers = mesh_peers

    def has_stream(self, peer_id: str) -> bool:
        """Whether gossip can flow to ``peer_id`` (connection watchdog)."""
        link = self._links.get(peer_id)
        return link is not None and link.stream_ok

    def status(self) -> dict[str, Any]:
        return {"links": len(self._links), "duplicates": self.duplicates, "relayed_frames": self.relayed_frames,
                "seen_cache": len(self._seen)}

    # ------------------------------------------------------------- running
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for kind, (_send, recv) in self._queues.items():
                nursery.start_soon(self._dispatch, kind, recv)
            nursery.start_soon(self._link_loop)
            self._ready.set()
            task_status.started()
            await trio.sleep_forever()

    async def _dispatch(self, kind: str, recv: trio.MemoryReceiveChannel) -> None:
        async for env in recv:
            for h in list(self._handlers[kind]):
                try:
                    r = h(env)
                    if inspect.isawaitable(r):
                        await r
                except Exception:
                    log.exception("gossip handler for %s failed", kind)

    # ------------------------------------------------------------- outbound
    def _sync_links(self) -> None:
        connected = {p.to_base58() for p in self.host.get_connected_peers()}
        for pid in connected - set(self._links):
            if self.policy.is_banned(pid):
                continue
            link = _Link(pid, self.peer_queue_size)
            self._links[pid] = link
            self._nursery.start_soon(self._sender, link)
        for pid in set(self._links) - connected:
            self._close_link(pid)

    def _close_link(self, pid: str) -> None:
        link = self._links.pop(pid, None)
        if link is not None:
            link.scope.cancel()

    async def _link_loop(self) -> None:
        while True:
            self._sync_links()
            await trio.sleep(0.1)

    def _fanout(self, frame: bytes, exclude: tuple[str, ...]) -> None:
        self._sync_links()
        for pid, link in list(self._links.items()):
            if pid in exclude:
                continue
            try:
                link.send.send_nowait(frame)
            except trio.WouldBlock:
                # A peer that cannot keep up would make us buffer without bound: cut it loose.
                self.metrics.on_dropped("peer_queue_full")
                log.warning("gossip queue to %s overflowed; disconnecting it", pid)
                self._close_link(pid)
                self._nursery.start_soon(self._disconnect, pid)

    async def _disconnect(self, pid: str) -> None:
        try:
            with trio.move_on_after(5):
                await self.host.disconnect(ID.from_base58(pid))
        except Exception:
            pass

    async def _sender(self, link: _Link) -> None:
        pending: bytes | None = None
        backoff = 0.05
        with link.scope:
            while True:
                stream = None
                try:
                    with trio.fail_after(self.write_timeout):
                        stream = await self.host.new_stream(ID.from_base58(link.peer_id), [GOSSIP_PROTOCOL])
                    link.stream_ok = True
                    backoff = 0.05
                    while True:
                        if pending is None:
                            pending = await link.recv.receive()
                        with trio.fail_after(self.write_timeout):
                            await stream.write(len(pending).to_bytes(4, "big") + pending)
                        link.sent += 1
                        pending = None
                except trio.Cancelled:
                    raise
                except BaseException as exc:  # noqa: BLE001 - any stream failure: retry on a new stream
                    link.stream_ok = False
                    log.debug("gossip stream to %s failed: %r", link.peer_id, exc)
                    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                        raise
                finally:
                    if stream is not None:
                        with trio.CancelScope(shield=True), trio.move_on_after(1):
                            try:
                                await stream.close()
                            except Exception:
                                pass
                await trio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    # ------------------------------------------------------------- inbound
    async def _handle_stream(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        try:
            while True:
                header = await read_exactly(stream, 4)
                n = int.from_bytes(header, "big")
                if n > FRAME_CAP:
                    self._drop("size", peer)
                    return
                with trio.fail_after(30):
                    frame = await read_exactly(stream, n)
                if self.policy.is_banned(peer):
                    return
                self._on_frame(peer, frame)
        except trio.Cancelled:
            raise
        except Exception as exc:
            log.debug("gossip stream from %s ended: %r", peer, exc)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                try:
                    await stream.close()
                except Exception:
                    pass

    def _mark_seen(self, msg_id: bytes) -> None:
        now = time.monotonic()
        self._seen[msg_id] = now
        while self._seen:
            oldest_id, t = next(iter(self._seen.items()))
            if len(self._seen) > self.seen_capacity or now - t > self.seen_ttl_s:
                self._seen.popitem(last=False)
            else:
                break

    def _drop(self, reason: str, forwarder: str | None, charge: bool = True) -> bool:
        self.metrics.on_dropped(reason)
        if charge and forwarder is not None:
            self.policy.penalise(forwarder, reason)
        return False

    def _on_frame(self, fwd: str, frame: bytes) -> bool:
        try:
            return self._on_frame_inner(fwd, frame)
        except Exception:  # a bug here must not kill the stream handler
            log.exception("gossip validation failed")
            return self._drop("internal", None, charge=False)

    def _on_frame_inner(self, fwd: str, frame: bytes) -> bool:
        try:
            items = unpack(frame)
        except ProtocolError:
            return self._drop("encoding", fwd)
        if not (isinstance(items, list) and len(items) == 2 and isinstance(items[0], str) and isinstance(items[1], bytes)):
            return self._drop("frame", fwd)
        topic, data = items
        if topic not in self._topic_kind:
            return self._drop("topic", fwd)
        kind, type_id = self._topic_kind[topic]
        msg_id = sha256(data)
        if msg_id in self._seen:
            self.duplicates += 1
            return False  # an honest peer relays what we already have: no charge
        self.metrics.on_received(kind)
        if not self.policy.allow(fwd):
            return self._drop("rate_limit", fwd)
        try:
            env = protocol.open_envelope(data, run_id=self.run_id, now_ms=now_ms(), guard=self.guard,
                                         allowed_types=(type_id,))
        except ProtocolError as exc:
            rule = "topic_type" if exc.rule == "envelope.type" else exc.rule
            return self._drop(rule, fwd)
        self._mark_seen(msg_id)
        allowed = self.authorised.get(kind)
        if allowed is not None and env.sender not in allowed:
            return self._drop("unauthorised", fwd)  # an honest peer would not have relayed it
        if env.sender == self.my_id:
            return False  # our own message came back (after a restart): do not deliver it to ourselves
        if not self.policy.allow_origin(env.sender):
            # One signer flooding valid messages: not delivered, not relayed. Only the origin
            # itself is charged (an honest relay may pass on a burst before its own limit bites).
            return self._drop("origin_rate", fwd, charge=fwd == env.sender)
        self.metrics.on_accepted(kind)
        try:
            self._queues[kind][0].send_nowait(env)
        except trio.WouldBlock:
            self.metrics.on_dropped("local_queue_full")
        self.relayed_frames += 1
        self._fanout(frame, exclude=(fwd, env.sender))
        return True

    def _on_ban(self, peer_id: str, reason: str) -> None:
        self._close_link(peer_id)
