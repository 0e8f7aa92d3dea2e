"""Heartbeats and the swarm view.

Every node publishes a signed ``Heartbeat`` every ``interval`` seconds (role,
policy version, dialable addresses, data-plane port, chunk have-sets, a few
counters). :class:`SwarmView` keeps the newest heartbeat of every peer and
forgets peers silent for ``forget_after`` seconds.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

import trio

from protocol import Envelope, HaveEntry, Heartbeat


@dataclasses.dataclass
class PeerState:
    peer_id: str
    heartbeat: Heartbeat
    last_seen: float  # monotonic
    received_ms: int  # wall clock

    def to_json(self, now: float) -> dict:
        hb = self.heartbeat
        return {
            "peer_id": self.peer_id,
            "role": hb.role,
            "policy_version": hb.policy_version,
            "addrs": list(hb.addrs),
            "data_port": hb.data_port,
            "have": [
                {"version": h.version, "root": h.root.hex(), "chunks": sum(bin(b).count("1") for b in h.bitmap)}
                for h in hb.have
            ],
            "uptime_s": round(hb.uptime_s, 1),
            "step": hb.step,
            "batches": hb.batches,
            "last_seen_s": round(now - self.last_seen, 1),
        }


class SwarmView:
    """Newest heartbeat per peer; peers silent for ``forget_after`` s are forgotten.

    ``peers()`` -> live :class:`PeerState` by peer id; ``holders(version, root)``
    -> {peer_id: HaveEntry} for the chunk fetcher; ``listeners`` are called with
    each new ``PeerState`` (the connection manager learns addresses that way).
    """

    def __init__(
        self,
        my_id: str,
        forget_after: float = 10.0,
        clock: Callable[[], float] = trio.current_time,
        max_peers: int = 2048,
    ) -> None:
        self.my_id = my_id
        # Heartbeats are up to 200 KiB and identities are free: a flood of fresh senders must
        # not grow the view without bound. When full, peers already known keep refreshing and
        # new ones wait until silent peers are forgotten.
        self.max_peers = max_peers
        self.refused = 0
        # Who introduced each entry: the peer that forwarded its first heartbeat to us (set by
        # the node from gossip; None: unknown). While full, a newcomer may take the place of an
        # entry introduced by the peer holding the most entries, if that is more than its own
        # introducer holds: one neighbour relaying a crowd of fresh identities ends up with a
        # fair share of the view, and the peers others introduce still get in.
        self.introducer: Callable[[], str | None] = lambda: None
        self._via: dict[str, str] = {}
        self._via_count: collections.Counter[str] = collections.Counter()
        self.displaced = 0
        self.forget_after = forget_after
        self.clock = clock
        self._peers: dict[str, PeerState] = {}
        self.listeners: list[Callable[[PeerState], None]] = []
        # Gossip delivery delay of recent heartbeats: our wall clock at arrival minus the
        # sender's signed timestamp (meaningful where clocks agree: one machine's namespaces).
        self.delivery_ms: collections.deque[float] = collections.deque(maxlen=2048)

    def on_heartbeat(self, env: Envelope) -> None:
        if env.sender == self.my_id or not isinstance(env.body, Heartbeat):
            return
        prev = self._peers.get(env.sender)
        if prev is not None and prev.heartbeat is not None and env.timestamp_ms < prev.received_ms - 60_000:
            return
        via = self.introducer() if prev is None else None
        if prev is None and len(self._peers) >= self.max_peers:
            self.prune()
            if len(self._peers) >= self.max_peers and not self._displace_for(via):
                self.refused += 1
                return
        st = PeerState(env.sender, env.body, self.clock(), env.timestamp_ms)
        self._peers[env.sender] = st
        if via is not None:
            self._via[env.sender] = via
            self._via_count[via] += 1
        self.delivery_ms.append(time.time() * 1000 - env.timestamp_ms)
        for cb in list(self.listeners):
            cb(st)

    def forget(self, peer_id: str) -> None:
        self._peers.pop(peer_id, None)
        via = self._via.pop(peer_id, None)
        if via is not None:
            self._via_count[via] -= 1
            if self._via_count[via] <= 0:
                del self._via_count[via]

    def prune(self) -> None:
        cutoff = self.clock() - self.forget_after
        for pid, st in list(self._peers.items()):
            if st.last_seen < cutoff:
                self.forget(pid)

    def introduced_by(self, peer_id: str) -> int:
        """Entries whose first heartbeat ``peer_id`` forwarded to us."""
        return self._via_count.get(peer_id, 0)

    def _displace_for(self, via: str | None) -> bool:
        """Make room for a newcomer introduced by ``via``: drop the least recently heard entry
        of the introducer holding the most, if it holds more than ``via`` would after."""
        if via is None or not self._via_count:
            return False
        top, held = self._via_count.most_common(1)[0]
        if top == via or held <= self._via_count.get(via, 0) + 1:
            return False
        victim = min((p for p, v in self._via.items() if v == top), key=lambda p: self._peers[p].last_seen)
        self.forget(victim)
        self.displaced += 1
        return True

    def peers(self) -> dict[str, PeerState]:
        self.prune()
        return dict(self._peers)

    def knows(self, peer_id: str) -> bool:
        """Whether we hold a heartbeat from ``peer_id`` (cheap: no copy, no pruning)."""
        return peer_id in self._peers

    def get(self, peer_id: str) -> PeerState | None:
        return self.peers().get(peer_id)

    def by_role(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for pid, st in self.peers().items():
            out.setdefault(st.heartbeat.role, []).append(pid)
        return out

    def holders(self, version: int, root: bytes | None = None) -> dict[str, HaveEntry]:
        """Peers whose latest heartbeat lists chunks of ``version`` (and ``root``)."""
        out = {}
        for pid, st in self.peers().items():
            for h in st.heartbeat.have:
                if h.version == version and (root is None or h.root == root):
                    out[pid] = h
        return out

    def to_json(self) -> dict:
        now = self.clock()
        peers = self.peers()
        roles: dict[str, int] = {}
        for st in peers.values():
            roles[st.heartbeat.role] = roles.get(st.heartbeat.role, 0) + 1
        delays = sorted(self.delivery_ms)
        delay: dict[str, float] = {"n": len(delays)}
        if delays:
            delay |= {
                "p50_ms": round(delays[len(delays) // 2], 1),
                "p99_ms": round(delays[min(len(delays) - 1, int(len(delays) * 0.99))], 1),
            }
        return {
            "size": len(peers),
            "by_role": roles,
            "heartbeat_delivery": delay,
            "peers": [st.to_json(now) for st in peers.values()],
        }
