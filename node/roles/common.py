"""What every learning role shares: the checkpoint subsystem, policy weights by
version, honouring ban notices, fetching announced rollout batches (trainer and
validator) and running the policy in an inference engine (worker and validator)."""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from node.checkpoints import Checkpoints, ChunkStore
from node.engines.base import InferenceEngine
from node.home import NodeHome
from node.memory import release_free_memory
from node.p2p.node import RoleHook
from node.p2p.reqresp import RequestError
from node.roles.checkpoint_wiring import P2POverlay, checkpoint_heartbeat_fields, serve_checkpoints
from node.roles.context import RunContext
from node.util import now_ms
from protocol import (
    BanNotice,
    BatchRequest,
    BatchResponse,
    Envelope,
    ProtocolError,
    RolloutAnnounce,
    RolloutBatch,
    open_announced_batch,
)

log = logging.getLogger(__name__)

BAN_SECONDS_DEFAULT = 3600.0
MAX_PENDING_PER_ANNOUNCER = 4  # announcements of one sender waiting in a fetch queue
UNSERVED_POINTS = 5.0  # per announced batch its announcer failed to serve (budget ~20)
ANNOUNCE_QUEUE = 256  # announced batches waiting to be fetched
FETCH_TASKS = 4  # concurrent batch fetches
UNPROVEN_FETCH_SLOTS = 2  # of those, at most this many for announcers with no batch served yet


class LearningRole(RoleHook):
    """Base of trainer, worker and validator: owns the node's checkpoint subsystem."""

    def __init__(
        self,
        home: NodeHome,
        ctx: RunContext,
        *,
        max_upload_mbps: float = 0.0,
        data_port: int = 0,
        advertise_host: str = "127.0.0.1",
        direct_io: bool = True,
    ) -> None:
        self.home = home
        self.ctx = ctx
        g = ctx.genesis
        self.store = ChunkStore(home.chunks_dir, g.run_id, g.trainer, direct_io=direct_io)
        if ctx.pinned_model:
            self.store.keep.add(0)  # the pinned model: every node that holds it seeds it to late joiners
        self.checkpoints: Checkpoints | None = None
        # The data plane listens where peers can reach it: loopback for a one-machine
        # network, every interface when the node advertises a routable address.
        listen_host = "127.0.0.1" if advertise_host.startswith("127.") or advertise_host == "localhost" else "0.0.0.0"
        self._checkpoints_args: dict[str, Any] = dict(
            max_async=g.max_async,
            data_port=data_port,
            advertise_host=advertise_host,
            listen_host=listen_host,
            max_upload_mbps=max_upload_mbps,
        )
        self.node: Any = None
        self.weights = WeightCache(self, capacity=g.max_async + 2)
        # announced batches on their way to being fetched (trainer and validator size their own)
        self.intake = AnnounceIntake(ANNOUNCE_QUEUE, UNPROVEN_FETCH_SLOTS)
        self.bans_honoured = 0

    async def start_common(self, node: Any, nursery: trio.Nursery) -> None:
        self.node = node
        self.checkpoints = Checkpoints(self.store, P2POverlay(node), **self._checkpoints_args)
        await nursery.start(serve_checkpoints, node, self.checkpoints)
        node.gossip.on("ban", self._on_ban)
        if not self.ctx.model_ready:
            await self.fetch_pinned_model()

    async def fetch_pinned_model(self) -> None:
        """A node without the genesis's pinned model fetches version 0 from the swarm (weights,
        config, tokenizer), checks its manifest and then every byte against the genesis's
        ``model_root``, and keeps the files as its model folder (``RunContext.adopt_model_files``).
        (The trainer never gets here: version 0 starts with it, so it refuses to start without
        the files, see ``TrainerRole``.)"""
        from node.errors import ModelError
        from protocol import check_initial_manifest

        g = self.ctx.genesis
        checkpoints = self.checkpoints
        assert checkpoints is not None
        log.info("waiting for version 0 (the run's model, content root %s) from the swarm", g.model_root.hex()[:16])
        await checkpoints.wait_announced(0)  # the trainer re-announces it for late joiners
        st = self.store.get(0)
        assert st is not None
        try:  # the manifest first: never download a model the genesis does not pin
            check_initial_manifest(g, st.manifest)
        except ProtocolError as exc:
            raise ModelError(f"version 0 from the trainer is not the model the genesis pins: {exc.detail}") from None
        checkpoints.want_version(0)  # also when newer versions exist (a late joiner)
        await checkpoints.wait_assembled(0)
        with checkpoints.open_version(0) as files:
            await trio.to_thread.run_sync(self.ctx.adopt_model_files, files)
        log.info("version 0 verified against the genesis: model folder %s", self.ctx.model_dir)

    def heartbeat_fields(self) -> dict[str, Any]:
        return checkpoint_heartbeat_fields(self.checkpoints) if self.checkpoints is not None else {}

    def checkpoints_status(self) -> dict[str, Any]:
        return self.checkpoints.status() if self.checkpoints is not None else {}

    @property
    def dropped_announces(self) -> int:
        """Announces not queued: per-announcer cap, full lane, or (trainer) nothing to fetch."""
        return self.intake.dropped

    # ------------------------------------------------------------ bans
    def _on_ban(self, env: Envelope) -> None:
        notice: BanNotice = env.body
        g = self.ctx.genesis
        if env.sender != g.trainer and env.sender not in g.validators:
            self.node.policy.penalise(env.sender, "unauthorised_ban")
            return
        if notice.peer_id in (self.node.peer_id, g.trainer):
            return  # never ban ourselves or the trainer on someone's word
        seconds = max(1.0, (notice.until_ms - now_ms()) / 1000)
        self.node.policy.ban(notice.peer_id, f"ban notice from {env.sender[:12]}: {notice.reason}", seconds)
        self.bans_honoured += 1

    async def publish_ban(self, peer_id: str, reason: str, seconds: float = BAN_SECONDS_DEFAULT) -> None:
        self.node.policy.ban(peer_id, reason, seconds)
        await self.node.gossip.publish(
            BanNotice(peer_id=peer_id, reason=reason[:256], until_ms=now_ms() + int(seconds * 1000))
        )

    # ------------------------------------------------------------ batches
    async def _fetch_loop(self) -> None:
        """One fetch task of the announce intake (the role starts as many as it fetches at once)."""
        await self.intake.fetch_loop(self._fetch_one)

    async def _fetch_one(self, env: Envelope) -> None:
        """What the role does with a queued announce (trainer and validator)."""
        raise NotImplementedError

    def charge_unserved(self, sender: str, exc: Exception) -> None:
        """An announcer that does not serve its batch (timeout, unreachable, not found) is
        charged: a few failures ban it, so announcing batches one never serves stops costing
        fetchers time (see docs/security.md)."""
        self.node.policy.penalise(sender, "batch_unserved", UNSERVED_POINTS)
        self.intake.lanes.mark_unserved(sender)

    async def fetch_batch(self, announce: Envelope, timeout: float = 30.0) -> tuple[bytes, RolloutBatch]:
        """Fetch an announced batch from its announcer and check it is the announcer's own
        (``protocol.open_announced_batch``: the announced hash, signed by the announcer, the
        worker field, the announced version, counter and size).

        Raises RequestError (network) or ProtocolError (bad bytes: the announcer is charged,
        whoever signed what it served; a thief serving someone else's batch pays, never its
        signer)."""
        ann: RolloutAnnounce = announce.body
        env = await self.node.reqresp.request(
            announce.sender, BatchRequest(batch_id=ann.batch_id), BatchResponse, timeout=timeout, redial=True
        )
        resp: BatchResponse = env.body
        if not resp.found:
            raise RequestError("not_found", "the announcer no longer holds the batch")
        raw = resp.envelope
        try:
            batch = open_announced_batch(raw, announcer=announce.sender, announce=ann, run_id=self.ctx.genesis.run_id)
        except ProtocolError as exc:
            self.node.policy.penalise(announce.sender, exc.rule)
            raise
        self.intake.lanes.mark_served(announce.sender)
        return raw, batch


class EngineRole(LearningRole):
    """Base of worker and validator: runs the policy in an inference engine (``--engine``),
    built on first use and reloaded in place with each policy version it needs."""

    def __init__(self, *args: Any, device: str = "cpu", engine: str = "transformers", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine_kind = engine
        self.device = device
        self.engine: InferenceEngine | None = None
        self.loaded_version = -1

    def make_engine(self) -> InferenceEngine:
        """The role's engine on version 0 of the policy (blocking: run it in a thread)."""
        from node.roles.engines import build_engine

        return build_engine(self.ctx, self.engine_kind, self.device)

    async def load_policy(self, version: int) -> None:
        """Put the weights of ``version`` into the engine (building it first if needed), then hand
        the transient memory back (node/memory.py). The caller records ``loaded_version``.
        A delta version on the loaded one goes in place, only its changed elements written."""
        engine = self.engine
        if engine is not None and self.checkpoints is not None:
            changes = await self.checkpoints.delta_changes(version, self.loaded_version, values=engine.delta_values)
            if changes is not None:
                with self.checkpoints.open_version(version) as files:
                    touched = await trio.to_thread.run_sync(engine.load_delta, changes, files)
                log.info("version %d loaded in place from its delta (%d tensors written)", version, len(touched))
                return
        state = await self.weights.get(version)
        if self.engine is None:
            self.engine = await trio.to_thread.run_sync(self.make_engine)
        await trio.to_thread.run_sync(self.engine.load_weights, state)
        await trio.to_thread.run_sync(release_free_memory)


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


class WeightCache:
    """Policy weights (state dicts) by version, loaded from the assembled checkpoint files."""

    def __init__(self, role: LearningRole, capacity: int) -> None:
        self.role = role
        self.capacity = capacity
        self._cache: collections.OrderedDict[int, dict] = collections.OrderedDict()
        self._loading: dict[int, trio.Event] = {}  # versions being read right now

    def held(self, version: int) -> bool:
        st = self.role.store.get(version)
        return version in self._cache or (st is not None and st.assembled)

    async def get(self, version: int) -> dict:
        while version in self._loading:  # another task is reading it (a worker's read-ahead): share
            await self._loading[version].wait()
        if version in self._cache:
            self._cache.move_to_end(version)
            return self._cache[version]
        done = self._loading[version] = trio.Event()
        checkpoints = self.role.checkpoints
        assert checkpoints is not None, "the role has not started"
        try:
            with checkpoints.open_version(version) as files:
                state = await trio.to_thread.run_sync(load_state_dict, files)
        finally:
            del self._loading[version]
            done.set()
        self._cache[version] = state
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return state


def load_state_dict(files: dict[str, Path]) -> dict:
    from safetensors.torch import load_file

    state: dict = {}
    for name, path in sorted(files.items()):
        if name.endswith(".safetensors"):
            state.update(load_file(str(path)))
    if not state:
        raise RuntimeError("checkpoint holds no safetensors files")
    return state


def export_weights(model, out_dir: Path, dtype: Any = None) -> Path:
    """Write only what workers need (safetensors weights + config), never optimizer state.
    ``dtype`` (the run's policy dtype, a ``torch.dtype``): floating-point tensors are published
    in it, whatever the trainer's master weights are (fp32); None keeps them as they are."""
    import shutil

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no tqdm bars in node logs
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    state = None
    if dtype is not None and any(p.dtype != dtype for p in model.parameters()):
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    model.save_pretrained(tmp, safe_serialization=True, state_dict=state)
    if state is not None:  # config.json names the dtype the weights are in
        import json

        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["torch_dtype" if "torch_dtype" in cfg else "dtype"] = str(dtype).removeprefix("torch.")
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir
