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
from node.p2p.services import NodeServices
from node.roles.learning import EngineRole
from node.roles.rollouts import PolicyFacts, produce_batch
from node.util import atomic_write_bytes, now_ms
from protocol import (
    BatchRequest,
    BatchResponse,
    Envelope,
    ProtocolError,
    RolloutAnnounce,
    RolloutBatch,
    open_envelope,
    seal,
    sha256,
)
from protocol.rules import Quorum, is_stale, quorum_outcome

log = logging.getLogger(__name__)

# Adversarial test modes. "weights": generate with perturbed weights; "tokens", "prompts",
# "rewards", "greedy": lie in the batch (rollouts.produce_batch); "version": sign batches as a
# policy version VERSION_LIE ahead of the one it holds; "grind": skip batch counters, looking
# for easy prompts (counters 1000, 2000, ...: the chain waits at the first one skipped, for
# ever); "stale": stay on the first version it loads and keep producing for it -- not
# cheating, just too slow, so its batches fall out of the max_async window; "choose": when a
# new version arrives, compute the next counter with the old and the new one and announce
# only the one whose rewards look better (the choice the chain leaves: docs/security.md).
TAMPER_MODES = ("weights", "tokens", "prompts", "rewards", "greedy", "version", "grind", "stale", "choose")
BATCH_TAMPERS = ("tokens", "prompts", "rewards", "greedy")  # applied by produce_batch
GRIND_STRIDE = 1000
VERSION_LIE = 50
# A batch the validators have not decided this long after its announce is announced again
# (at most REANNOUNCES times, while its version is in the window): a validator or the trainer
# whose fetch lane was full when it came (a flood) sheds an announce without remembering it,
# and takes it when it comes again; nodes that queued it ignore the repeat.
REANNOUNCE_S = 20.0
REANNOUNCES = 2
# ... and every held batch (decided or not) again this often while its version is in the window,
# or until the trainer fetched it: the trainer may have missed it (see _reannounce_loop), and
# every later counter of the chain waits for it, even when it is stale (at most
# STALE_KEEPALIVES times after it fell out of the window, for a trainer that held it already).
KEEPALIVE_S = 30.0
STALE_KEEPALIVES = 10


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
    stale_repeats: int = 0


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
        # "choose" mode, per choice: (old version, new version, counter, the old version's mean
        # reward, the new one's, the next counter's with the old version: an independent draw)
        self.choices: list[tuple[int, int, int, float, float, float]] = []
        self.choice_differs: list[int] = []  # per choice: completions that differ between the versions
        # batches the pace allowed after idle_s without a new version: an advance on the next
        # version's credit, so it lapses once a newer version is known (a slow step must not
        # leave a paced worker one batch further ahead for the rest of the run)
        self.allowance = 0
        self.allowance_version = -1  # the newest version known when the allowance was given
        self.batches: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self.keep_batches = 64
        self.produced: collections.Counter[int] = collections.Counter()  # batches per version
        self.paced = 0  # batches counted against the pace's credit (_paced_allows)
        self.paced_from: int | None = None  # the first version the pace counted from
        # The worker's chain (protocol.rules.counter_gap): its next batch counter, over the whole
        # run. Every batch is written to the home before it is announced, so a restarted worker
        # resumes after its last one and announces the ones the trainer may not hold.
        self.next_counter = 0
        self.batch_dir = self.home.worker_batches_dir(self.ctx.genesis.run_id)
        self.trainer_fetched: set[bytes] = set()  # our batches the trainer has fetched
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

    async def run(self, node: NodeServices) -> None:
        # the process clock, not trio's: /metrics reads this from the exporter's thread
        self.started_at = time.monotonic()  # wall time: utilization is a share of real seconds
        self._register_metrics(node)
        self._restore_chain(node.peer_id)
        async with trio.open_nursery() as nursery:
            await self.start_common(node, nursery)
            node.reqresp.register(BatchRequest, self._serve_batch)
            node.gossip.on("vote", self._on_vote)
            nursery.start_soon(self._loop)
            nursery.start_soon(self._read_ahead_loop)
            nursery.start_soon(self._reannounce_loop)

    def _register_metrics(self, node: NodeServices) -> None:
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

    def _restore_chain(self, me: str) -> None:
        """Resume the chain after the last batch in the home; the batches kept there are held
        again (served, and announced until the trainer fetched them: a batch lost with the
        process would hold back every later counter). A file that does not open is skipped
        with a warning (the counter after the newest readable one is used next)."""
        g = self.ctx.genesis
        if not self.batch_dir.is_dir():
            return
        for path in sorted(self.batch_dir.glob("*.batch")):
            raw = path.read_bytes()
            try:
                env = open_envelope(raw, run_id=g.run_id, now_ms=0, guard=None, allowed_types={RolloutBatch.TYPE_ID})
            except ProtocolError as exc:
                log.warning("skipping stored batch %s: %s", path.name, exc)
                continue
            batch = env.body
            if not isinstance(batch, RolloutBatch) or env.sender != me or batch.worker != me:
                log.warning("skipping stored batch %s: signed by %s, not this node", path.name, env.sender)
                continue
            batch_id = sha256(raw)
            self.batches[batch_id] = raw
            self._my_batches.add(batch_id)
            announce = RolloutAnnounce(
                batch_id=batch_id,
                policy_version=batch.policy_version,
                batch_counter=batch.batch_counter,
                num_samples=len(batch.samples),
                size_bytes=len(raw),
            )
            self._announced[batch_id] = _Announced(announce, float("-inf"))
            self.next_counter = max(self.next_counter, batch.batch_counter + 1)
        if self.batches:
            log.info(
                "worker resumes its batch chain at counter %d (%d batches kept)", self.next_counter, len(self.batches)
            )

    def _keep(self, counter: int, raw: bytes) -> None:
        """Write a batch to the home (before it is announced) and drop the oldest beyond
        ``keep_batches``."""
        self.batch_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.batch_dir / f"{counter:010d}.batch", raw)
        kept = sorted(self.batch_dir.glob("*.batch"))
        for old in kept[: max(0, len(kept) - self.keep_batches)]:
            old.unlink(missing_ok=True)

    def _serve_batch(self, env: Envelope, peer: str) -> BatchResponse:
        raw = self.batches.get(env.body.batch_id)
        if raw is not None:
            self.stats["batches_served"] += 1
            if peer == self.ctx.genesis.trainer:
                self.trainer_fetched.add(env.body.batch_id)
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
        size = self.ctx.config.committee_size
        if outcome is Quorum.PENDING and 0 < size < len(g.validators) and len(tally.rejects) >= g.quorum:
            outcome = Quorum.REJECTED  # a committee rejects on a quorum of rejects (protocol/committee.py)
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
        # keep the manifest's facts: the store may collect the manifest once the version ages
        # out (a stuck worker still signs batches for it)
        policy = PolicyFacts.of(self.store.versions[version].manifest)
        await self.load_policy(version)
        if self.tamper == "weights":  # a transformers engine's only (check_engine_choice)
            from node.engines.transformers_engine import TransformersEngine

            assert isinstance(self.engine, TransformersEngine)
            await trio.to_thread.run_sync(_perturb, self.engine.model, 0.1)
        self.loaded_version = version
        self.policy = policy
        self._trim_counters()
        self.stats["load_s"] = round(time.perf_counter() - t0, 2)
        log.info("worker loaded policy version %d", version)

    def _trim_counters(self) -> None:
        """Versions more than max_async behind the loaded one are never produced for again."""
        max_async = self.ctx.genesis.max_async
        for counter in (self.produced,):
            for v in [v for v in counter if is_stale(v, self.loaded_version, max_async)]:
                del counter[v]

    async def _loop(self) -> None:
        """Generate batch after batch (docs/rl.md, "the pipeline"): between two batches, swap in
        the newest version held (read ahead meanwhile, never waited for); wait only when the
        policy held fell out of the ``max_async`` window of the newest version known, or when
        the run caps batches per version (``WorkerPace``). Every second is booked under what
        it was spent on."""
        checkpoints = self.checkpoints
        assert checkpoints is not None
        with self._spending("first_version"):
            await checkpoints.wait_version(0)
        while True:
            newest = checkpoints.newest_version()
            if (
                self.tamper == "choose"
                and newest > self.loaded_version >= 0
                and not is_stale(self.loaded_version, newest, self.ctx.genesis.max_async)
            ):
                self.paced += 1
                with self._spending("generate"):
                    await self._produce_choosing(newest)
                continue
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
            if self.pace.batches_per_version and not self._paced_allows(newest):
                # the run paces its workers and this one is as far ahead as it may be: wait for
                # the next version (a trainer restarting may never send it: after idle_s, one
                # more batch)
                with self._spending("pace"), trio.move_on_after(self.pace.idle_s) as idle:
                    await checkpoints.wait_version(newest + 1)
                if idle.cancelled_caught:
                    if self.allowance_version != newest:
                        self.allowance_version, self.allowance = newest, 0
                    self.allowance += 1
                continue
            self.paced += 1
            with self._spending("generate"):
                await self._produce(version)

    def _paced_allows(self, newest: int) -> bool:
        """Whether a paced worker (``WorkerPace``) may start a batch now that ``newest`` is the
        newest version it knows of. Its credit is N batches per version since its first one,
        plus L versions' worth of lead, plus the idle allowance while no newer version is
        known; a worker more than (L + 1) x N behind its credit (slow, or versions came in a
        burst) catches up no further than that, so it never bursts. With L 0 this is N batches
        per newest version: lock-step."""
        pace = self.pace
        n, lead = pace.batches_per_version, pace.lead_versions
        if self.paced_from is None:
            self.paced_from = newest
        allowance = self.allowance if self.allowance_version == newest else 0
        credit = n * (newest - self.paced_from + 1 + lead) + allowance
        self.paced = max(self.paced, credit - n * (lead + 1))
        return self.paced < credit

    @contextlib.contextmanager
    def _spending(self, what: str) -> Iterator[None]:
        """Book the time spent inside under ``what`` (worker utilization, in status)."""
        t0 = time.monotonic()  # wall time: seconds per activity (utilization)
        try:
            yield
        finally:
            self.spent[what] += time.monotonic() - t0

    def utilization(self) -> dict[str, Any]:
        """The share of wall time since start spent generating, and where the rest went
        (seconds per activity; "other" is sealing, keeping, announcing and the event loop)."""
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

    def _take_counter(self) -> int:
        """The chain's next counter (the "grind" test mode skips GRIND_STRIDE - 1 of them)."""
        counter = self.next_counter + (GRIND_STRIDE - 1 if self.tamper == "grind" else 0)
        self.next_counter = counter + 1
        return counter

    async def _generate(self, policy: PolicyFacts, counter: int, tamper: str | None = None) -> RolloutBatch:
        """One batch at ``counter`` with the loaded weights (``policy`` their manifest facts)."""
        t0 = time.perf_counter()
        assert self.engine is not None  # a version is loaded before the first batch
        batch = await trio.to_thread.run_sync(
            functools.partial(produce_batch, self.ctx, self.engine, self.node.peer_id, policy, counter, tamper=tamper)
        )
        await trio.to_thread.run_sync(release_free_memory)  # generation's transient tensors
        self.stats["generate_s"] = round(time.perf_counter() - t0, 2)
        return batch

    async def _produce(self, version: int) -> None:
        """Generate, sign, keep and announce the batch at this worker's next counter, with ``version``."""
        claimed = version + VERSION_LIE if self.tamper == "version" else version
        policy = self.policy
        if claimed != version:  # a version nobody published
            policy = PolicyFacts(claimed, bytes(32), policy.published_ms)
        counter = self._take_counter()
        self.produced[version] += 1
        batch = await self._generate(policy, counter, self.tamper if self.tamper in BATCH_TAMPERS else None)
        await self._publish(batch)

    async def _produce_choosing(self, newest: int) -> None:
        """The "choose" test mode at a version change: the next counter with the old version,
        then with the new one, and the better by its own rewards is announced; the next
        counter with the old version is computed too, unannounced (what choosing between two
        independent draws would have been worth: the measure of what the chain removed)."""
        old_version, old_policy = self.loaded_version, self.policy
        counter = self._take_counter()
        with_old = await self._generate(old_policy, counter)
        independent = await self._generate(old_policy, counter + 1)
        assert self.checkpoints is not None
        # the version seen at the change: the choice a cheat has while its old batch is still
        # inside the window; if it was collected meanwhile, the newest (then the old batch is
        # stale and the choice is none: the test counts only choices inside the window)
        st = self.store.versions.get(newest)
        if st is None or not st.assembled:
            newest = self.checkpoints.newest_version()
        await self._load(newest)
        with_new = await self._generate(self.policy, counter)
        self.produced[newest] += 1
        a, b = _claimed_mean(with_old), _claimed_mean(with_new)
        self.choices.append((old_version, newest, counter, a, b, _claimed_mean(independent)))
        self.choice_differs.append(
            sum(x.completion != y.completion for x, y in zip(with_old.samples, with_new.samples, strict=True))
        )
        await self._publish(with_old if a > b else with_new)

    async def _publish(self, batch: RolloutBatch) -> None:
        """Sign, keep (memory and home) and announce one of our batches."""
        node = self.node
        raw = seal(node.key, self.ctx.genesis.run_id, batch, now_ms(), node.seq.next())
        batch_id = sha256(raw)
        await trio.to_thread.run_sync(self._keep, batch.batch_counter, raw)
        self.batches[batch_id] = raw
        self._my_batches.add(batch_id)
        while len(self.batches) > self.keep_batches:
            old, _ = self.batches.popitem(last=False)
            self._my_batches.discard(old)
            self._tally.pop(old, None)
            self._announced.pop(old, None)
            self.trainer_fetched.discard(old)
        self.stats["batches_produced"] += 1
        announce = RolloutAnnounce(
            batch_id=batch_id,
            policy_version=batch.policy_version,
            batch_counter=batch.batch_counter,
            num_samples=len(batch.samples),
            size_bytes=len(raw),
        )
        self._announced[batch_id] = _Announced(announce, trio.current_time())
        await node.gossip.publish(announce)
        log.info(
            "announced batch %s (version %d, counter %d)",
            batch_id.hex()[:12],
            batch.policy_version,
            batch.batch_counter,
        )

    async def _reannounce_loop(self) -> None:
        """Announce each held batch again while its version is inside the window: an undecided
        one every ``reannounce_s`` (up to ``REANNOUNCES`` times: a node whose fetch lane was
        full shed it), then, like a decided one, every ``KEEPALIVE_S``. A quorum of validators
        may have decided a batch the trainer never recorded (it was restarting, or shed the
        announce): the trainer admits a worker's counters in order, so without this every
        later counter would wait for it for ever. For the same reason a batch the trainer has
        not fetched is announced even once stale (the trainer records a stale batch too, which
        moves the chain on), up to ``STALE_KEEPALIVES`` times. Nodes that hold the batch ignore
        the repeat (one ledger lookup)."""
        while True:
            await trio.sleep(self.reannounce_s / 4)
            now = trio.current_time()
            newest = max(self.store.versions, default=-1)
            for batch_id, a in list(self._announced.items()):
                if is_stale(a.announce.policy_version, newest, self.ctx.genesis.max_async):
                    if batch_id in self.trainer_fetched or a.stale_repeats >= STALE_KEEPALIVES:
                        del self._announced[batch_id]
                        continue
                    if now - a.at < KEEPALIVE_S:
                        continue
                    a.at = now
                    a.stale_repeats += 1
                    self.stats["kept_announced"] += 1
                    await self.node.gossip.publish(a.announce)
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
            "next_batch_counter": self.next_counter,
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
