"""What every learning role shares: the checkpoint distribution, policy weights by
version, honouring ban notices, and fetching announced rollout batches."""

from __future__ import annotations

import collections
import logging
import time
from pathlib import Path
from typing import Any

import trio

from node.checkpoints import Checkpoints, ChunkStore
from node.checkpoints.p2p_overlay import P2POverlay, distribution_heartbeat_fields, serve_distribution
from node.home import NodeHome
from node.p2p.node import RoleHook
from node.p2p.reqresp import RequestError
from node.roles.context import RunContext
from protocol import (
    BanNotice,
    BatchRequest,
    BatchResponse,
    Envelope,
    ProtocolError,
    RolloutAnnounce,
    RolloutBatch,
    open_envelope,
    sha256,
)

log = logging.getLogger("primenode.roles")

BAN_SECONDS_DEFAULT = 3600.0
MAX_PENDING_PER_ANNOUNCER = 4  # announcements of one sender waiting in a fetch queue
UNSERVED_POINTS = 5.0  # per announced batch its announcer failed to serve (budget ~20)
ANNOUNCE_QUEUE = 256  # announced batches waiting to be fetched
FETCH_TASKS = 4  # concurrent batch fetches
UNPROVEN_FETCH_SLOTS = 2  # of those, at most this many for announcers with no batch served yet


class LearningRole(RoleHook):
    """Base of trainer, worker and validator: owns the node's checkpoint distribution."""

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
        self.dist: Checkpoints | None = None
        # The data plane listens where peers can reach it: loopback for a one-machine
        # network, every interface when the node advertises a routable address.
        listen_host = "127.0.0.1" if advertise_host.startswith("127.") or advertise_host == "localhost" else "0.0.0.0"
        self._dist_args = dict(
            max_async=g.max_async,
            data_port=data_port,
            advertise_host=advertise_host,
            listen_host=listen_host,
            max_upload_mbps=max_upload_mbps,
        )
        self.node: Any = None
        self.weights = WeightCache(self, capacity=g.max_async + 2)
        # fetch queue of announced batches (validator, trainer); see AnnounceLanes
        self.lanes = AnnounceLanes(size=ANNOUNCE_QUEUE, unproven_slots=UNPROVEN_FETCH_SLOTS)
        self.bans_honoured = 0

    async def start_common(self, node, nursery: trio.Nursery) -> None:
        self.node = node
        self.dist = Checkpoints(self.store, P2POverlay(node), **self._dist_args)
        await nursery.start(serve_distribution, node, self.dist)
        node.gossip.on("ban", self._on_ban)

    def heartbeat_fields(self) -> dict[str, Any]:
        return distribution_heartbeat_fields(self.dist) if self.dist is not None else {}

    def distribution_status(self) -> dict[str, Any]:
        return self.dist.status() if self.dist is not None else {}

    # ------------------------------------------------------------ bans
    def _on_ban(self, env: Envelope) -> None:
        notice: BanNotice = env.body
        g = self.ctx.genesis
        if env.sender != g.trainer and env.sender not in g.validators:
            self.node.policy.penalise(env.sender, "unauthorised_ban")
            return
        if notice.peer_id in (self.node.peer_id, g.trainer):
            return  # never ban ourselves or the trainer on someone's word
        seconds = max(1.0, (notice.until_ms - time.time() * 1000) / 1000)
        self.node.policy.ban(notice.peer_id, f"ban notice from {env.sender[:12]}: {notice.reason}", seconds)
        self.bans_honoured += 1

    async def publish_ban(self, peer_id: str, reason: str, seconds: float = BAN_SECONDS_DEFAULT) -> None:
        self.node.policy.ban(peer_id, reason, seconds)
        await self.node.gossip.publish(
            BanNotice(peer_id=peer_id, reason=reason[:256], until_ms=int((time.time() + seconds) * 1000))
        )

    # ------------------------------------------------------------ batches
    def admit_announce(self, pending: collections.Counter[str], sender: str) -> bool:
        """Per-announcer fairness: at most ``MAX_PENDING_PER_ANNOUNCER`` of one sender's
        announcements wait in a fetch queue, so one identity cannot fill it."""
        if pending[sender] >= MAX_PENDING_PER_ANNOUNCER:
            return False
        pending[sender] += 1
        return True

    @staticmethod
    def release_announce(pending: collections.Counter[str], sender: str) -> None:
        pending[sender] -= 1
        if pending[sender] <= 0:
            del pending[sender]

    def charge_unserved(self, sender: str, exc: Exception) -> None:
        """An announcer that does not serve its batch (timeout, unreachable, not found) is
        charged: a few failures ban it, so announcing batches one never serves stops costing
        fetchers time (see docs/security.md)."""
        self.node.policy.penalise(sender, "batch_unserved", UNSERVED_POINTS)
        self.lanes.mark_unserved(sender)

    async def fetch_batch(self, announce: Envelope, timeout: float = 30.0) -> tuple[bytes, RolloutBatch]:
        """Fetch an announced batch from its announcer and check it against the announced hash.

        Raises RequestError (network) or ProtocolError (bad bytes; the peer is charged)."""
        ann: RolloutAnnounce = announce.body
        env = await self.node.reqresp.request(
            announce.sender, BatchRequest(batch_id=ann.batch_id), BatchResponse, timeout=timeout, redial=True
        )
        resp: BatchResponse = env.body
        if not resp.found:
            raise RequestError("not_found", "the announcer no longer holds the batch")
        raw = resp.envelope
        if sha256(raw) != ann.batch_id:
            self.node.policy.penalise(announce.sender, "batch_hash")
            raise ProtocolError("batch_hash", "batch bytes do not match the announced hash")
        inner = open_envelope(
            raw,
            run_id=self.ctx.genesis.run_id,
            now_ms=int(time.time() * 1000),
            guard=None,
            allowed_types={RolloutBatch.TYPE_ID},
        )
        if inner.sender != announce.sender:
            self.node.policy.penalise(announce.sender, "batch_sender")
            raise ProtocolError("batch_sender", "batch signed by another peer than its announcer")
        batch: RolloutBatch = inner.body
        if (batch.policy_version, batch.batch_counter, len(batch.samples)) != (
            ann.policy_version,
            ann.batch_counter,
            ann.num_samples,
        ):
            self.node.policy.penalise(announce.sender, "batch_mismatch")
            raise ProtocolError("batch_mismatch", "batch does not match its announcement")
        self.lanes.mark_served(announce.sender)
        return raw, batch


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
    """

    def __init__(self, size: int, unproven_slots: int, remember: int = 4096) -> None:
        self.size = size
        self.unproven_slots = unproven_slots
        self.remember = remember
        self._proven_peers: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._queues: dict[bool, collections.deque[Envelope]] = {True: collections.deque(), False: collections.deque()}
        self._unproven_busy = 0
        self._changed = trio.Event()

    def __len__(self) -> int:
        return len(self._queues[True]) + len(self._queues[False])

    def proven(self, peer_id: str) -> bool:
        return peer_id in self._proven_peers

    def mark_served(self, peer_id: str) -> None:
        self._proven_peers[peer_id] = None
        self._proven_peers.move_to_end(peer_id)
        while len(self._proven_peers) > self.remember:
            self._proven_peers.popitem(last=False)

    def mark_unserved(self, peer_id: str) -> None:
        self._proven_peers.pop(peer_id, None)

    def send_nowait(self, env: Envelope) -> None:
        """Queue an announce; raises trio.WouldBlock when its lane is full. Each lane holds
        half of ``size``, so a flood of unproven announces never crowds out proven ones."""
        lane = self.proven(env.sender)
        if len(self._queues[lane]) >= (self.size - self.size // 2 if lane else self.size // 2):
            raise trio.WouldBlock
        self._queues[lane].append(env)
        self._changed.set()

    def _promote(self) -> None:
        """Announces queued before their sender proved itself move to the proven lane."""
        unproven = self._queues[False]
        if any(self.proven(e.sender) for e in unproven):
            keep = collections.deque()
            for e in unproven:
                (self._queues[True] if self.proven(e.sender) else keep).append(e)
            self._queues[False] = keep

    async def receive(self) -> tuple[Envelope, bool]:
        """The next announce to fetch and whether it came from the unproven lane; pass the
        flag to :meth:`done` when the fetch is over."""
        while True:
            self._promote()
            if self._queues[True]:
                return self._queues[True].popleft(), False
            if self._queues[False] and self._unproven_busy < self.unproven_slots:
                self._unproven_busy += 1
                return self._queues[False].popleft(), True
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
        try:
            with self.role.dist.open_version(version) as files:
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


def export_weights(model, out_dir: Path) -> Path:
    """Write only what workers need (safetensors weights + config), never optimizer state."""
    import shutil

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no tqdm bars in node logs
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir
