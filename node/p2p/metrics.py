"""Per-node metrics: Prometheus collectors in a private registry (many nodes share
one test process) plus plain dict counters for ``/status``."""

from __future__ import annotations

from collections import Counter, defaultdict

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import Counter as PCounter


class NodeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.gossip_received = PCounter(
            "primenode_gossip_received", "Gossip messages that reached the validator", ["topic"], registry=r
        )
        self.gossip_accepted = PCounter(
            "primenode_gossip_accepted",
            "Valid gossip messages from others (delivered and relayed)",
            ["topic"],
            registry=r,
        )
        self.gossip_published = PCounter(
            "primenode_gossip_published", "Gossip messages this node published", ["topic"], registry=r
        )
        self.gossip_dropped = PCounter(
            "primenode_gossip_dropped", "Gossip messages dropped, by reason", ["reason"], registry=r
        )
        self.penalties = PCounter(
            "primenode_peer_penalties", "Misbehaviour points charged to peers, by reason", ["reason"], registry=r
        )
        self.bans = PCounter("primenode_peer_bans", "Peers banned", registry=r)
        self.requests = PCounter(
            "primenode_reqresp", "Request/response exchanges", ["type", "side", "outcome"], registry=r
        )
        self.dials = PCounter("primenode_dials", "Outbound dials", ["outcome"], registry=r)
        self.peers_connected = Gauge("primenode_peers_connected", "Connected peers", registry=r)
        self.swarm_peers = Gauge("primenode_swarm_peers", "Peers in the swarm view, by role", ["role"], registry=r)
        self.uptime = Gauge("primenode_uptime_seconds", "Seconds since start", registry=r)
        # Plain mirrors for the JSON status (cheap to read back).
        self.received: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()
        self.published: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.req: defaultdict[str, Counter[str]] = defaultdict(Counter)

    def on_received(self, kind: str) -> None:
        self.received[kind] += 1
        self.gossip_received.labels(kind).inc()

    def on_accepted(self, kind: str) -> None:
        self.accepted[kind] += 1
        self.gossip_accepted.labels(kind).inc()

    def on_published(self, kind: str) -> None:
        self.published[kind] += 1
        self.gossip_published.labels(kind).inc()

    def on_dropped(self, reason: str) -> None:
        self.dropped[reason] += 1
        self.gossip_dropped.labels(reason).inc()

    def on_request(self, type_name: str, side: str, outcome: str) -> None:
        self.req[f"{side}:{type_name}"][outcome] += 1
        self.requests.labels(type_name, side, outcome).inc()

    def gossip_summary(self) -> dict:
        return {
            "received": sum(self.received.values()),
            "relayed": sum(self.accepted.values()),
            "published": sum(self.published.values()),
            "dropped": sum(self.dropped.values()),
            "received_by_topic": dict(self.received),
            "relayed_by_topic": dict(self.accepted),
            "published_by_topic": dict(self.published),
            "dropped_by_reason": dict(self.dropped),
        }
