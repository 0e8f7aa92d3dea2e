"""The worker: fetch the newest policy, generate the owed rollouts with proofs, sign,
announce, serve. Permissionless: it trusts only the trainer-signed manifest."""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import trio

from protocol import BatchRequest, BatchResponse, Envelope, RolloutAnnounce, seal, sha256

from ..memory import release_free_memory
from .common import LearningRole
from .rollouts import produce_batch

log = logging.getLogger("primenode.worker")

TAMPER_MODES = ("weights", "tokens", "prompts", "rewards")


class WorkerRole(LearningRole):
    role = "worker"

    def __init__(self, *args: Any, tamper: str | None = None, device: str = "cpu", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if tamper is not None and tamper not in TAMPER_MODES:
            raise ValueError(f"unknown tamper mode {tamper!r}")
        self.tamper = tamper
        self.device = device
        self.per_version = int(self.ctx.config.get("worker_batches_per_version", 2))
        # With no new version for this long (trainer restarting, batches lost with it), the
        # worker produces one more batch for the version it holds instead of idling forever.
        self.idle_s = float(self.ctx.config.get("worker_idle_s", 20.0))
        self.allowance: collections.Counter[int] = collections.Counter()
        self.batches: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self.keep_batches = 64
        self.produced: collections.Counter[int] = collections.Counter()
        self.loaded_version = -1
        self.engine: Any = None
        self.stats = {"batches_produced": 0, "batches_accepted": 0, "batches_rejected": 0, "batches_served": 0,
                      "generate_s": 0.0}
        self._my_batches: set[bytes] = set()
        self._voted: dict[bytes, set[str]] = {}

    async def run(self, node) -> None:
        async with trio.open_nursery() as nursery:
            await self.start_common(node, nursery)
            node.reqresp.register(BatchRequest, self._serve_batch)
            node.gossip.on("vote", self._on_vote)
            nursery.start_soon(self._loop)

    def _serve_batch(self, env: Envelope, peer: str) -> BatchResponse:
        raw = self.batches.get(env.body.batch_id)
        if raw is not None:
            self.stats["batches_served"] += 1
        return BatchResponse(found=raw is not None, envelope=raw or b"")

    def _on_vote(self, env: Envelope) -> None:
        vote = env.body
        if vote.batch_id not in self._my_batches or env.sender not in self.ctx.genesis.validators:
            return
        seen = self._voted.setdefault(vote.batch_id, set())
        if env.sender in seen:
            return
        seen.add(env.sender)
        self.stats["batches_accepted" if vote.accept else "batches_rejected"] += 1

    async def _load(self, version: int) -> None:
        state = await self.weights.get(version)
        if self.engine is None:
            self.engine = await trio.to_thread.run_sync(self._make_engine)
        await trio.to_thread.run_sync(self.engine.load_weights, state)
        await trio.to_thread.run_sync(release_free_memory)
        if self.tamper == "weights":
            await trio.to_thread.run_sync(_perturb, self.engine.model, 0.1)
        self.loaded_version = version
        log.info("worker loaded policy version %d", version)

    def _make_engine(self):
        from ..engines.transformers_engine import TransformersEngine

        engine = TransformersEngine(self.ctx.initial_model(), device=self.device,
                                    eos_token_id=self.ctx.eos_token_id, pad_token_id=self.ctx.pad_token_id)
        self.ctx.check_engine(engine)
        return engine

    async def _loop(self) -> None:
        node = self.node
        g = self.ctx.genesis
        while True:
            newest = await self.dist.wait_version(0)
            if newest != self.loaded_version:
                await self._load(newest)  # hot reload between batches; the next version keeps fetching meanwhile
            version = self.loaded_version
            if self.produced[version] >= self.per_version + self.allowance[version]:
                with trio.move_on_after(self.idle_s) as idle:
                    await self.dist.wait_version(version + 1)
                if idle.cancelled_caught:
                    self.allowance[version] += 1
                continue
            counter = self.produced[version]
            self.produced[version] += 1
            t0 = time.perf_counter()
            batch = await trio.to_thread.run_sync(
                lambda: produce_batch(self.ctx, self.engine, node.peer_id, version, counter,
                                      tamper=self.tamper if self.tamper != "weights" else None))
            await trio.to_thread.run_sync(release_free_memory)  # generation's transient tensors
            self.stats["generate_s"] = round(time.perf_counter() - t0, 2)
            raw = seal(node.key, g.run_id, batch, int(time.time() * 1000), node.seq.next())
            batch_id = sha256(raw)
            self.batches[batch_id] = raw
            self._my_batches.add(batch_id)
            while len(self.batches) > self.keep_batches:
                old, _ = self.batches.popitem(last=False)
                self._my_batches.discard(old)
                self._voted.pop(old, None)
            self.stats["batches_produced"] += 1
            await node.gossip.publish(RolloutAnnounce(batch_id=batch_id, policy_version=version, batch_counter=counter,
                                                      num_samples=len(batch.samples), size_bytes=len(raw)))
            log.info("announced batch %s (version %d, counter %d)", batch_id.hex()[:12], version, counter)

    def heartbeat_fields(self) -> dict[str, Any]:
        return {**super().heartbeat_fields(), "batches": self.stats["batches_produced"]}

    def status(self) -> dict[str, Any]:
        return {"policy_version": self.loaded_version, **self.stats, "tamper": self.tamper,
                "distribution": self.distribution_status()}


def _perturb(model, scale: float) -> None:
    import torch

    with torch.no_grad():
        gen = torch.Generator().manual_seed(1234)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
