"""Plumtree's state machine, with no I/O: frames and times in, frames to send out.

``Gossip`` (node/p2p/gossip.py) owns the streams, the timers and validation; it tells this
object what happened (a link came up or went, a new valid message, a duplicate, a control
frame, a timer fired) with the current time, and sends the :class:`Send` actions it gets
back. So the tree's rules can be tested with plain calls and explicit times
(tests/p2p/test_plumtree.py) and driven by a simulator without sockets (issue 32).

The rules (Leitão, Pereira, Rodrigues: "Epidemic Broadcast Trees", 2007; docs/protocol.md):

* every linked peer starts *eager*: a new message goes to every eager peer except the one it
  came from and its origin;
* an eager peer that sends ``PRUNE_AFTER`` duplicates in a row is made *lazy* and sent PRUNE
  (never below ``MIN_EAGER`` eager links): the eager links shrink to a spanning tree;
* lazy peers get message ids in IHAVE frames, flushed on the driver's IHAVE timer; an id
  still missing ``graft_timeout_s`` after its first IHAVE is asked for with GRAFT (which
  makes that link eager again), then from the next announcer after another timeout;
* recent messages are cached (bounded by count, bytes, age, and per forwarder) to answer
  GRAFTs; ids already seen are remembered (bounded by count and age).

Every table is bounded, and per peer where a peer could fill it: a peer announcing ids it
never serves holds at most ``missing_per_peer`` of the missing ids, a forwarder relaying a
valid flood at most ``cache_share`` of the cache (docs/security.md).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from protocol import gossip as frames
from protocol.gossip import GRAFT, IHAVE, MAX_IDS_PER_FRAME, PRUNE

PRUNE_AFTER = 3  # duplicates in a row from an eager peer before it is pruned
MIN_EAGER = 2  # never prune below this many eager links
MAX_ANNOUNCERS = 16  # announcers remembered per missing id


@dataclasses.dataclass(frozen=True)
class Send:
    """Queue ``frame`` (an encoded gossip frame) to ``peer``."""

    peer: str
    frame: bytes


@dataclasses.dataclass
class _Missing:
    """An id announced to us that we lack: when to ask next, whom, and who announced it first
    (the peer whose share of the missing table it takes)."""

    deadline: float
    announcers: list[str]
    owner: str


class _Held:
    """The messages one forwarder has in the GRAFT cache (oldest first) and their bytes."""

    def __init__(self) -> None:
        self.ids: collections.deque[bytes] = collections.deque()
        self.bytes = 0


class Plumtree:
    """One node's Plumtree state. Every linked peer is in exactly one of ``eager``/``lazy``."""

    def __init__(
        self,
        *,
        seen_capacity: int = 200_000,
        seen_ttl_s: float = 180.0,
        graft_timeout_s: float = 0.25,
        cache_capacity: int = 20_000,
        cache_max_bytes: int = 64 * 1024 * 1024,
        cache_ttl_s: float = 120.0,
        cache_share: float = 0.25,
        missing_capacity: int = 20_000,
        missing_per_peer: int = MAX_IDS_PER_FRAME,
    ) -> None:
        self.seen_capacity = seen_capacity
        self.seen_ttl_s = seen_ttl_s
        self.graft_timeout_s = graft_timeout_s
        self.cache_capacity = cache_capacity
        self.cache_max_bytes = cache_max_bytes
        self.cache_ttl_s = cache_ttl_s
        # One forwarder's messages may take at most this share of the cache's count and bytes:
        # a peer relaying a valid flood at its full rate would otherwise cycle the whole cache
        # and leave GRAFTs for everyone else's messages unanswered. Ours are not counted.
        self.cache_share = cache_share
        self.missing_capacity = missing_capacity
        # Missing ids first announced by one peer (its share of ``missing_capacity``): a peer
        # announcing ids it never serves must not push out the ids honest peers announced.
        self.missing_per_peer = missing_per_peer
        self.eager: set[str] = set()
        self.lazy: set[str] = set()
        self.seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        # id -> (message frame, time, forwarder or "" for ours)
        self.cache: collections.OrderedDict[bytes, tuple[bytes, float, str]] = collections.OrderedDict()
        self.cache_bytes = 0
        self.cache_by: dict[str, _Held] = {}
        self.ihave_out: dict[str, list[bytes]] = {}  # peer -> ids for its next IHAVE
        self.missing: collections.OrderedDict[bytes, _Missing] = collections.OrderedDict()
        self.missing_by: collections.Counter[str] = collections.Counter()
        self._dup_streak: dict[str, int] = {}  # eager peer -> duplicates in a row from it
        self.duplicates = 0
        self.counters: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------ links
    def linked(self, peer: str) -> bool:
        return peer in self.eager or peer in self.lazy

    def add_link(self, peer: str) -> None:
        """A new neighbour: it starts eager."""
        self.lazy.discard(peer)
        self.eager.add(peer)

    def remove_link(self, peer: str) -> None:
        self.eager.discard(peer)
        self.lazy.discard(peer)
        self.ihave_out.pop(peer, None)
        self._dup_streak.pop(peer, None)

    def make_eager(self, peer: str) -> None:
        if self.linked(peer):
            self.lazy.discard(peer)
            self.eager.add(peer)

    def make_lazy(self, peer: str) -> None:
        if self.linked(peer):
            self.eager.discard(peer)
            self.lazy.add(peer)

    def mute(self, peer: str) -> None:
        """The peer does not speak our gossip (identify says so): send it nothing, not even ids."""
        self.make_lazy(peer)
        self.ihave_out.pop(peer, None)

    # ------------------------------------------------------------ messages
    def is_seen(self, msg_id: bytes) -> bool:
        return msg_id in self.seen

    def mark_seen(self, msg_id: bytes, now: float) -> None:
        self.seen[msg_id] = now
        while self.seen:
            _oldest, t = next(iter(self.seen.items()))
            if len(self.seen) > self.seen_capacity or now - t > self.seen_ttl_s:
                self.seen.popitem(last=False)
            else:
                break

    def publish(self, msg_id: bytes, frame: bytes, now: float) -> list[Send]:
        """Our own new message: to every eager peer, its id to every lazy one."""
        self.mark_seen(msg_id, now)
        self.remember(msg_id, frame, "", now)
        return self.pass_on(msg_id, frame, exclude=())

    def duplicate(self, fwd: str) -> list[Send]:
        """``fwd`` sent a message we already had: a second eager path to us. Keep the first,
        demote this one, with hysteresis: only after ``PRUNE_AFTER`` duplicates in a row, and
        never below ``MIN_EAGER`` eager links (concurrent prunes by several nodes for messages
        from several origins otherwise cut the tree apart, and GRAFT storms follow)."""
        self.duplicates += 1
        if fwd not in self.eager:
            return []
        streak = self._dup_streak[fwd] = self._dup_streak.get(fwd, 0) + 1
        if streak < PRUNE_AFTER or len(self.eager) <= MIN_EAGER:
            return []
        self._dup_streak.pop(fwd, None)
        self.make_lazy(fwd)
        self.counters["prune_sent"] += 1
        return [Send(fwd, frames.encode_control(PRUNE))]

    def deliver(self, fwd: str, origin: str, msg_id: bytes, frame: bytes, now: float) -> list[Send]:
        """A new valid message (already marked seen) arrived from ``fwd``: the path that
        delivered it first stays in the tree, and it goes on to everyone else."""
        self.forget_missing(msg_id)
        self.remember(msg_id, frame, fwd, now)
        self.make_eager(fwd)
        self._dup_streak.pop(fwd, None)
        return self.pass_on(msg_id, frame, exclude=(fwd, origin))

    def pass_on(self, msg_id: bytes, frame: bytes, exclude: tuple[str, ...]) -> list[Send]:
        """``frame`` to eager peers, its id queued for lazy ones (beyond a full IHAVE frame a
        lazy peer still has GRAFT from others)."""
        out = [Send(p, frame) for p in list(self.eager) if p not in exclude]
        for p in self.lazy:
            if p not in exclude:
                ids = self.ihave_out.setdefault(p, [])
                if len(ids) < MAX_IDS_PER_FRAME:
                    ids.append(msg_id)
        return out

    # ------------------------------------------------------------ control frames
    def on_prune(self, fwd: str) -> None:
        self.counters["prune_received"] += 1
        self.make_lazy(fwd)

    def on_graft(self, fwd: str, ids: list[bytes]) -> list[Send]:
        """``fwd`` asks for ``ids`` (and wants our link eager again): what the cache holds."""
        self.counters["graft_received"] += 1
        self.make_eager(fwd)
        out = []
        for msg_id in ids:
            hit = self.cache.get(msg_id)
            if hit is not None:
                self.counters["graft_served"] += 1
                out.append(Send(fwd, hit[0]))
        return out

    def on_ihave(self, fwd: str, ids: list[bytes], now: float) -> None:
        """``fwd`` has ``ids``: those we lack are asked for at ``now + graft_timeout_s`` unless
        they arrive first."""
        self.counters["ihave_received"] += len(ids)
        deadline = now + self.graft_timeout_s
        for msg_id in ids:
            if msg_id in self.seen:
                continue
            entry = self.missing.get(msg_id)
            if entry is None:
                if self.missing_by[fwd] >= self.missing_per_peer:
                    self.counters["ihave_over_share"] += 1
                    continue  # its share is full; other announcers of the id still count
                if len(self.missing) >= self.missing_capacity:
                    self.forget_missing(next(iter(self.missing)))
                self.missing[msg_id] = _Missing(deadline, [fwd], fwd)
                self.missing_by[fwd] += 1
            elif fwd not in entry.announcers and len(entry.announcers) < MAX_ANNOUNCERS:
                entry.announcers.append(fwd)

    def forget_missing(self, msg_id: bytes) -> None:
        entry = self.missing.pop(msg_id, None)
        if entry is not None:
            self.missing_by[entry.owner] -= 1
            if self.missing_by[entry.owner] <= 0:
                del self.missing_by[entry.owner]

    # ------------------------------------------------------------ timers
    def flush_ihave(self) -> list[Send]:
        """The IHAVE timer fired: every lazy peer's queued ids, one frame each."""
        out, self.ihave_out = self.ihave_out, {}
        sends = []
        for peer, ids in out.items():
            if ids:
                self.counters["ihave_sent"] += len(ids)
                sends.append(Send(peer, frames.encode_control(IHAVE, ids)))
        return sends

    def due_grafts(self, now: float) -> list[Send]:
        """The GRAFT timer fired: ask an announcer for every id still missing past its
        deadline (the next announcer after each further timeout; an id nobody linked is left
        to announce is forgotten, and a later IHAVE starts over)."""
        wanted: dict[str, list[bytes]] = {}
        for msg_id, entry in list(self.missing.items()):
            if msg_id in self.seen:
                self.forget_missing(msg_id)
                continue
            if entry.deadline > now:
                continue
            while entry.announcers and not self.linked(entry.announcers[0]):
                entry.announcers.pop(0)
            if not entry.announcers:
                self.forget_missing(msg_id)
                continue
            wanted.setdefault(entry.announcers.pop(0), []).append(msg_id)
            entry.deadline = now + self.graft_timeout_s
        sends = []
        for peer, ids in wanted.items():
            for i in range(0, len(ids), MAX_IDS_PER_FRAME):
                self.counters["graft_sent"] += 1
                self.make_eager(peer)
                sends.append(Send(peer, frames.encode_control(GRAFT, ids[i : i + MAX_IDS_PER_FRAME])))
        return sends

    # ------------------------------------------------------------ the GRAFT cache
    def remember(self, msg_id: bytes, frame: bytes, forwarder: str, now: float) -> None:
        """Keep ``frame`` to answer GRAFTs: bounded by count, bytes (manifests are large) and age,
        and per forwarder: past its share (``cache_share`` of count and bytes) a forwarder's own oldest entries make room, never
        other peers' (GRAFTs come within a second or two of a message, so the newest are the
        ones worth keeping)."""
        if msg_id in self.cache:
            return
        if forwarder:
            held = self.cache_by.setdefault(forwarder, _Held())
            while held.ids and (
                len(held.ids) + 1 > self.cache_capacity * self.cache_share
                or held.bytes + len(frame) > self.cache_max_bytes * self.cache_share
            ):
                self.counters["cache_over_share"] += 1
                self._uncache(held.ids[0])
            held = self.cache_by.setdefault(forwarder, _Held())
            held.ids.append(msg_id)
            held.bytes += len(frame)
        self.cache[msg_id] = (frame, now, forwarder)
        self.cache_bytes += len(frame)
        while self.cache:
            oldest, (_f, t, _fwd) = next(iter(self.cache.items()))
            if (
                len(self.cache) > self.cache_capacity
                or self.cache_bytes > self.cache_max_bytes
                or now - t > self.cache_ttl_s
            ):
                self._uncache(oldest)
            else:
                break

    def _uncache(self, msg_id: bytes) -> None:
        """Drop one cached message. Insertion order is the same in the cache and in each
        forwarder's list, so the entry is at the head of its forwarder's list."""
        frame, _t, fwd = self.cache.pop(msg_id)
        self.cache_bytes -= len(frame)
        if fwd:
            held = self.cache_by[fwd]
            held.ids.popleft()
            held.bytes -= len(frame)
            if not held.ids:
                del self.cache_by[fwd]

    def status(self) -> dict[str, Any]:
        return {
            "eager": len(self.eager),
            "lazy": len(self.lazy),
            "duplicates": self.duplicates,
            "seen_cache": len(self.seen),
            "message_cache": len(self.cache),
            "message_cache_bytes": self.cache_bytes,
            "missing": len(self.missing),
        }
