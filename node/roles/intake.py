"""What the learning roles take in from strangers, each through the one fair queue
(:mod:`node.roles.fair_queue`): announced rollout batches on their way to being fetched
(trainer and validator: the per-announcer cap, :func:`announce_queue`, the fetch tasks'
loop) and fetched batches waiting for the validator's prefill (:func:`verify_queue`)."""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable
from typing import TypeVar

from node.roles.fair_queue import FairQueue, LaneRules, Taken
from protocol import Envelope

T = TypeVar("T")

MAX_PENDING_PER_ANNOUNCER = 4  # announcements of one sender waiting in a fetch queue
ANNOUNCE_QUEUE = 256  # announced batches waiting to be fetched
FETCH_TASKS = 4  # concurrent batch fetches
UNPROVEN_FETCH_SLOTS = 2  # of those, at most this many for announcers with no batch served yet

# The verify queue. When batches of proven announcers are waiting, at most 1 in every
# UNPROVEN_EVERY verifications goes to an unproven one (so an honest batch waits for at most
# one prefill of garbage, not for the whole flood).
UNPROVEN_EVERY = 4
MAX_UNPROVEN = 16  # unproven batches queued in all; more are dropped (and counted)
MAX_UNPROVEN_PER_ANNOUNCER = 2  # ... and per unproven announcer (= the default ban_after_rejections)
PROVEN_CAPACITY = 64  # proven batches queued; beyond it ``put`` waits (back-pressure, nothing dropped)
REMEMBER_PROVEN = 4096  # proven announcers remembered (least recently accepted forgotten)


class AnnounceIntake:
    """Announced rollout batches on their way to being fetched (trainer and validator): the
    per-announcer cap, the fair queue (:func:`announce_queue`) and the fetch tasks' loop.

    Per-announcer fairness: at most ``MAX_PENDING_PER_ANNOUNCER`` of one sender's announces
    wait, so one identity cannot fill the queue; within a full lane a sender holding more
    than a newcomer gives one of its announces up to it (``displace``,
    :class:`node.roles.fair_queue.FairQueue`).
    ``hold_while_fetching`` keeps an announce counted against its sender until its fetch is
    over (the trainer: a slow announcer holds its own share, not a fetch task more), else
    until a fetch task takes it (the validator).

    :meth:`offer` says whether the announce was queued; a role marks an announce seen (and
    ignores repeats of it) only then, and forgets it again in ``on_evicted`` when a fairer
    sender displaced it, so an announce shed while the lane was full gets in when it is
    announced again (workers re-announce undecided batches, ``worker.py``).
    """

    def __init__(
        self,
        size: int,
        unproven_slots: int,
        *,
        hold_while_fetching: bool = False,
        on_evicted: Callable[[Envelope], None] | None = None,
    ) -> None:
        self.queue: FairQueue[Envelope] = announce_queue(size, unproven_slots)
        self.pending: collections.Counter[str] = collections.Counter()  # queued announces per sender
        self.hold_while_fetching = hold_while_fetching
        self.on_evicted = on_evicted
        self.dropped = 0  # announces not queued, or displaced (see LearningRole.dropped_announces)
        self.displaced = 0  # of those, queued and then given up to a sender with a smaller share

    def __len__(self) -> int:
        return len(self.queue)

    def offer(self, env: Envelope, *, count_drops: bool = True) -> bool:
        """Queue ``env`` for a fetch task; True when it was queued. False when its sender
        already has its share waiting or its lane is full of announces of senders holding no
        more than it would (counted in ``dropped`` unless ``count_drops`` is false)."""
        if self.pending[env.sender] >= MAX_PENDING_PER_ANNOUNCER:
            self.dropped += count_drops
            return False
        out = self.queue.offer(env.sender, env)
        if not out.queued:
            self.dropped += count_drops  # bounded queue: shed load rather than grow without limit
            return False
        self.pending[env.sender] += 1
        if out.displaced is not None:
            sender, displaced = out.displaced
            self._release(sender)
            self.dropped += 1
            self.displaced += 1
            if self.on_evicted is not None:
                self.on_evicted(displaced)
        return True

    def _release(self, sender: str) -> None:
        self.pending[sender] -= 1
        if self.pending[sender] <= 0:
            del self.pending[sender]

    async def fetch_loop(self, handle: Callable[[Envelope], Awaitable[None]]) -> None:
        """One fetch task: take the next announce and ``await handle(env)``, forever."""
        while True:
            taken: Taken[Envelope] = await self.queue.get()
            env = taken.item
            if not self.hold_while_fetching:
                self._release(env.sender)
            try:
                await handle(env)
            finally:
                self.queue.done(taken)
                if self.hold_while_fetching:
                    self._release(env.sender)


def announce_queue(size: int, unproven_slots: int, remember: int = REMEMBER_PROVEN) -> FairQueue[Envelope]:
    """The fetch queue of announced batches: announcers with a track record (a batch of
    theirs was fetched and matched its announcement: ``mark_proven``) and everyone else.

    Fetch tasks take from the proven lane first, and at most ``unproven_slots`` of them
    work on unproven announcers at once, so identities that announce batches and never
    serve them (each holding a fetch for its whole timeout) cannot occupy every fetch
    task: workers that served before keep being fetched (bench/hostile.py "unserved").
    A proven announcer that later fails to serve loses its standing (``forget``). Bounded:
    ``size`` queued announces in all (half per lane, so unproven floods cannot crowd
    proven announcers out of the queue either), ``remember`` proven peers (least recently
    useful forgotten). Both lanes first-come, and fair when full (``displace``)."""
    return FairQueue(
        LaneRules(size - size // 2, "displace", "fifo"),
        LaneRules(size // 2, "displace", "fifo"),
        unproven_slots=unproven_slots,
        remember=remember,
    )


def verify_queue(
    *,
    proven_capacity: int = PROVEN_CAPACITY,
    max_unproven: int = MAX_UNPROVEN,
    per_announcer: int = MAX_UNPROVEN_PER_ANNOUNCER,
    every: int = UNPROVEN_EVERY,
    remember: int = REMEMBER_PROVEN,
) -> FairQueue[T]:
    """The validator's verify queue: fetched batches waiting for their model prefill.

    Why not a plain channel: a batch that passes every rule that needs no model still costs a
    prefill to reject (``rollouts.verify_batch``). Anyone can make a fresh identity, sign a
    well-formed batch of random tokens with proofs of the right size, announce it and serve
    it when fetched; with first-come order a flood of such batches from many identities sits
    in front of the honest ones, and the validator is stalled at the price of a key pair per
    batch. The fetch stage (:func:`announce_queue`) cannot tell these apart: they are served.
    So this queue ranks announcers by what only this validator can vouch for: a batch of
    theirs that *it accepted* (``mark_proven``).

    * **Proven** announcers are served first-come. Their lane holds ``proven_capacity``
      items; ``put`` waits for room beyond that (``wait``), as the channel it replaced did.
    * **Unproven** announcers (new honest workers, and every identity a flooder makes) share
      what is left: when proven batches wait, an unproven one is taken only after
      ``every - 1`` proven ones since the last (at most 1 verification in ``every``); when
      none wait, unproven batches are verified at once (an idle validator is not held back,
      and a new worker can prove itself). The turn goes round-robin, one batch each, so a
      Sybil with many batches gets no more turns than a newcomer with one. Bounded:
      ``max_unproven`` items in all, ``per_announcer`` each; an item beyond a bound is
      dropped and counted (``refuse``: "announcer_cap", "unproven_full"), so a flood costs
      the validator queue slots it throws away, never a fetch task held or an honest batch
      delayed.

    An announcer loses its standing with ``forget`` (its batch broke a rule), and
    ``discard`` drops what a banned announcer still has queued.
    """
    return FairQueue(
        LaneRules(proven_capacity, "wait", "fifo"),
        LaneRules(max_unproven, "refuse", "round_robin", per_sender=per_announcer),
        unproven_every=every,
        remember=remember,
    )
