"""The one fair intake queue: work offered by senders we cannot trust, taken in an order no
flood of identities can rig.

Two queues of the learning roles face the same attack. Anyone can make fresh identities,
and each can offer well-formed work that costs us something to find worthless:

* the **announce queue** (trainer and validator): an announced batch costs a fetch task
  for as long as its announcer keeps it waiting, and an announcer that never serves holds
  one for the whole fetch timeout;
* the **verify queue** (validator): a fetched batch that passes every rule needing no
  model still costs a prefill to reject.

Both answer it the same way, so both are this class with different :class:`LaneRules`:
senders with a **track record** (a batch of theirs was served and matched, or accepted:
:meth:`FairQueue.mark_proven`) wait in the proven lane; everyone else shares the unproven
lane, which is bounded, may cap each sender, and gets only part of the consumers' attention
(``unproven_slots`` items in progress at once, and/or one turn in ``unproven_every`` while
proven items wait). Within a lane no sender can keep another out:

* ``displace``: when the lane is full, an item from a sender that would hold fewer than
  the lane's biggest holder takes the place of that holder's newest item; so a sender
  with items waiting holds at least min(its items, capacity / senders) of them whatever
  others offer, and only as many identities as the lane has places can fill it;
* ``refuse``: when full (or over ``per_sender``), the offer is dropped and counted;
* ``wait``: :meth:`FairQueue.put` waits for room (back-pressure, nothing dropped).

Taking is first-come in ``fifo`` lanes and one item per sender in turn in ``round_robin``
lanes (a Sybil with many items gets no more turns than a newcomer with one).

:class:`FairLanes` is the pure core (no trio, no clock: inputs are offers, takes and
verdicts; outputs are what was queued, displaced, dropped and taken); :class:`FairQueue`
only adds the waiting (trio events, never polls).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any, Generic, Literal, TypeVar

import trio

T = TypeVar("T")

WhenFull = Literal["displace", "refuse", "wait"]
Order = Literal["fifo", "round_robin"]


@dataclasses.dataclass(frozen=True)
class LaneRules:
    """How one lane holds and hands out items."""

    capacity: int  # items queued in the lane
    when_full: WhenFull = "displace"
    order: Order = "fifo"
    per_sender: int | None = None  # items one sender may hold in the lane (None: the capacity)

    def __post_init__(self) -> None:
        if self.capacity < 1 or (self.per_sender is not None and self.per_sender < 1):
            raise ValueError("lane bounds must be positive")


@dataclasses.dataclass(frozen=True)
class Offer(Generic[T]):
    """What became of an offered item."""

    queued: bool
    lane: bool  # True: the proven lane
    displaced: tuple[str, T] | None = None  # the (sender, item) that gave its place up
    # why not queued: "announcer_cap" (the sender holds its share), "proven_full" /
    # "unproven_full" (the lane is full of senders holding no more than this one would), or
    # "wait" (a full ``wait`` lane: the caller may wait for room)
    reason: str | None = None


@dataclasses.dataclass(frozen=True)
class Taken(Generic[T]):
    """An item handed to a consumer; pass it to :meth:`FairLanes.done` when its work is over."""

    sender: str
    item: T
    unproven: bool


class _Lane(Generic[T]):
    """One lane's items, per sender in insertion order (the dict's order is the round)."""

    def __init__(self, rules: LaneRules) -> None:
        self.rules = rules
        self.by_sender: collections.OrderedDict[str, collections.deque[tuple[int, T]]] = collections.OrderedDict()
        self.n = 0

    def held(self, sender: str) -> int:
        q = self.by_sender.get(sender)
        return len(q) if q else 0

    def append(self, sender: str, seq: int, item: T) -> None:
        q = self.by_sender.get(sender)
        if q is None:
            q = self.by_sender[sender] = collections.deque()  # joins the end of the round
        q.append((seq, item))
        self.n += 1

    def pop_newest(self, sender: str) -> T:
        q = self.by_sender[sender]
        _, item = q.pop()
        self.n -= 1
        if not q:
            del self.by_sender[sender]
        return item

    def pop_next(self) -> tuple[str, T]:
        if self.rules.order == "round_robin":
            sender = next(iter(self.by_sender))
        else:  # first come: the sender whose oldest item is the oldest
            sender = min(self.by_sender, key=lambda s: self.by_sender[s][0][0])
        q = self.by_sender[sender]
        _, item = q.popleft()
        self.n -= 1
        if not q:
            del self.by_sender[sender]
        elif self.rules.order == "round_robin":
            self.by_sender.move_to_end(sender)  # the next sender's turn
        return sender, item

    def remove(self, sender: str) -> list[tuple[int, T]]:
        q = self.by_sender.pop(sender, None)
        if not q:
            return []
        self.n -= len(q)
        return list(q)

    def biggest(self) -> tuple[str, int]:
        sender = max(self.by_sender, key=lambda s: len(self.by_sender[s]))
        return sender, len(self.by_sender[sender])


class FairLanes(Generic[T]):
    """The pure core of :class:`FairQueue` (see the module docstring)."""

    def __init__(
        self,
        proven: LaneRules,
        unproven: LaneRules,
        *,
        unproven_slots: int | None = None,
        unproven_every: int | None = None,
        remember: int = 4096,
    ) -> None:
        if min(unproven_slots or 1, unproven_every or 1, remember) < 1:
            raise ValueError("fair queue bounds must be positive")
        self._lanes: dict[bool, _Lane[T]] = {True: _Lane(proven), False: _Lane(unproven)}
        self.unproven_slots = unproven_slots  # unproven items in progress at once (None: any)
        self.unproven_every = unproven_every  # at most 1 take in this many while proven items wait (None: never)
        self.remember = remember
        self._proven_peers: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._seq = itertools.count()
        self._unproven_busy = 0
        self._streak = 0  # proven items taken since the last unproven one
        self.dropped: collections.Counter[str] = collections.Counter()
        self.served: collections.Counter[str] = collections.Counter()  # "proven" / "unproven"

    def __len__(self) -> int:
        return self._lanes[True].n + self._lanes[False].n

    def queued(self, lane: bool) -> int:
        return self._lanes[lane].n

    def held(self, sender: str) -> int:
        """Items of ``sender`` waiting in either lane."""
        return self._lanes[True].held(sender) + self._lanes[False].held(sender)

    # ------------------------------------------------------------ standing
    def proven(self, sender: str) -> bool:
        return sender in self._proven_peers

    def mark_proven(self, sender: str) -> None:
        """``sender`` earned a track record: its waiting items move to the proven lane (beyond
        its capacity if need be: they were already queued) and its next ones queue there."""
        self._proven_peers[sender] = None
        self._proven_peers.move_to_end(sender)
        while len(self._proven_peers) > self.remember:
            self._proven_peers.popitem(last=False)
        for seq, item in self._lanes[False].remove(sender):
            self._lanes[True].append(sender, seq, item)

    def forget(self, sender: str) -> None:
        """``sender`` loses its standing (items already in the proven lane stay)."""
        self._proven_peers.pop(sender, None)

    def discard(self, sender: str, reason: str = "banned") -> list[T]:
        """Drop everything ``sender`` has queued (counted under ``reason``); returns the items."""
        gone = [item for lane in (True, False) for _, item in self._lanes[lane].remove(sender)]
        self.dropped[reason] += len(gone)
        return gone

    # ------------------------------------------------------------ in
    def offer(self, sender: str, item: T) -> Offer[T]:
        """Queue ``item`` of ``sender`` in its lane, by the lane's rules."""
        lane_id = self.proven(sender)
        lane = self._lanes[lane_id]
        rules = lane.rules
        mine = lane.held(sender)
        if rules.per_sender is not None and mine >= rules.per_sender:
            self.dropped["announcer_cap"] += 1
            return Offer(False, lane_id, reason="announcer_cap")
        displaced = None
        if lane.n >= rules.capacity:
            if rules.when_full == "wait":
                return Offer(False, lane_id, reason="wait")
            biggest, n = lane.biggest()
            if rules.when_full == "refuse" or n <= mine + 1:
                full = "proven_full" if lane_id else "unproven_full"
                self.dropped[full] += 1
                return Offer(False, lane_id, reason=full)
            displaced = (biggest, lane.pop_newest(biggest))  # the biggest holder's newest gives way
            self.dropped["displaced"] += 1
        lane.append(sender, next(self._seq), item)
        return Offer(True, lane_id, displaced=displaced)

    # ------------------------------------------------------------ out
    def take(self) -> Taken[T] | None:
        """The next item to work on, or None when nothing may be taken now."""
        proven, unproven = self._lanes[True], self._lanes[False]
        may_unproven = unproven.n > 0 and (self.unproven_slots is None or self._unproven_busy < self.unproven_slots)
        turn = self.unproven_every is not None and self._streak >= self.unproven_every - 1
        if may_unproven and (proven.n == 0 or turn):
            sender, item = unproven.pop_next()
            self._streak = 0
            self._unproven_busy += 1
            self.served["unproven"] += 1
            return Taken(sender, item, True)
        if proven.n:
            sender, item = proven.pop_next()
            if self.unproven_every is not None:
                self._streak = min(self._streak + 1, self.unproven_every - 1)
            self.served["proven"] += 1
            return Taken(sender, item, False)
        return None

    def done(self, taken: Taken[T]) -> None:
        """The work on ``taken`` is over (frees its unproven slot)."""
        if taken.unproven:
            self._unproven_busy -= 1

    def status(self) -> dict[str, Any]:
        return {
            "proven_queued": self._lanes[True].n,
            "unproven_queued": self._lanes[False].n,
            "unproven_announcers": len(self._lanes[False].by_sender),
            "proven_announcers": len(self._proven_peers),
            "served": dict(self.served),
            "dropped": dict(self.dropped),
        }


class FairQueue(FairLanes[T]):
    """:class:`FairLanes` with waiting: :meth:`get` waits for an item it may take, and
    :meth:`put` waits for room in a ``wait`` lane. Both are trio checkpoints and block on
    events, never poll."""

    def __init__(self, proven: LaneRules, unproven: LaneRules, **kw: Any) -> None:
        super().__init__(proven, unproven, **kw)
        self._changed = trio.Event()  # set when an item may have become takeable or room freed

    def _poke(self) -> None:
        self._changed.set()

    async def _wait_change(self) -> None:
        if self._changed.is_set():  # every waiter shares one event until it fires
            self._changed = trio.Event()
        await self._changed.wait()

    def offer(self, sender: str, item: T) -> Offer[T]:
        out = super().offer(sender, item)
        if out.queued:
            self._poke()
        return out

    async def put(self, sender: str, item: T) -> Offer[T]:
        """Offer ``item``, waiting while its lane is full and its rule is ``wait``."""
        await trio.lowlevel.checkpoint()
        while True:
            out = self.offer(sender, item)
            if out.reason != "wait":
                return out
            await self._wait_change()

    async def get(self) -> Taken[T]:
        """The next item to work on (waits while there is none it may take)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            out = self.take()
            if out is not None:
                self._poke()  # room in its lane
                await trio.lowlevel.cancel_shielded_checkpoint()
                return out
            await self._wait_change()

    def mark_proven(self, sender: str) -> None:
        super().mark_proven(sender)
        self._poke()

    def discard(self, sender: str, reason: str = "banned") -> list[T]:
        gone = super().discard(sender, reason)
        self._poke()
        return gone

    def done(self, taken: Taken[T]) -> None:
        super().done(taken)
        if taken.unproven:
            self._poke()
