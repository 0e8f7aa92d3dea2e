"""Per-peer resource accounting for inbound request/response streams (no I/O).

Why: the node answers requests from every peer out of one pool of handler slots.
Before this module a single connection that opened 100 request streams and wrote
nothing held all 64 slots for 30 s each, and every other peer's genesis and
peer-exchange requests failed meanwhile. In the spirit of go-libp2p's resource
manager (system and peer scopes, a limit per scope, a request over a limit fails
at once instead of queueing), the accounting here bounds what one peer can hold:

* **streams** (peer scope and system scope): a peer may have at most
  ``streams_per_peer`` inbound request streams open at once, the node at most
  ``total_streams``. A stream over the peer's cap is refused at once (the driver
  resets it); a peer that keeps doing it past a small free allowance is charged.
  When the node's total is full, a newcomer that holds fewer streams than the
  biggest holder takes the biggest holder's oldest stream that holds no slot
  (preemption), so a flood from many peers cannot lock out a peer that holds none.
* **read deadlines that fit the request**: the 4-byte length prefix must arrive
  within ``first_byte_s``; the body within ``read_base_s`` plus its size at
  ``min_rate_bps``. A stream that writes nothing or dribbles is closed after a few
  seconds, not the 30 s a large frame may need.
* **slots** (the work: running the handler and writing the answer): the node has
  ``total_slots``, a peer may hold at most ``slots_per_peer`` (well below the
  total). A stream takes a slot only once its whole request has been read, so a
  peer that writes slowly holds streams of its own allowance, never slots. When
  slots are short, a free slot goes to the waiting stream whose peer holds the
  fewest slots (ties: first come), so a peer that holds none is never starved by
  one that holds many.

The class is pure and clock-injected: the driver in ``node/p2p/reqresp.py`` calls
it, resets the streams it refuses or preempts, and wakes the streams it grants
slots to. Tests drive it with a fake clock.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import trio


@dataclasses.dataclass(frozen=True)
class StreamLimits:
    """The bounds; defaults sized for honest traffic (measured peaks: 4 batch fetches, one
    chunk-ticket worker and one peer exchange at a time from one peer)."""

    streams_per_peer: int = 16
    total_streams: int = 1024
    slots_per_peer: int = 8
    total_slots: int = 64
    first_byte_s: float = 5.0
    read_base_s: float = 2.0
    min_rate_bps: float = 64 * 1024
    max_read_s: float = 30.0
    # refusals a peer may cause for free (a burst, refilled at refusal_refill_per_s): an honest
    # peer at its cap for a moment is not charged; one that keeps opening streams is
    free_refusals: float = 8.0
    refusal_refill_per_s: float = 1.0
    refusal_points: float = 1.0
    max_peers: int = 10_000  # bound on the refusal table (fresh identities are free)

    def __post_init__(self) -> None:
        if not 0 < self.slots_per_peer <= self.total_slots:
            raise ValueError("need 0 < slots_per_peer <= total_slots")
        if not 0 < self.streams_per_peer <= self.total_streams:
            raise ValueError("need 0 < streams_per_peer <= total_streams")


@dataclasses.dataclass
class Admission:
    """What :meth:`StreamAccounting.open` decided. ``ticket`` is None when the stream is
    refused (``reason`` says why, ``charge`` whether the peer is to be charged for it);
    ``preempt`` names a ticket of another peer the driver must reset to make room."""

    ticket: int | None
    reason: str = ""
    charge: bool = False
    preempt: int | None = None


@dataclasses.dataclass
class _Stream:
    peer: str
    opened: float
    state: str = "reading"  # reading -> waiting -> serving


class StreamAccounting:
    """Streams and slots per peer and in total; see the module docstring."""

    def __init__(self, limits: StreamLimits | None = None, clock: Callable[[], float] = trio.current_time) -> None:
        self.limits = limits or StreamLimits()
        self.clock = clock
        self._ids = itertools.count(1)
        self._streams: dict[int, _Stream] = {}
        self._per_peer: dict[str, int] = {}  # open streams per peer
        self._slots: dict[str, int] = {}  # slots held per peer
        self._waiting: list[int] = []  # tickets waiting for a slot, first come first
        self._refusals: dict[str, tuple[float, float]] = {}  # peer -> (tokens, updated)
        self.counters: dict[str, int] = {
            "opened": 0,
            "refused_peer_cap": 0,
            "refused_total": 0,
            "preempted": 0,
            "charged": 0,
            "slot_waits": 0,
        }

    # ------------------------------------------------------------------ streams
    def open(self, peer: str) -> Admission:
        """A new inbound stream from ``peer``: admit it (a ticket) or refuse it."""
        lim = self.limits
        held = self._per_peer.get(peer, 0)
        if held >= lim.streams_per_peer:
            self.counters["refused_peer_cap"] += 1
            charge = not self._take_refusal(peer)
            if charge:
                self.counters["charged"] += 1
            return Admission(None, f"over the per-peer cap of {lim.streams_per_peer} streams", charge=charge)
        preempt = None
        if len(self._streams) >= lim.total_streams:
            preempt = self._victim(peer, held)
            if preempt is None:
                self.counters["refused_total"] += 1
                return Admission(None, f"node at its {lim.total_streams} streams")
            self.counters["preempted"] += 1
            self.close(preempt)
        t = next(self._ids)
        self._streams[t] = _Stream(peer, self.clock())
        self._per_peer[peer] = held + 1
        self.counters["opened"] += 1
        return Admission(t, preempt=preempt)

    def _victim(self, peer: str, held: int) -> int | None:
        """The oldest slot-less stream of the biggest holder, if it holds more than ``peer``
        would after admission (so preemption never turns unfair the other way)."""
        top = max(self._per_peer, key=lambda p: self._per_peer[p], default=None)
        if top is None or top == peer or self._per_peer[top] <= held + 1:
            return None
        cands = [(s.opened, t) for t, s in self._streams.items() if s.peer == top and s.state != "serving"]
        return min(cands)[1] if cands else None

    def close(self, ticket: int) -> list[int]:
        """The stream is done (answered, failed, reset). Returns the tickets that were just
        granted a slot (the driver wakes them). Closing an unknown ticket is a no-op."""
        s = self._streams.pop(ticket, None)
        if s is None:
            return []
        n = self._per_peer[s.peer] - 1
        if n:
            self._per_peer[s.peer] = n
        else:
            del self._per_peer[s.peer]
        if s.state == "waiting":
            self._waiting.remove(ticket)
            return []
        if s.state == "serving":
            self._drop_slot(s.peer)
            return self._dispatch()
        return []

    # ------------------------------------------------------------------ slots
    def want_slot(self, ticket: int) -> bool:
        """The stream's request is read: it asks for a slot. True: granted now; False: it
        waits (the driver waits until a later :meth:`close` returns its ticket). A ticket
        already closed (preempted between its last read and this call) is never granted."""
        s = self._streams.get(ticket)
        if s is None:
            return False
        s.state = "waiting"
        self._waiting.append(ticket)
        granted = self._dispatch()
        if ticket in granted:
            return True
        self.counters["slot_waits"] += 1
        return False

    def _dispatch(self) -> list[int]:
        lim = self.limits
        granted = []
        while self._waiting and sum(self._slots.values()) < lim.total_slots:
            eligible = [t for t in self._waiting if self._slots.get(self._streams[t].peer, 0) < lim.slots_per_peer]
            if not eligible:
                break
            # fewest slots held first; first come among equals (min is stable on the list order)
            t = min(eligible, key=lambda t: self._slots.get(self._streams[t].peer, 0))
            self._waiting.remove(t)
            s = self._streams[t]
            s.state = "serving"
            self._slots[s.peer] = self._slots.get(s.peer, 0) + 1
            granted.append(t)
        return granted

    def _drop_slot(self, peer: str) -> None:
        n = self._slots[peer] - 1
        if n:
            self._slots[peer] = n
        else:
            del self._slots[peer]

    # ------------------------------------------------------------------ deadlines
    def read_deadline(self, size: int) -> float:
        """Seconds to read a request body of ``size`` bytes once its length prefix is in."""
        lim = self.limits
        return min(lim.max_read_s, lim.read_base_s + size / lim.min_rate_bps)

    # ------------------------------------------------------------------ charging
    def _take_refusal(self, peer: str) -> bool:
        """Take one free refusal from ``peer``'s allowance; False when it has none left."""
        lim = self.limits
        now = self.clock()
        tokens, updated = self._refusals.get(peer, (lim.free_refusals, now))
        tokens = min(lim.free_refusals, tokens + (now - updated) * lim.refusal_refill_per_s)
        if peer not in self._refusals and len(self._refusals) >= lim.max_peers:
            self._prune_refusals(now)
        ok = tokens >= 1.0
        self._refusals[peer] = (tokens - 1.0 if ok else tokens, now)
        return ok

    def _prune_refusals(self, now: float) -> None:
        """Forget allowances that refilled (a new entry is identical); if still full, the oldest half."""
        lim = self.limits
        for p, (tok, upd) in list(self._refusals.items()):
            if tok + (now - upd) * lim.refusal_refill_per_s >= lim.free_refusals:
                del self._refusals[p]
        if len(self._refusals) >= lim.max_peers:
            for p in sorted(self._refusals, key=lambda p: self._refusals[p][1])[: len(self._refusals) // 2]:
                del self._refusals[p]

    # ------------------------------------------------------------------ views
    def holding(self, peer: str) -> tuple[int, int]:
        """(streams open, slots held) by ``peer``."""
        return self._per_peer.get(peer, 0), self._slots.get(peer, 0)

    def sizes(self) -> dict[str, int]:
        return {
            "streams": len(self._streams),
            "peers": len(self._per_peer),
            "slots": sum(self._slots.values()),
            "waiting": len(self._waiting),
            "refusal_entries": len(self._refusals),
        }
