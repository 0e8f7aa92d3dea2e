"""What every learning role shares: the checkpoint subsystem, policy weights by
version, honouring ban notices, fetching announced rollout batches (trainer and
validator) and running the policy in an inference engine (worker and validator)."""

from __future__ import annotations

import collections
import logging
from typing import Any

import trio

from node.checkpoints import Checkpoints, ChunkStore
from node.engines.base import InferenceEngine
from node.home import NodeHome
from node.memory import release_free_memory
from node.p2p.node import RoleHook
from node.p2p.reqresp import RequestError
from node.p2p.services import NodeServices
from node.roles.checkpoint_wiring import P2PControlPlane, checkpoint_heartbeat_fields, serve_checkpoints
from node.roles.context import RunContext
from node.roles.intake import ANNOUNCE_QUEUE, UNPROVEN_FETCH_SLOTS, AnnounceIntake
from node.roles.weights import WeightCache
from node.util import now_ms, thread_cpu
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
from protocol.committee import committee_order, committee_seed

log = logging.getLogger(__name__)

BAN_SECONDS_DEFAULT = 3600.0
UNSERVED_POINTS = 5.0  # per announced batch its announcer failed to serve (budget ~20)


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
        self.checkpoints_ready = trio.Event()  # set once start_common made them
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
        self._node: NodeServices | None = None  # set when the role starts (start_common)
        self.weights = WeightCache(self, capacity=g.max_async + 2)
        # announced batches on their way to being fetched (trainer and validator size their own)
        self.intake = AnnounceIntake(ANNOUNCE_QUEUE, UNPROVEN_FETCH_SLOTS)
        self.bans_honoured = 0

    @property
    def node(self) -> NodeServices:
        """The running node's services (:mod:`node.p2p.services`)."""
        if self._node is None:
            raise RuntimeError("the role has not started: its node is set by start_common")
        return self._node

    @node.setter
    def node(self, node: NodeServices) -> None:
        self._node = node

    async def start_common(self, node: NodeServices, nursery: trio.Nursery) -> None:
        self.node = node
        self.checkpoints = Checkpoints(self.store, P2PControlPlane(node), **self._checkpoints_args)
        self.checkpoints_ready.set()
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

    def committee_order(self, worker: str, version: int, counter: int) -> tuple[str, ...] | None:
        """The genesis validators in the order that verifies ``worker``'s batch ``counter`` at
        ``version`` (``protocol/committee.py``: the first ``committee_size`` are its committee),
        or None while this node does not hold the version's signed manifest (its root seeds
        the draw)."""
        st = self.store.versions.get(version)
        if st is None:
            return None
        g = self.ctx.genesis
        return committee_order(g.validators, committee_seed(g.run_id, worker, version, counter, st.manifest.root))

    @property
    def dropped_announces(self) -> int:
        """Announces not queued: per-announcer cap, full lane, or (trainer) nothing to fetch."""
        return self.intake.dropped

    # ------------------------------------------------------------ bans
    def _on_ban(self, env: Envelope) -> None:
        notice: BanNotice = env.body
        g = self.ctx.genesis
        if env.sender != g.trainer and env.sender not in g.validators:
            self.node.standing.penalise(env.sender, "unauthorised_ban")
            return
        if notice.peer_id in (self.node.peer_id, g.trainer):
            return  # never ban ourselves or the trainer on someone's word
        seconds = max(1.0, (notice.until_ms - now_ms()) / 1000)
        self.node.standing.ban(notice.peer_id, f"ban notice from {env.sender[:12]}: {notice.reason}", seconds)
        self.bans_honoured += 1

    async def publish_ban(self, peer_id: str, reason: str, seconds: float = BAN_SECONDS_DEFAULT) -> None:
        self.node.standing.ban(peer_id, reason, seconds)
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
        self.node.standing.penalise(sender, "batch_unserved", UNSERVED_POINTS)
        self.intake.queue.forget(sender)

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
            self.node.standing.penalise(announce.sender, exc.rule)
            raise
        self.intake.queue.mark_proven(announce.sender)
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
        # versions put into the engine: "in_place" (from the delta, or a chain of them, on the
        # loaded version) or "full" (every tensor from the version's files); status shows them
        self.policy_loads: collections.Counter[str] = collections.Counter()
        # CPU seconds of the threads that put versions into the engine (their own thread
        # time: the process's would count whatever else ran meanwhile, e.g. the checkpoints)
        self.load_cpu_s = 0.0

    def make_engine(self) -> InferenceEngine:
        """The role's engine on version 0 of the policy (blocking: run it in a thread)."""
        from node.roles.engines import build_engine

        return build_engine(self.ctx, self.engine_kind, self.device)

    async def load_policy(self, version: int) -> None:
        """Put the weights of ``version`` into the engine (building it first if needed), then hand
        the transient memory back (node/memory.py). The caller records ``loaded_version``.
        A version reached from the loaded one by deltas alone goes in place, only the tensors
        they change written (``Checkpoints.delta_changes``: one delta or a chain of them)."""
        engine = self.engine
        if engine is not None and self.checkpoints is not None:
            changes = await self.checkpoints.delta_changes(version, self.loaded_version, values=engine.delta_values)
            if changes is not None:
                with self.checkpoints.open_version(version) as files:
                    touched, cpu = await trio.to_thread.run_sync(thread_cpu, engine.load_delta, changes, files)
                self.load_cpu_s += cpu
                log.info(
                    "version %d loaded in place from version %d by deltas (%d tensors written)",
                    version,
                    self.loaded_version,
                    len(touched),
                )
                self.policy_loads["in_place"] += 1
                return
        state = await self.weights.get(version)
        if self.engine is None:
            self.engine = await trio.to_thread.run_sync(self.make_engine)
        _, cpu = await trio.to_thread.run_sync(thread_cpu, self.engine.load_weights, state)
        self.load_cpu_s += cpu
        self.policy_loads["full"] += 1
        await trio.to_thread.run_sync(release_free_memory)
