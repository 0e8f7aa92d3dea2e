"""The validator's verify queue: fetched batches waiting for their model prefill.

Why not a plain channel: a batch that passes every rule that needs no model still
costs a prefill to reject (``rollouts.verify_batch``). Anyone can make a fresh
identity, sign a well-formed batch of random tokens with proofs of the right size,
announce it and serve it when fetched; with first-come order a flood of such
batches from many identities sits in front of the honest ones, and the validator
is stalled at the price of a key pair per batch. The fetch stage
(``intake.AnnounceLanes``) cannot tell these apart: they are served.

So the queue ranks announcers by what only this validator can vouch for: a batch of
theirs that *it accepted*. See :class:`VerifyQueue`.
"""

from __future__ import annotations

import collections
from typing import Any, Generic, TypeVar

import trio

T = TypeVar("T")

# When batches of proven announcers are waiting, at most 1 in every UNPROVEN_EVERY
# verifications goes to an unproven one (so an honest batch waits for at most one
# prefill of garbage, not for the whole flood).
UNPROVEN_EVERY = 4
MAX_UNPROVEN = 16  # unproven batches queued in all; more are dropped (and counted)
MAX_UNPROVEN_PER_ANNOUNCER = 2  # ... and per unproven announcer (= the default ban_after_rejections)
PROVEN_CAPACITY = 64  # proven batches queued; beyond it ``put`` waits (back-pressure, nothing dropped)
REMEMBER_PROVEN = 4096  # proven announcers remembered (least recently accepted forgotten)


class VerifyQueue(Generic[T]):
    """Fetched batches waiting for verification, in two lanes.

    * **Proven** announcers (this validator accepted a batch of theirs, :meth:`mark_proven`)
      are served first-come, first-served. Their lane holds ``proven_capacity`` items;
      :meth:`put` waits for room beyond that, as the channel it replaces did.
    * **Unproven** announcers (everyone else: new honest workers, and every identity a
      flooder makes) share what is left: when proven batches wait, an unproven one is
      taken only after ``every - 1`` proven ones since the last unproven one (at most 1
      verification in ``every``); when none wait, unproven batches are verified at once
      (an idle validator is not held back, and a new worker can prove itself). Among
      unproven announcers the turn goes round-robin, one batch each, so a Sybil with
      many batches gets no more turns than a newcomer with one. The lane is bounded:
      ``max_unproven`` items in all, ``per_announcer`` per announcer; :meth:`put` never
      waits for it: an item beyond a bound is dropped and counted in ``dropped``
      (``"announcer_cap"``, ``"unproven_full"``), so a flood costs the validator queue
      slots it throws away, never a fetch task held or an honest batch delayed.

    An announcer loses its standing with :meth:`forget` (its batch broke a rule), and
    :meth:`discard` drops what a banned announcer still has queued. Items of an
    announcer that becomes proven while they wait move to the proven lane.

    :meth:`get` and :meth:`put` are trio checkpoints and block on events, never poll.
    """

    def __init__(
        self,
        *,
        proven_capacity: int = PROVEN_CAPACITY,
        max_unproven: int = MAX_UNPROVEN,
        per_announcer: int = MAX_UNPROVEN_PER_ANNOUNCER,
        every: int = UNPROVEN_EVERY,
        remember: int = REMEMBER_PROVEN,
    ) -> None:
        if min(proven_capacity, max_unproven, per_announcer, every, remember) < 1:
            raise ValueError("verify queue bounds must be positive")
        self.proven_capacity = proven_capacity
        self.max_unproven = max_unproven
        self.per_announcer = per_announcer
        self.every = every
        self.remember = remember
        self._proven_peers: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._proven: collections.deque[tuple[str, T]] = collections.deque()
        # unproven items per announcer; the dict's order is the round-robin order
        self._unproven: collections.OrderedDict[str, collections.deque[T]] = collections.OrderedDict()
        self._n_unproven = 0
        self._streak = 0  # proven items taken since the last unproven one (capped at every - 1)
        self._items = trio.Event()  # set when an item may have become available
        self._room = trio.Event()  # set when the proven lane may have room
        self.dropped: collections.Counter[str] = collections.Counter()
        self.served: collections.Counter[str] = collections.Counter()  # "proven" / "unproven"

    def __len__(self) -> int:
        return len(self._proven) + self._n_unproven

    # ------------------------------------------------------------ standing
    def proven(self, announcer: str) -> bool:
        return announcer in self._proven_peers

    def mark_proven(self, announcer: str) -> None:
        """This validator accepted a batch of ``announcer``: serve it first-come from now on."""
        self._proven_peers[announcer] = None
        self._proven_peers.move_to_end(announcer)
        while len(self._proven_peers) > self.remember:
            self._proven_peers.popitem(last=False)
        waiting = self._unproven.pop(announcer, None)
        if waiting:  # its batches queued before it proved itself
            self._n_unproven -= len(waiting)
            self._proven.extend((announcer, item) for item in waiting)
            self._items.set()

    def forget(self, announcer: str) -> None:
        """``announcer`` loses its standing (items already in the proven lane stay)."""
        self._proven_peers.pop(announcer, None)

    def discard(self, announcer: str, reason: str = "banned") -> int:
        """Drop everything ``announcer`` has queued (counted under ``reason``); returns how many."""
        n = 0
        waiting = self._unproven.pop(announcer, None)
        if waiting:
            n += len(waiting)
            self._n_unproven -= len(waiting)
        kept = [(a, item) for a, item in self._proven if a != announcer]
        if len(kept) != len(self._proven):
            n += len(self._proven) - len(kept)
            self._proven = collections.deque(kept)
            self._room.set()
        self.dropped[reason] += n
        return n

    # ------------------------------------------------------------ in
    async def put(self, announcer: str, item: T) -> bool:
        """Queue ``item`` of ``announcer``. A proven announcer's item waits for room; an
        unproven one's is queued at once or dropped: returns False when it was dropped."""
        await trio.lowlevel.checkpoint()
        while self.proven(announcer) and len(self._proven) >= self.proven_capacity:
            if self._room.is_set():
                self._room = trio.Event()
            await self._room.wait()
        if self.proven(announcer):
            self._proven.append((announcer, item))
            self._items.set()
            return True
        return self._put_unproven(announcer, item)

    def _put_unproven(self, announcer: str, item: T) -> bool:
        queued = self._unproven.get(announcer)
        if queued is not None and len(queued) >= self.per_announcer:
            self.dropped["announcer_cap"] += 1
            return False
        if self._n_unproven >= self.max_unproven:
            self.dropped["unproven_full"] += 1
            return False
        if queued is None:
            queued = self._unproven[announcer] = collections.deque()  # joins the end of the round
        queued.append(item)
        self._n_unproven += 1
        self._items.set()
        return True

    # ------------------------------------------------------------ out
    def _take(self) -> tuple[str, T] | None:
        unproven_turn = bool(self._unproven) and (not self._proven or self._streak >= self.every - 1)
        if unproven_turn:
            announcer, queued = next(iter(self._unproven.items()))
            item = queued.popleft()
            self._n_unproven -= 1
            if queued:
                self._unproven.move_to_end(announcer)  # next announcer's turn
            else:
                del self._unproven[announcer]
            self._streak = 0
            self.served["unproven"] += 1
            return announcer, item
        if self._proven:
            out = self._proven.popleft()
            self._streak = min(self._streak + 1, self.every - 1)
            self._room.set()
            self.served["proven"] += 1
            return out
        return None

    async def get(self) -> tuple[str, T]:
        """The next item to verify and its announcer (waits while the queue is empty)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            out = self._take()
            if out is not None:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return out
            if self._items.is_set():  # every waiter shares one event until it fires
                self._items = trio.Event()
            await self._items.wait()

    def status(self) -> dict[str, Any]:
        return {
            "proven_queued": len(self._proven),
            "unproven_queued": self._n_unproven,
            "unproven_announcers": len(self._unproven),
            "proven_announcers": len(self._proven_peers),
            "served": dict(self.served),
            "dropped": dict(self.dropped),
        }
