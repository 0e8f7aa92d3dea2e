"""The worker: fetch the newest policy, generate the owed rollouts with proofs, sign,
announce, serve. Permissionless: it trusts only the trainer-signed manifest."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from typing import Any

import trio

from node.memory import release_free_memory
from node.roles.common import EngineRole
from node.roles.rollouts import PolicyFacts, produce_batch
from node.util import now_ms
from protocol import BatchRequest, BatchResponse, Envelope, RolloutAnnounce, seal, sha256
from protocol.rules import Quorum, is_stale, quorum_outcome

log = logging.getLogger(__name__)

# Adversarial test modes. "weights": generate with perturbed weights; "tokens", "prompts",
# "rewards", "greedy": lie in the batch (rollouts.produce_batch); "version": sign batches as a
# policy version VERSION_LIE ahead of the one it holds; "grind": skip batch counters, looking
# for easy prompts; "stale": stay on the first version it loads and keep producing for it
# within its slots -- not cheating, just too slow, so its batches fall out of the max_async
# window.
TAMPER_MODES = ("weights", "tokens", "prompts", "rewards", "greedy", "version", "grind", "stale")
BATCH_TAMPERS = ("tokens", "prompts", "rewards", "greedy")  # applied by produce_batch
# The "grind" mode uses counters 1000, 2000, ...: past the slot rule's bound however long a
# version stays current in a test (the bound grows one counter per ``worker_idle_s``; with a
# stride of 7 a version current for 80 s on a loaded machine let a grinder's batch pass).
# A grinder choosing among a few counters inside the bound is issue 35's, not this rule's.
GRIND_STRIDE = 1000
VERSION_LIE = 50
# A batch the validators have not decided this long after its announce is announced again
# (at most REANNOUNCES times, while its version is in the window): a validator or the trainer
# whose fetch lane was full when it came (a flood) sheds an announce without remembering it,
# and takes it when it comes again; nodes that queued it ignore the repeat.
REANNOUNCE_S = 20.0
REANNOUNCES = 2


@dataclasses.dataclass
class _Tally:
    """The genesis validators' votes on one of our batches."""

    accepts: set[str] = dataclasses.field(default_factory=set)
    rejects: set[str] = dataclasses.field(default_factory=set)
    decided: bool = False


@dataclasses.dataclass
class _Announced:
    """One of our announces, kept to be announced again while undecided."""

    announce: RolloutAnnounce
    at: float  # trio clock of the last announce
    repeats: int = 0


class WorkerRole(EngineRole):
    role = "worker"

    def __init__(self, *args: Any, tamper: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if tamper is not None and tamper not in TAMPER_MODES:
            raise ValueError(f"unknown tamper mode {tamper!r}")
        self.tamper = tamper
        slots = self.ctx.slot_rule  # validators bound batch counters by the same rule
        self.per_version = slots.per_version
        # With no new version for this long (trainer restarting, batches lost with it), the
        # worker produces one more batch for the version it holds instead of idling forever.
        self.idle_s = slots.idle_s
        self.allowance: collections.Counter[int] = collections.Counter()
        self.batches: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self.keep_batches = 64
        self.produced: collections.Counter[int] = collections.Counter()
        # batches_accepted: our batches with accept votes from a quorum of genesis validators;
        # batches_rejected: ours with so many reject votes that no quorum of accepts is possible
        # (with quorum == validators, one reject). accept_votes / reject_votes count single votes.
        self.stats = {
            "batches_produced": 0,
            "batches_accepted": 0,
            "batches_rejected": 0,
            "batches_served": 0,
            "reannounced": 0,
            "accept_votes": 0,
            "reject_votes": 0,
            "generate_s": 0.0,
            "load_s": 0.0,
        }
        self.policy = PolicyFacts(-1, bytes(32), 0)  # the loaded version's manifest facts
        self._my_batches: set[bytes] = set()
        self._tally: dict[bytes, _Tally] = {}
        self._announced: dict[bytes, _Announced] = {}  # our held batches, for re-announces
        self.reannounce_s = REANNOUNCE_S
        # The worker only ever needs the version it runs and the next one (read ahead while
        # the current batch generates); older state dicts are dead weight in its memory.
        self.weights.capacity = 2

    async def run(self, node) -> None:
        async with trio.open_nursery() as nursery:
            await self.start_common(node, nursery)
            node.reqresp.register(BatchRequest, self._serve_batch)
            node.gossip.on("vote", self._on_vote)
            nursery.start_soon(self._loop)
            nursery.start_soon(self._read_ahead_loop)
            nursery.start_soon(self._reannounce_loop)

    def _serve_batch(self, env: Envelope, peer: str) -> BatchResponse:
        raw = self.batches.get(env.body.batch_id)
        if raw is not None:
            self.stats["batches_served"] += 1
        return BatchResponse(found=raw is not None, envelope=raw or b"")

    def _on_vote(self, env: Envelope) -> None:
        vote = env.body
        g = self.ctx.genesis
        if vote.batch_id not in self._my_batches or env.sender not in g.validators:
            return
        if vote.worker != self.node.peer_id:
            return  # a vote on another peer's announce of our batch's id is not about our batch
        tally = self._tally.setdefault(vote.batch_id, _Tally())
        if env.sender in tally.accepts or env.sender in tally.rejects:
            return  # one vote per validator and batch
        (tally.accepts if vote.accept else tally.rejects).add(env.sender)
        self.stats["accept_votes" if vote.accept else "reject_votes"] += 1
        if tally.decided:
            return
        # the trainer's rule (ledger.try_admit), seen from the votes alone
        outcome = quorum_outcome(tally.accepts, tally.rejects, g.validators, g.quorum)
        if outcome is Quorum.ACCEPTED:
            tally.decided = True
            self.stats["batches_accepted"] += 1
        elif outcome is Quorum.REJECTED:
            tally.decided = True
            self.stats["batches_rejected"] += 1

    def _pinned(self) -> bool:
        """The "stale" test mode never leaves the first version it loaded."""
        return self.tamper == "stale" and self.loaded_version >= 0

    async def _read_ahead_loop(self) -> None:
        """Read (and deserialise) each new version's weights while the current batch still
        generates, so the swap between batches is only the copy into the engine."""
        checkpoints = self.checkpoints
        assert checkpoints is not None
        ahead = -1
        while True:
            newest = await checkpoints.wait_version(max(self.loaded_version, ahead) + 1)
            if self._pinned():
                return
            try:
                await self.weights.get(newest)
            except Exception as exc:
                log.info("reading ahead policy version %d failed: %s", newest, exc)
            ahead = newest

    async def _load(self, version: int) -> None:
        t0 = time.perf_counter()
        # the seeds of every batch for this version hash its manifest root: keep the facts, the
        # store may collect the manifest once the version ages out (a stuck worker still uses it)
        policy = PolicyFacts.of(self.store.versions[version].manifest)
        await self.load_policy(version)
        if self.tamper == "weights":
            await trio.to_thread.run_sync(_perturb, self.engine.model, 0.1)
        self.loaded_version = version
        self.policy = policy
        self._trim_counters()
        self.stats["load_s"] = round(time.perf_counter() - t0, 2)
        log.info("worker loaded policy version %d", version)

    def _trim_counters(self) -> None:
        """Versions more than max_async behind the loaded one are never produced for again."""
        max_async = self.ctx.genesis.max_async
        for counter in (self.produced, self.allowance):
            for v in [v for v in counter if is_stale(v, self.loaded_version, max_async)]:
                del counter[v]

    async def _loop(self) -> None:
        node = self.node
        g = self.ctx.genesis
        checkpoints = self.checkpoints
        assert checkpoints is not None
        while True:
            newest = await checkpoints.wait_version(0)
            if newest != self.loaded_version and not self._pinned():
                # hot reload between batches; the weights were read ahead meanwhile, and the
                # next version keeps fetching
                await self._load(newest)
            version = self.loaded_version
            budget = self.per_version + self.allowance[version]
            if self.produced[version] >= budget:
                with trio.move_on_after(self.idle_s) as idle:
                    await checkpoints.wait_version(newest + 1)
                if idle.cancelled_caught:
                    self.allowance[version] += 1
                continue
            counter = (self.produced[version] + 1) * GRIND_STRIDE if self.tamper == "grind" else self.produced[version]
            self.produced[version] += 1
            claimed = version + VERSION_LIE if self.tamper == "version" else version
            policy = self.policy
            if claimed != version:  # nobody published that version: there is no root to seed with
                policy = PolicyFacts(claimed, bytes(32), policy.published_ms)
            t0 = time.perf_counter()
            batch = await trio.to_thread.run_sync(
                functools.partial(
                    produce_batch,
                    self.ctx,
                    self.engine,
                    node.peer_id,
                    policy,
                    counter,
                    tamper=self.tamper if self.tamper in BATCH_TAMPERS else None,
                )
            )
            await trio.to_thread.run_sync(release_free_memory)  # generation's transient tensors
            self.stats["generate_s"] = round(time.perf_counter() - t0, 2)
            raw = seal(node.key, g.run_id, batch, now_ms(), node.seq.next())
            batch_id = sha256(raw)
            self.batches[batch_id] = raw
            self._my_batches.add(batch_id)
            while len(self.batches) > self.keep_batches:
                old, _ = self.batches.popitem(last=False)
                self._my_batches.discard(old)
                self._tally.pop(old, None)
                self._announced.pop(old, None)
            self.stats["batches_produced"] += 1
            announce = RolloutAnnounce(
                batch_id=batch_id,
                policy_version=claimed,
                batch_counter=counter,
                num_samples=len(batch.samples),
                size_bytes=len(raw),
            )
            self._announced[batch_id] = _Announced(announce, trio.current_time())
            await node.gossip.publish(announce)
            log.info("announced batch %s (version %d, counter %d)", batch_id.hex()[:12], claimed, counter)

    async def _reannounce_loop(self) -> None:
        """Announce again each held batch that no quorum decided ``reannounce_s`` after its last
        announce, up to ``REANNOUNCES`` times, while its version is inside the window."""
        while True:
            await trio.sleep(self.reannounce_s / 4)
            now = trio.current_time()
            newest = max(self.store.versions, default=-1)
            for batch_id, a in list(self._announced.items()):
                tally = self._tally.get(batch_id)
                version = a.announce.policy_version
                if (tally is not None and tally.decided) or a.repeats >= REANNOUNCES:
                    del self._announced[batch_id]
                    continue
                if is_stale(version, newest, self.ctx.genesis.max_async):
                    del self._announced[batch_id]
                    continue
                if now - a.at < self.reannounce_s:
                    continue
                a.repeats += 1
                a.at = now
                self.stats["reannounced"] += 1
                await self.node.gossip.publish(a.announce)
                log.info("announced batch %s again (no decision yet)", batch_id.hex()[:12])

    def heartbeat_fields(self) -> dict[str, Any]:
        return {**super().heartbeat_fields(), "batches": self.stats["batches_produced"]}

    def status(self) -> dict[str, Any]:
        return {
            "policy_version": self.loaded_version,
            **self.stats,
            "tamper": self.tamper,
            "distribution": self.checkpoints_status(),
        }


def _perturb(model, scale: float) -> None:
    import torch

    with torch.no_grad():
        gen = torch.Generator().manual_seed(1234)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
