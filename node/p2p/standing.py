"""Peer standing: a misbehaviour budget per peer, temporary bans, rate limits (the ban list;
"policy" in this project means the model being trained).

Every layer that catches a peer misbehaving (gossip validation, request/response,
checkpoint chunk checks) calls :meth:`PeerStanding.penalise`. Points decay over
time; a peer whose points exceed ``budget`` is banned for ``ban_seconds``:
disconnected, its gossip refused, never dialled, its inbound connections closed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import trio

from node.p2p.metrics import NodeMetrics
from node.util import TokenBucket
from protocol.errors import rule_family, rule_label

log = logging.getLogger(__name__)

# Default cost of each protocol rule broken (ProtocolError.rule prefixes).
PENALTIES = {
    "signature": 10.0,
    "run_id": 10.0,
    "replay": 5.0,
    "sender_mismatch": 10.0,
    "topic_type": 10.0,
    "envelope.type": 10.0,
    "canonical": 10.0,
    "size": 10.0,
    "timestamp": 0.2,  # clocks drift and queues delay honest relays under load: nearly free
    "rate_limit": 0.2,
    "origin_rate": 0.2,  # charged only when the forwarder is the origin itself
    "batch_unserved": 5.0,
    "bad_response": 5.0,
    "bad_chunk": 5.0,
}
DEFAULT_PENALTY = 5.0


def penalty_for(rule: str) -> float:
    if rule in PENALTIES:
        return PENALTIES[rule]
    return PENALTIES.get(rule_family(rule), DEFAULT_PENALTY)


@dataclasses.dataclass
class _Score:
    points: float = 0.0
    updated: float = 0.0


class PeerStanding:
    """Budgets, bans and per-peer rate limits for one node.

    ``on_ban`` (set by the node) is an async callback that disconnects the peer;
    it is scheduled, never awaited inside validation.
    """

    def __init__(
        self,
        budget: float = 20.0,
        decay_per_s: float = 0.1,
        ban_seconds: float = 600.0,
        rate_per_s: float = 1000.0,
        rate_burst: float = 5000.0,
        clock: Callable[[], float] = trio.current_time,
        max_peers: int = 10_000,
        origin_rate_per_s: float = 100.0,
        origin_burst: float = 1000.0,
        unknown_origin_burst: float = 20.0,
        unknown_origins_per_forwarder_per_s: float = 50.0,
        unknown_origins_per_forwarder_burst: float = 200.0,
    ) -> None:
        self.budget = budget
        # Bound on each per-peer table (scores, buckets, bans): fresh identities are free,
        # so nothing keyed by peer may grow without limit (see docs/security.md).
        self.max_peers = max_peers
        self.decay_per_s = decay_per_s
        self.ban_seconds = ban_seconds
        self.rate_per_s = rate_per_s
        self.rate_burst = rate_burst
        self.clock = clock
        self._scores: dict[str, _Score] = {}
        self._bans: dict[str, tuple[float, str]] = {}  # peer -> (until, reason)
        self._buckets: dict[str, TokenBucket] = {}
        # Per-origin (signer) gossip rate: a valid-but-useless flood from one identity is cut
        # at the first hop even when it arrives through honest relays.
        self.origin_rate_per_s = origin_rate_per_s
        self.origin_burst = origin_burst
        # A signer nobody has heard a heartbeat from (a fresh identity) gets a small burst:
        # with the full one, every throw-away identity could push 1000 valid messages
        # through the whole network before its rate limit bit (bench/hostile.py "useless").
        self.unknown_origin_burst = unknown_origin_burst
        # ...and a forwarder may bring us only so many messages from unknown signers per
        # second: a fresh identity *per message* would otherwise dodge the per-origin limit.
        self.unknown_origins_per_forwarder_per_s = unknown_origins_per_forwarder_per_s
        self.unknown_origins_per_forwarder_burst = unknown_origins_per_forwarder_burst
        self._unknown_origin_buckets: dict[str, TokenBucket] = {}
        self._origin_buckets: dict[str, TokenBucket] = {}
        self.ban_listeners: list[Callable[[str, str], None]] = []
        self.metrics: NodeMetrics | None = None  # set by the node
        # Transport fault layer (node/p2p/faults.py, tests and benchmarks only): peer id ->
        # may this node exchange traffic with it. None (production): every link is up.
        self.link_filter: Callable[[str], bool] | None = None

    # ---- budget
    def points(self, peer_id: str) -> float:
        s = self._scores.get(peer_id)
        if s is None:
            return 0.0
        now = self.clock()
        s.points = max(0.0, s.points - (now - s.updated) * self.decay_per_s)
        s.updated = now
        return s.points

    def penalise(self, peer_id: str, reason: str, points: float | None = None) -> bool:
        """Charge ``peer_id`` for breaking ``reason``; returns True if that banned it."""
        pts = penalty_for(reason) if points is None else points
        cur = self.points(peer_id)
        if peer_id not in self._scores and len(self._scores) >= self.max_peers:
            self._prune_scores()
        s = self._scores.setdefault(peer_id, _Score(updated=self.clock()))
        s.points = cur + pts
        if self.metrics is not None:
            self.metrics.penalties.labels(rule_label(reason)).inc(pts)
        log.debug("penalise %s %.1f for %s (now %.1f/%.1f)", peer_id, pts, reason, s.points, self.budget)
        if s.points > self.budget and not self.is_banned(peer_id):
            self.ban(peer_id, f"misbehaviour budget exceeded (last: {reason})")
            return True
        return False

    # ---- bans
    def ban(self, peer_id: str, reason: str, seconds: float | None = None) -> None:
        """Ban ``peer_id`` for ``seconds`` (default ``ban_seconds``) and tell the listeners."""
        until = self.clock() + (self.ban_seconds if seconds is None else seconds)
        prev = self._bans.get(peer_id)
        if prev is not None and prev[0] >= until:
            return
        if peer_id not in self._bans and len(self._bans) >= self.max_peers:
            self._prune_bans()
        self._bans[peer_id] = (until, reason)
        if self.metrics is not None:
            self.metrics.bans.inc()
        log.warning("banned %s: %s", peer_id, reason)
        for cb in list(self.ban_listeners):
            try:
                cb(peer_id, reason)
            except Exception:  # a listener must never break the caller
                log.exception("ban listener failed")

    def is_banned(self, peer_id: str) -> bool:
        b = self._bans.get(peer_id)
        if b is None:
            return False
        if b[0] <= self.clock():
            del self._bans[peer_id]
            self._scores.pop(peer_id, None)
            return False
        return True

    def reachable(self, peer_id: str) -> bool:
        """False while a fault filter (node/p2p/faults.py) cuts the link to ``peer_id``."""
        f = self.link_filter
        return f is None or f(peer_id)

    def refuses(self, peer_id: str) -> bool:
        """The transport must not carry traffic to or from ``peer_id``: banned, or cut."""
        return self.is_banned(peer_id) or not self.reachable(peer_id)

    def banned(self) -> dict[str, dict]:
        now = self.clock()
        return {
            p: {"seconds_left": round(u - now, 1), "reason": r} for p, (u, r) in list(self._bans.items()) if u > now
        }

    # ---- rate limits
    def allow(self, peer_id: str, n: float = 1.0) -> bool:
        b = self._buckets.get(peer_id)
        if b is None:
            if len(self._buckets) >= self.max_peers:
                self._prune_buckets()
            b = self._buckets[peer_id] = TokenBucket(self.rate_per_s, self.rate_burst, self.clock)
        return b.take(n)

    def allow_origin(self, sender: str, n: float = 1.0, known: bool = True) -> bool:
        """Rate limit per message signer (gossip), independent of who relayed it.

        ``known``: the signer is in the swarm view or the genesis; unknown signers get
        ``unknown_origin_burst`` instead of ``origin_burst`` (same sustained rate).
        """
        burst = self.origin_burst if known else self.unknown_origin_burst
        b = self._origin_buckets.get(sender)
        if b is None:
            if len(self._origin_buckets) >= self.max_peers:
                self._prune_buckets(self._origin_buckets)
            b = self._origin_buckets[sender] = TokenBucket(self.origin_rate_per_s, burst, self.clock)
        elif b.burst < burst:  # became known: the full headroom, as if it had been known all along
            b = self._origin_buckets[sender] = TokenBucket(self.origin_rate_per_s, burst, self.clock)
        elif b.burst > burst:  # forgotten (silent too long): back to the small headroom
            b.burst = burst
        return b.take(n)

    def allow_unknown_origin_via(self, forwarder: str) -> bool:
        """Rate limit, per forwarding peer, on messages signed by origins nobody knows."""
        b = self._unknown_origin_buckets.get(forwarder)
        if b is None:
            if len(self._unknown_origin_buckets) >= self.max_peers:
                self._prune_buckets(self._unknown_origin_buckets)
            b = self._unknown_origin_buckets[forwarder] = TokenBucket(
                self.unknown_origins_per_forwarder_per_s, self.unknown_origins_per_forwarder_burst, self.clock
            )
        return b.take()

    # ---- bounds
    def _prune_scores(self) -> None:
        """Forget scores that decayed to zero; if still full, the lowest half."""
        for pid in list(self._scores):
            if self.points(pid) <= 0.0 and pid not in self._bans:
                del self._scores[pid]
        if len(self._scores) >= self.max_peers:
            for pid in sorted(self._scores, key=lambda p: self._scores[p].points)[: len(self._scores) // 2]:
                del self._scores[pid]

    def _prune_bans(self) -> None:
        """Drop expired bans; if still full, those ending soonest."""
        now = self.clock()
        for pid, (until, _r) in list(self._bans.items()):
            if until <= now:
                del self._bans[pid]
        if len(self._bans) >= self.max_peers:
            for pid in sorted(self._bans, key=lambda p: self._bans[p][0])[: len(self._bans) // 10 + 1]:
                del self._bans[pid]

    def _prune_buckets(self, table: dict[str, TokenBucket] | None = None) -> None:
        """Drop buckets that are full again (idle peers: a new bucket is identical)."""
        table = self._buckets if table is None else table
        now = self.clock()
        for pid, b in list(table.items()):
            if b.tokens + (now - b.t) * b.rate >= b.burst:
                del table[pid]
        if len(table) >= self.max_peers:  # all busy: forget the least recently used half
            for pid in sorted(table, key=lambda p: table[p].t)[: len(table) // 2]:
                del table[pid]

    def sizes(self) -> dict[str, int]:
        return {
            "scores": len(self._scores),
            "bans": len(self._bans),
            "buckets": len(self._buckets),
            "origin_buckets": len(self._origin_buckets),
            "unknown_origin_buckets": len(self._unknown_origin_buckets),
        }
