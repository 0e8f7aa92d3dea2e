"""Announced rollout batches on their way to being fetched (trainer and validator): the
per-announcer cap, the two-lane queue of proven and unproven announcers, the fetch tasks' loop."""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable

import trio

from protocol import Envelope

MAX_PENDING_PER_ANNOUNCER = 4  # announcements of one sender waiting in a fetch queue
ANNOUNCE_QUEUE = 256  # announced batches waiting to be fetched
FETCH_TASKS = 4  # concurrent batch fetches
UNPROVEN_FETCH_SLOTS = 2  # of those, at most this many for announcers with no batch served yet


class AnnounceIntake:
    """Announced rollout batches on their way to being fetched (trainer and validator): the
    per-announcer cap, the two-lane queue (:class:`AnnounceLanes`) and the fetch tasks' loop.

    Per-announcer fairness: at most ``MAX_PENDING_PER_ANNOUNCER`` of one sender's announces
    wait, so one identity cannot fill the queue; within a full lane a sender holding more
    than a newcomer gives one of its announces up to it (:meth:`AnnounceLanes.send_nowait`).
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
        self.lanes = AnnounceLanes(size, unproven_slots)
        self.pending: collections.Counter[str] = collections.Counter()  # queued announces per sender
        self.hold_while_fetching = hold_while_fetching
        self.on_evicted = on_evicted
        self.dropped = 0  # announces not queued, or displaced (see LearningRole.dropped_announces)
        self.displaced = 0  # of those, queued and then given up to a sender with a smaller share

    def __len__(self) -> int:
        return len(self.lanes)

    def offer(self, env: Envelope, *, count_drops: bool = True) -> bool:
        """Queue ``env`` for a fetch task; True when it was queued. False when its sender
        already has its share waiting or its lane is full of announces of senders holding no
        more than it would (counted in ``dropped`` unless ``count_drops`` is false)."""
        if self.pending[env.sender] >= MAX_PENDING_PER_ANNOUNCER:
            self.dropped += count_drops
            return False
        try:
            displaced = self.lanes.send_nowait(env)
        except trio.WouldBlock:
            self.dropped += count_drops  # bounded queue: shed load rather than grow without limit
            return False
        self.pending[env.sender] += 1
        if displaced is not None:
            self._release(displaced.sender)
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
            env, unproven = await self.lanes.receive()
            if not self.hold_while_fetching:
                self._release(env.sender)
            try:
                await handle(env)
            finally:
                self.lanes.done(unproven)
                if self.hold_while_fetching:
                    self._release(env.sender)


class AnnounceLanes:
    """The fetch queue of announced batches, in two lanes: announcers with a track record
    (a batch of theirs was fetched and matched its announcement) and everyone else.

    Fetch tasks take from the proven lane first, and at most ``unproven_slots`` of them
    work on unproven announcers at once, so identities that announce batches and never
    serve them (each holding a fetch for its whole timeout) cannot occupy every fetch
    task: workers that served before keep being fetched (bench/hostile.py "unserved").
    A proven announcer that later fails to serve loses its standing. Bounded: ``size``
    queued announces in all (half per lane, so unproven floods cannot crowd proven
    announcers out of the queue either), ``remember`` proven peers (least recently
    useful forgotten).

    Within a lane, shares are fair: when the lane is full, an announce from a sender that
    would hold fewer than the lane's biggest holder displaces that holder's newest
    announce. So a sender with announces waiting holds at least min(its announces, lane /
    senders) of them whatever others queue: one flooder (or a few) cannot keep a newcomer
    out, only as many identities as the lane has places, each holding one.
    """

    def __init__(self, size: int, unproven_slots: int, remember: int = 4096) -> None:
        self.size = size
        self.unproven_slots = unproven_slots
        self.remember = remember
        self._proven_peers: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._queues: dict[bool, collections.deque[Envelope]] = {True: collections.deque(), False: collections.deque()}
        self._held: dict[bool, collections.Counter[str]] = {True: collections.Counter(), False: collections.Counter()}
        self._unproven_busy = 0
        self._changed = trio.Event()

    def __len__(self) -> int:
        return len(self._queues[True]) + len(self._queues[False])

    def held(self, peer_id: str) -> int:
        """Announces of ``peer_id`` waiting in either lane."""
        return self._held[True][peer_id] + self._held[False][peer_id]

    def proven(self, peer_id: str) -> bool:
        return peer_id in self._proven_peers

    def mark_served(self, peer_id: str) -> None:
        self._proven_peers[peer_id] = None
        self._proven_peers.move_to_end(peer_id)
        while len(self._proven_peers) > self.remember:
            self._proven_peers.popitem(last=False)

    def mark_unserved(self, peer_id: str) -> None:
        self._proven_peers.pop(peer_id, None)

    def _capacity(self, lane: bool) -> int:
        return self.size - self.size // 2 if lane else self.size // 2

    def _append(self, lane: bool, env: Envelope) -> None:
        self._queues[lane].append(env)
        self._held[lane][env.sender] += 1

    def _drop_count(self, lane: bool, sender: str) -> None:
        held = self._held[lane]
        held[sender] -= 1
        if held[sender] <= 0:
            del held[sender]

    def send_nowait(self, env: Envelope) -> Envelope | None:
        """Queue an announce; returns the announce it displaced (see the class docstring), if
        any. Raises trio.WouldBlock when its lane is full of announces of senders that hold
        no more than its sender would. Each lane holds half of ``size``, so a flood of
        unproven announces never crowds out proven ones."""
        lane = self.proven(env.sender)
        displaced = None
        if len(self._queues[lane]) >= self._capacity(lane):
            held = self._held[lane]
            biggest, n = max(held.items(), key=lambda item: item[1])
            if n <= held[env.sender] + 1:
                raise trio.WouldBlock
            queue = self._queues[lane]
            for i in range(len(queue) - 1, -1, -1):  # the biggest holder's newest announce gives way
                if queue[i].sender == biggest:
                    displaced = queue[i]
                    del queue[i]
                    break
            assert displaced is not None
            self._drop_count(lane, biggest)
        self._append(lane, env)
        self._changed.set()
        return displaced

    def _promote(self) -> None:
        """Announces queued before their sender proved itself move to the proven lane."""
        unproven = self._queues[False]
        if any(self.proven(e.sender) for e in unproven):
            keep: collections.deque[Envelope] = collections.deque()
            for e in unproven:
                if self.proven(e.sender):
                    self._append(True, e)
                    self._drop_count(False, e.sender)
                else:
                    keep.append(e)
            self._queues[False] = keep

    def _pop(self, lane: bool) -> Envelope:
        env = self._queues[lane].popleft()
        self._drop_count(lane, env.sender)
        return env

    async def receive(self) -> tuple[Envelope, bool]:
        """The next announce to fetch and whether it came from the unproven lane; pass the
        flag to :meth:`done` when the fetch is over."""
        while True:
            self._promote()
            if self._queues[True]:
                return self._pop(True), False
            if self._queues[False] and self._unproven_busy < self.unproven_slots:
                self._unproven_busy += 1
                return self._pop(False), True
            if self._changed.is_set():  # every waiter shares one event until it fires
                self._changed = trio.Event()
            await self._changed.wait()

    def done(self, unproven: bool) -> None:
        if unproven:
            self._unproven_busy -= 1
            self._changed.set()
