"""Validated gossip over py-libp2p GossipSub.

One topic per run and message kind (``protocol.topics``). Every message passes
:meth:`Gossip._validate` — registered as py-libp2p's synchronous topic
validator, which runs *before* the message is marked seen, delivered or
relayed — so an invalid message is never forwarded. The validator:

1. refuses banned forwarders and rate-limited ones (per-peer token bucket);
2. opens the envelope with ``protocol.open_envelope`` (size, type for this
   topic, run id, time window, signature, canonical form, replay guard);
3. checks the envelope's signer is the pubsub originator;
4. on failure: counts the drop by reason and charges the *forwarding* peer
   (an honest peer never relays an invalid message, since it validated it);
5. on success: hands the verified :class:`protocol.Envelope` to this node's
   handlers through a large per-kind queue drained by its own task.

py-libp2p traps handled here (see measured notes): the spam limit (disabled;
our per-peer limit replaces it), the outbound/subscription queue sizes (see
``host.install_libp2p_fixes``), the 120 s default heartbeat (1 s here), the
1 MiB cap (only ``GOSSIP_TYPES``, all < 1 MiB, may be published), the
validation cache (disabled so every copy is judged and charged), and pubsub
sequence numbers (started from the ns clock so a restarted node never reuses
one and gets its messages dropped as duplicates).
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from typing import Any, Awaitable, Callable

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pubsub import Pubsub, get_content_addressed_msg_id
from libp2p.tools.anyio_service import background_trio_service

import protocol
from protocol import Envelope, Message, NodeKey, ProtocolError, ReplayGuard, SequenceCounter
from protocol.topics import TOPIC_TYPES, topic as topic_name

from .metrics import NodeMetrics
from .policy import PeerPolicy

log = logging.getLogger("primenode.p2p.gossip")

KIND_OF_TYPE = {t: k for k, t in TOPIC_TYPES.items()}
PUBSUB_CAP = 1024 * 1024 - 4096  # py-libp2p drops anything over 1 MiB with no error

Handler = Callable[[Envelope], Any]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class GossipError(Exception):
    pass


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
        degree: int = 6,
        degree_low: int = 4,
        degree_high: int = 12,
        heartbeat_interval: int = 1,
        queue_size: int = 100_000,
        guard: ReplayGuard | None = None,
    ) -> None:
        self.host = host
        self.key = key
        self.run_id = run_id
        self.policy = policy
        self.metrics = metrics
        self.seq = seq
        self.guard = guard or ReplayGuard()
        self.my_id = key.peer_id
        self._topic_kind = {topic_name(run_id, k): (k, t) for k, t in TOPIC_TYPES.items()}
        self._kind_topic = {k: tp for tp, (k, _t) in self._topic_kind.items()}
        self._handlers: dict[str, list[Handler]] = {k: [] for k in TOPIC_TYPES}
        self._queues = {k: trio.open_memory_channel[Envelope](queue_size) for k in TOPIC_TYPES}
        self.router = GossipSub(
            protocols=[PROTOCOL_ID_V11],
            degree=degree,
            degree_low=degree_low,
            degree_high=degree_high,
            heartbeat_interval=heartbeat_interval,
            heartbeat_initial_delay=0.1,
            spam_protection_enabled=False,
            max_messages_per_topic_per_second=1e9,
            eclipse_protection_enabled=False,
            do_px=False,
        )
        self.pubsub = Pubsub(
            host,
            self.router,
            strict_signing=True,
            msg_id_constructor=get_content_addressed_msg_id,
            validation_cache_ttl=0,
            validation_cache_size=16,
            allowed_topics=set(self._topic_kind),
        )
        # Pubsub seqnos start at int(time.time()) and count up per message: a
        # node restarted within (messages sent) seconds would reuse seqnos and be
        # taken for an equivocator. Start from the ns clock instead.
        self.pubsub.counter = time.time_ns()
        for tp in self._topic_kind:
            self.pubsub.set_topic_validator(tp, self._validate, False)
        self.policy.ban_listeners.append(self._on_ban)
        self._ready = trio.Event()
        self._nursery: trio.Nursery | None = None

    # ------------------------------------------------------------------ API
    def on(self, kind: str, handler: Handler) -> None:
        if kind not in self._handlers:
            raise ValueError(f"unknown gossip kind {kind!r}; one of {sorted(self._handlers)}")
        self._handlers[kind].append(handler)

    def topic(self, kind: str) -> str:
        return self._kind_topic[kind]

    async def publish(self, message: Message) -> bytes:
        """Seal ``message`` and publish it on its topic; returns the envelope bytes."""
        type_id = type(message).TYPE_ID
        kind = KIND_OF_TYPE.get(type_id)
        if kind is None:
            raise GossipError(f"{type(message).__name__} is not a gossip message (fetch it by request)")
        data = protocol.seal(self.key, self.run_id, message, now_ms(), self.seq.next())
        if len(data) > PUBSUB_CAP:
            raise GossipError(f"{type(message).__name__} envelope is {len(data)} bytes, over the pubsub cap")
        await self._ready.wait()
        await self.pubsub.publish(self._kind_topic[kind], data)
        self.metrics.on_published(kind)
        return data

    def mesh_peers(self, kind: str) -> set[str]:
        return {p.to_base58() for p in self.router.mesh.get(self._kind_topic[kind], set())}

    def has_stream(self, peer_id: str) -> bool:
        """Whether gossip can flow with ``peer_id``: pubsub has a stream to it and
        knows its subscriptions (py-libp2p forgets both when any stream of the
        peer fails, e.g. one on a trimmed duplicate connection)."""
        try:
            pid = ID.from_base58(peer_id)
        except Exception:
            return False
        if pid not in self.pubsub.peers:
            return False
        q = self.pubsub.peer_queues.get(pid)
        if q is None or q.closed or len(q) > 256:
            return False  # no sender, or one stuck writing to a dead stream
        return all(pid in self.pubsub.peer_topics.get(tp, ()) for tp in self._topic_kind)

    def topic_peers(self, kind: str) -> set[str]:
        return {p.to_base58() for p in self.pubsub.peer_topics.get(self._kind_topic[kind], set())}

    # ------------------------------------------------------------- running
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(self.pubsub):
            async with background_trio_service(self.router):
                await self.pubsub.wait_until_ready()
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    for tp in self._topic_kind:
                        sub = await self.pubsub.subscribe(tp)
                        nursery.start_soon(self._drain_subscription, sub)
                    for kind, (_send, recv) in self._queues.items():
                        nursery.start_soon(self._dispatch, kind, recv)
                    nursery.start_soon(self._unban_loop)
                    self._ready.set()
                    task_status.started()
                    await trio.sleep_forever()

    async def _drain_subscription(self, sub) -> None:
        # Delivery happens in the validator; the library's own subscription
        # queue is drained here only so it never fills up and logs drops.
        async for _msg in sub:
            pass

    async def _dispatch(self, kind: str, recv: trio.MemoryReceiveChannel) -> None:
        async for env in recv:
            for h in list(self._handlers[kind]):
                try:
                    r = h(env)
                    if inspect.isawaitable(r):
                        await r
                except Exception:
                    log.exception("gossip handler for %s failed", kind)

    async def _unban_loop(self) -> None:
        while True:
            await trio.sleep(5)
            for pid in list(self.pubsub.blacklisted_peers):
                if not self.policy.is_banned(pid.to_base58()):
                    self.pubsub.remove_from_blacklist(pid)

    def _on_ban(self, peer_id: str, reason: str) -> None:
        try:
            self.pubsub.add_to_blacklist(ID.from_base58(peer_id))
        except Exception:
            log.debug("blacklisting %s failed", peer_id, exc_info=True)

    # ----------------------------------------------------------- validation
    def _drop(self, reason: str, forwarder: str | None, charge: bool = True) -> bool:
        self.metrics.on_dropped(reason)
        if charge and forwarder is not None:
            self.policy.penalise(forwarder, reason)
        return False

    def _validate(self, forwarder: ID, msg: Any) -> bool:
        """py-libp2p topic validator: True = deliver and relay, False = drop."""
        try:
            return self._validate_inner(forwarder, msg)
        except Exception:  # a bug here must not kill the pubsub service
            log.exception("gossip validator failed")
            return self._drop("internal", None, charge=False)

    def _validate_inner(self, forwarder: ID, msg: Any) -> bool:
        fwd = forwarder.to_base58()
        if fwd == self.my_id:
            return True  # our own publish
        topics = list(msg.topicIDs)
        if len(topics) != 1 or topics[0] not in self._topic_kind:
            return self._drop("topic", fwd)
        kind, type_id = self._topic_kind[topics[0]]
        self.metrics.on_received(kind)
        if self.policy.is_banned(fwd):
            return self._drop("banned", None, charge=False)
        if not self.policy.allow(fwd):
            return self._drop("rate_limit", fwd)
        try:
            origin = ID(msg.from_id).to_base58()
        except Exception:
            return self._drop("origin", fwd)
        if origin == self.my_id:
            return self._drop("self_echo", None, charge=False)
        try:
            env = protocol.open_envelope(
                msg.data, run_id=self.run_id, now_ms=now_ms(), guard=self.guard, allowed_types=(type_id,)
            )
        except ProtocolError as exc:
            rule = "topic_type" if exc.rule == "envelope.type" else exc.rule
            return self._drop(rule, fwd)
        if env.sender != origin:
            return self._drop("sender_mismatch", fwd)
        self.metrics.on_accepted(kind)
        try:
            self._queues[kind][0].send_nowait(env)
        except trio.WouldBlock:
            self.metrics.on_dropped("local_queue_full")
        return True
