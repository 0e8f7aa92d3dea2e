"""The worker: fetch the newest policy, generate the owed rollouts with proofs, sign,
announce, serve. Permissionless: it trusts only the trainer-signed manifest."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Iterator
from typing import Any

import trio

from node.memory import release_free_memory
from node.roles.common import EngineRole
from node.roles.rollouts import PolicyFacts, produce_batch
from node.util import now_ms
from protocol import BatchRequest, BatchResponse, Envelope, RolloutAnnounce, seal, sha256
from protocol.rules import Quorum, counter_limit, is_stale, quorum_outcome

log = logging.getLogger(__name__)

# Adversarial test modes. "weights": generate with perturbed weights; "tokens", "prompts",
# "rewards", "greedy": lie in the batch (rollouts.produce_batch); "version": sign batches as a
# policy version VERSION_LIE ahead of the one it holds; "grind": skip batch counters, looking
# for easy prompts; "stale": stay on the first version it loads and keep producing for it
# within its slots -- not cheating, just too slow, so its batches fall out of the max_async
# window; "choose": compute two counters at a time and announce only the one whose rewards
# look better (choosing among one's slots, which the in-order rule answers).
TAMPER_MODES = ("weights", "tokens", "prompts", "rewards", "greedy", "version", "grind", "stale", "choose")
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
# ... and every held batch (decided or not) again this often while its version is in the window:
# the trainer may have missed it (see _reannounce_loop), and later counters wait for it.
KEEPALIVE_S = 30.0


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
        # continuous by default; a run may cap batches per version (then, with no new version for
        # idle_s -- trainer restarting, batches lost with it -- one more instead of idling forever)
        self.pace = self.ctx.worker_pace
        self.spent: collections.defaultdict[str, float] = collections.defaultdict(float)  # seconds per activity
        self.started_at: float | None = None  # time.monotonic() at run()
        # "choose" mode: (version, counter, its mean reward, the next counter's)
        self.choices: list[tuple[int, int, float, float]] = []
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
            "kept_announced": 0,
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
        # the process clock, not trio's: /metrics reads this from the exporter's thread
        self.started_at = time.monotonic()
        self._register_metrics(node)
        async with trio.open_nursery() as nursery:
            await self.start_common(node, nursery)
            node.reqresp.register(BatchRequest, self._serve_batch)
            node.gossip.on("vote", self._on_vote)
            nursery.start_soon(self._loop)
            nursery.start_soon(self._read_ahead_loop)
            nursery.start_soon(self._reannounce_loop)

    def _register_metrics(self, node: Any) -> None:
        """Worker utilization on ``/metrics``: the generating share of wall time, and the
        seconds spent per activity (generate, load, window, rate, pace, first_version, other)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        worker = self

        class _Collector:
            def collect(self) -> Iterator[Any]:
                u = worker.utilization()
                yield GaugeMetricFamily(
                    "primenode_worker_utilization",
                    "Share of wall time since the first version spent generating",
                    value=u["utilization"],
                )
                spent = CounterMetricFamily(
                    "primenode_worker_seconds", "Worker wall seconds by activity", labels=["activity"]
                )
                for what, seconds in u["spent_s"].items():
                    spent.add_metric([what], seconds)
                yield spent

        registry = getattr(getattr(node, "metrics", None), "registry", None)
        if registry is not None:
            registry.register(_Collector())

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
        """Generate batch after batch (docs/rl.md, "the pipeline"): between two batches, swap in
        the newest version held (read ahead meanwhile, never waited for); wait only when the
        policy held fell out of the ``max_async`` window of the newest version known, when the
        slot rule's rate bound has no counter open yet, or when the run caps batches per
        version (``WorkerPace``). Every second is booked under what it was spent on."""
        checkpoints = self.checkpoints
        assert checkpoints is not None
        with self._spending("first_version"):
            await checkpoints.wait_version(0)
        while True:
            newest = checkpoints.newest_version()
            if newest != self.loaded_version and not self._pinned():
                with self._spending("load"):
                    await self._load(newest)  # the weights were read ahead; the next version keeps fetching
            version = self.loaded_version
            known = max(self.store.versions, default=version)
            if not self._pinned() and is_stale(version, known, self.ctx.genesis.max_async):
                # batches of this policy would be refused as stale: wait for a newer one to arrive
                with self._spending("window"):
                    await checkpoints.wait_version(version + 1)
                continue
            pace = self.pace
            if (
                pace.batches_per_version
                and self.produced[version] >= pace.batches_per_version + self.allowance[version]
            ):
                # the run caps batches per version: wait for the next (a trainer restarting
                # may never send it: after idle_s, one more batch for this version)
                with self._spending("pace"), trio.move_on_after(pace.idle_s) as idle:
                    await checkpoints.wait_version(newest + 1)
                if idle.cancelled_caught:
                    self.allowance[version] += 1
                continue
            opens_in = self._rate_wait_s(version)
            if opens_in > 0:
                with self._spending("rate"), trio.move_on_after(opens_in):
                    await checkpoints.wait_version(newest + 1)
                continue
            with self._spending("generate"):
                await self._produce(version)

    def _rate_wait_s(self, version: int) -> float:
        """Seconds until the slot rule lets this worker use its next counter of ``version`` (0: now).
        The rule bounds validators' work (one counter per ``worker_min_batch_s``); a worker
        faster than that waits rather than have its batches refused."""
        rule = self.ctx.slot_rule
        used = self.produced[version]
        elapsed = now_ms() - self.policy.published_ms
        if used < counter_limit(rule, elapsed):
            return 0.0
        period_ms = max(1, int(rule.min_batch_s * 1000))
        return max(0.05, ((used - rule.slack) * period_ms - elapsed) / 1000)

    @contextlib.contextmanager
    def _spending(self, what: str) -> Iterator[None]:
        """Book the time spent inside under ``what`` (worker utilization, in status)."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.spent[what] += time.monotonic() - t0

    def utilization(self) -> dict[str, Any]:
        """The share of wall time since start spent generating, and where the rest went
        (seconds per activity; "other" is sealing, announcing and the event loop)."""
        if self.started_at is None:
            return {"utilization": 0.0, "wall_s": 0.0, "spent_s": {}}
        wall = max(1e-9, time.monotonic() - self.started_at)
        spent = {k: round(v, 2) for k, v in sorted(self.spent.items())}
        spent["other"] = round(max(0.0, wall - sum(self.spent.values())), 2)
        busy = wall - self.spent.get("first_version", 0.0)  # before the first version there is nothing to run
        return {
            "utilization": round(self.spent.get("generate", 0.0) / busy, 3) if busy > 1e-6 else 0.0,
            "wall_s": round(wall, 1),
            "spent_s": spent,
        }

    async def _produce(self, version: int) -> None:
        """Generate, sign, keep and announce the batch at this worker's next counter of ``version``."""
        node = self.node
        g = self.ctx.genesis
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
        if self.tamper == "choose":
            # computes this counter and the next, announces only the one its own rewards like
            # better (the attack the in-order rule answers: docs/security.md)
            other = await trio.to_thread.run_sync(
                functools.partial(produce_batch, self.ctx, self.engine, node.peer_id, policy, counter + 1)
            )
            self.produced[version] += 1
            mine, theirs = _claimed_mean(batch), _claimed_mean(other)
            self.choices.append((version, counter, mine, theirs))
            if theirs > mine:
                batch = other
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
            batch_counter=batch.batch_counter,
            num_samples=len(batch.samples),
            size_bytes=len(raw),
        )
        self._announced[batch_id] = _Announced(announce, trio.current_time())
        await node.gossip.publish(announce)
        log.info("announced batch %s (version %d, counter %d)", batch_id.hex()[:12], claimed, batch.batch_counter)

    async def _reannounce_loop(self) -> None:
        """Announce each held batch again while its version is inside the window: an undecided
        one every ``reannounce_s`` (up to ``REANNOUNCES`` times: a node whose fetch lane was
        full shed it), then, like a decided one, every ``KEEPALIVE_S``. A quorum of validators
        may have decided a batch the trainer never recorded (it was restarting, or shed the
        announce): the trainer admits counters in order, so without this every later counter
        of that version would wait for it, and a trainer that makes no new version meanwhile
        would wait for ever. Nodes that hold the batch ignore the repeat (one ledger lookup)."""
        while True:
            await trio.sleep(self.reannounce_s / 4)
            now = trio.current_time()
            newest = max(self.store.versions, default=-1)
            for batch_id, a in list(self._announced.items()):
                if is_stale(a.announce.policy_version, newest, self.ctx.genesis.max_async):
                    del self._announced[batch_id]
                    continue
                tally = self._tally.get(batch_id)
                settled = (tally is not None and tally.decided) or a.repeats >= REANNOUNCES
                if now - a.at < (KEEPALIVE_S if settled else self.reannounce_s):
                    continue
                a.at = now
                if settled:
                    self.stats["kept_announced"] += 1
                else:
                    a.repeats += 1
                    self.stats["reannounced"] += 1
                await self.node.gossip.publish(a.announce)
                if not settled:
                    log.info("announced batch %s again (no decision yet)", batch_id.hex()[:12])

    def heartbeat_fields(self) -> dict[str, Any]:
        return {**super().heartbeat_fields(), "batches": self.stats["batches_produced"]}

    def status(self) -> dict[str, Any]:
        return {
            "policy_version": self.loaded_version,
            **self.stats,
            **self.utilization(),
            "tamper": self.tamper,
            "distribution": self.checkpoints_status(),
        }


def _claimed_mean(batch: Any) -> float:
    """A batch's mean reward by the worker's own reckoning (what a chooser would rank by)."""
    return sum(s.claimed_reward for s in batch.samples) / len(batch.samples)


def _perturb(model, scale: float) -> None:
    import torch

    with torch.no_grad():
        gen = torch.Generator().manual_seed(1234)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
