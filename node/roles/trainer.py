"""The trainer: owns the policy. Admits batches on a quorum of validator votes
(durably, in SQLite, before anything else), trains GRPO steps on the validators'
rewards, and publishes each new version to the run's peers. Two-step async: workers
keep generating with older versions (up to ``max_async`` behind) while the next
one travels.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import trio

from node.errors import CheckpointError, ConfigError, ModelError
from node.memory import release_free_memory
from node.p2p.reqresp import RequestError
from node.p2p.services import NodeServices
from node.roles.context import policy_dtype_for
from node.roles.intake import FETCH_TASKS, UNPROVEN_FETCH_SLOTS, AnnounceIntake
from node.roles.learning import LearningRole
from node.roles.ledger import (
    MAX_PENDING,
    MAX_PENDING_BYTES,
    MAX_UNADMITTED_ROWS,
    NO_POLICY_WEIGHTS,
    ORPHAN_VOTE_TTL_S,
    STALE_BEFORE_TRAINING,
    AdmittedBatch,
    Ledger,
)
from node.roles.resume import TrainerStates
from node.roles.weights import export_weights
from node.util import abandon, crash_point, stop_point
from protocol import (
    BatchKey,
    CheckpointAnnounce,
    Envelope,
    ProtocolError,
    RolloutAnnounce,
    RolloutBatch,
    batch_key,
    open_envelope,
)
from protocol.admission import StepCandidate, select_for_step

log = logging.getLogger(__name__)


class HeldoutEvaluator:
    """The trainer's periodic held-out evaluation ([config] ``eval_every`` N: versions 0, N,
    2N, ... are scored): ``eval_problems`` held-out problems (default: all), ``eval_samples``
    seeded completions each (default 1), ``eval_seed`` (default 0), at the run's sampling
    settings, by ``node.rl.evaluate``, the code behind ``primenode eval``, so a line of
    metrics.jsonl and ``primenode eval --split heldout --n P --samples K --seed S`` of the
    same version give the same numbers. One evaluation at a time, on an engine of its
    own; a version that comes due while one runs replaces any still waiting (the newest
    matters), so a slow evaluation never queues up work behind the trainer."""

    def __init__(self, ctx: Any, every: int, problems: int, samples: int, seed: int) -> None:
        self.ctx = ctx
        self.every = every
        self.problems = ctx.heldout[:problems] if problems else list(ctx.heldout)
        self.samples = samples
        self.seed = seed
        self.engine: Any = None
        self.threads = 1
        self.running = False
        self.waiting: int | None = None
        self.last: dict[str, Any] | None = None

    @classmethod
    def from_config(cls, ctx: Any) -> HeldoutEvaluator | None:
        cfg = ctx.config  # types and bounds checked when the genesis was read
        if not cfg.eval_every:
            return None
        if not ctx.heldout:
            raise ConfigError(
                "genesis eval_every needs a held-out split (heldout_size; `primenode run init --heldout N`)"
            )
        return cls(ctx, cfg.eval_every, cfg.eval_problems, cfg.eval_samples, cfg.eval_seed)

    def prepare(self, device: str) -> None:
        """Build the evaluation engine (blocking), before training starts: building a model
        seeds torch's global RNG, which must not race the training state's RNG snapshot."""
        from node.roles.engines import scoring_engine

        self.engine = scoring_engine(self.ctx, device)

    def due(self, nursery: trio.Nursery, version: int, evaluate: Any) -> None:
        if version % self.every:
            return
        if self.running:
            self.waiting = version
            return
        self.running = True  # now, not when the task starts: a second due() must wait behind it
        nursery.start_soon(self._drain, version, evaluate)

    async def _drain(self, version: int, evaluate: Any) -> None:
        try:
            next_version: int | None = version
            while next_version is not None:
                await evaluate(next_version)
                next_version, self.waiting = self.waiting, None
        finally:
            self.running = False

    def run(self, version: int, state: Any) -> dict[str, Any]:
        """Load ``state`` into the engine and score it (blocking: a thread)."""
        import torch

        from node.rl.evaluate import sample_problems, summarize

        t0 = time.monotonic()  # wall time: measured seconds for metrics
        # one compute thread: the evaluation shares the machine with the training step, and two
        # pools of every core each ran SmolLM2's sampling 2-7x slower than one thread on a busy
        # 2-core machine (docs/rl.md, "Evaluation"). OpenMP's thread count is per calling thread,
        # and trio reuses its worker threads, so it is put back before the thread goes.
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            self.engine.load_weights(state)
            results = sample_problems(
                self.problems,
                self.engine,
                self.ctx.problem_tokens,
                self.ctx.decode,
                self.samples,
                self.ctx.sampling,
                seed=self.seed,
            )
        finally:
            torch.set_num_threads(before)
        summary = {**summarize(results), "seed": self.seed, "seconds": round(time.monotonic() - t0, 2)}
        self.last = {"policy_version": version, **summary}
        return {"kind": "eval", "split": "heldout", "policy_version": version, "eval": summary, "time": time.time()}


# Tokens (prompt + completion, all samples) one step trains on at most; the default devnet
# brings ~3.5k per batch, so every fresh batch fits; a run with many workers caps its step here.
STEP_TOKEN_BUDGET = 1 << 16

LEDGER_LIMITS: dict[str, Any] = {
    "max_pending": MAX_PENDING,
    "max_pending_bytes": MAX_PENDING_BYTES,
    "max_unadmitted_rows": MAX_UNADMITTED_ROWS,
    "orphan_vote_ttl_s": ORPHAN_VOTE_TTL_S,
}


class TrainerRole(LearningRole):
    role = "trainer"

    def __init__(self, *args: Any, device: str = "cpu", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        g = self.ctx.genesis
        if not self.ctx.model_ready:  # version 0 starts here: a pinned model must be on this machine
            raise ModelError(
                f"the trainer needs the run's model on its machine: {g.model!r} with content root "
                f"{g.model_root.hex()} is not here (a folder or hf:owner/name@rev in the local hub cache): "
                f"{self.ctx.model_note}"
            )
        self.device = device
        self.steps = self.ctx.config.steps or None  # None: train forever
        cfg = self.ctx.config
        # A step starts once this many admitted batches wait, then takes every admitted batch
        # still inside the max_async window, oldest policy first, up to step_token_budget
        # prompt + completion tokens (always at least one batch): all honest work is used.
        self.batches_per_step = cfg.batches_per_step
        self.step_token_budget = cfg.step_token_budget
        # ... and at most this many batches (0: the token budget alone). Workers that generate
        # continuously make more than a step needs; a fixed step size keeps each step's cost
        # and learning rate per prompt what the run was tuned for (the devnet: one per worker).
        self.max_batches_per_step = cfg.max_batches_per_step
        # Old log-probs need the weights of each batch's generating version: read back from the
        # store one version at a time (docs/rl.md: memory of one state dict, milliseconds a version).
        self.weights.capacity = 1
        # retention caps of the ledger (docs/security.md); the run config may override them.
        # reward_agreement: how far apart the admitting validators' rewards may be (docs/protocol.md)
        self.ledger = Ledger(
            self.home.ledger_path,
            g.validators,
            g.quorum,
            g.max_async,
            reward_agreement=cfg.reward_agreement,
            committee_size=cfg.committee_size,
            committee_deadline_s=cfg.committee_deadline_s,
            order_of=self.committee_order,
            **{k: type(v)(getattr(cfg, f"ledger_{k}")) for k, v in LEDGER_LIMITS.items()},
        )
        self.prune_interval_s = cfg.ledger_prune_interval_s
        self.refetches = 0
        self._refetching: set[BatchKey] = set()  # queued second fetches (bounded like the queue)
        self.states = TrainerStates(self.home.trainer_states_dir, legacy=self.home.trainer_checkpoint_dir)
        self.export_root = self.home.trainer_export_dir
        self.metrics_path = self.home.metrics_path
        self.trainer: Any = None
        self.version = 0
        self.last_metrics: dict[str, Any] = {}
        self.restored = 0
        self._admitted = trio.Event()
        self.intake = AnnounceIntake(
            1024, unproven_slots=UNPROVEN_FETCH_SLOTS, hold_while_fetching=True, on_evicted=self._unqueue
        )
        self.fetch_failures = 0
        # announces queued or being fetched, keyed (announcer, batch id): protocol/batches.py
        self._queued: set[BatchKey] = set()
        self.stolen_announces = 0  # announces of a batch the ledger holds as another worker's
        # held-out evaluation as the run goes ([config] eval_every; docs/rl.md "Evaluation")
        self.evals = HeldoutEvaluator.from_config(self.ctx)

    # ------------------------------------------------------------ lifecycle
    _nursery: trio.Nursery | None = None

    async def run(self, node: NodeServices) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self.start_common(node, nursery)
            await trio.to_thread.run_sync(self._load_or_init)
            self._check_store()
            await self._publish_current()
            if self.evals is not None:
                await trio.to_thread.run_sync(self.evals.prepare, self.device)
                self.evals.due(nursery, self.version, self._evaluate)
            self._reevaluate_pending()
            node.gossip.on("rollout", self._on_announce)
            node.gossip.on("vote", self._on_vote)
            for _ in range(FETCH_TASKS):
                nursery.start_soon(self._fetch_loop)
            nursery.start_soon(self._reannounce_loop)
            nursery.start_soon(self._retention_loop)
            if self.ledger.committees:
                nursery.start_soon(self._committee_loop)
            await self._train_loop()

    def _load_or_init(self) -> None:
        """Resume at the version the ledger last committed (node/roles/resume.py decides what a
        crash left on disk), or start the run from the initial model and commit version 0. Under
        torchrun (``join --nproc N``) this process is rank 0 and the trainer is the rank group
        (node/rl/ranks.py), with group (DCP) state folders; one kind never resumes the other's."""
        from node.rl.grpo import GRPOTrainer
        from node.rl.ranks import RankGroup, is_group_checkpoint
        from node.rl.torchrun import under_torchrun

        group = under_torchrun()
        if group:
            from node.rl.distributed import init_distributed

            init_distributed(self.device)
        cfg, pad = self.ctx.grpo_config(), self.ctx.pad_token_id
        dtype = policy_dtype_for(self.ctx.config)
        version = self.states.reconcile(self.ledger.committed_version(), self.ledger.counts()["trained"])
        if version is not None:
            folder = self.states.folder(version)
            if is_group_checkpoint(folder) != group:
                raise ConfigError(
                    f"{folder} was written by a single-process trainer: join without --nproc"
                    if group
                    else f"{folder} was written by a group of ranks: join with --nproc N"
                )
            if group:
                self.trainer = RankGroup.start(
                    config=cfg, pad_token_id=pad, device=self.device, dtype=dtype, checkpoint=folder
                )
            else:
                self.trainer = GRPOTrainer.from_checkpoint(folder, config=cfg, pad_token_id=pad, device=self.device)
            if self.trainer.version != version:
                raise CheckpointError(f"{folder} holds version {self.trainer.version}, not {version}")
            self.restored = self.ledger.recover()  # ledgers from before commit_step only
            log.info(
                "resumed at version %d, the ledger's last commit (%d batches back in the queue)",
                version,
                self.restored,
            )
        else:
            model = self.ctx.initial_model()
            if group:
                self.trainer = RankGroup.start(
                    config=cfg, pad_token_id=pad, device=self.device, dtype=dtype, model=model
                )
            else:
                self.trainer = GRPOTrainer(model, cfg, pad_token_id=pad, device=self.device)
            self.states.write(self.trainer)
            self.ledger.commit_step([], 0)
            self.states.prune(keep=0)
        if not group:
            # published weights in another dtype than the live parameters are not the live ones:
            # old log-probs of the current version then come from the published files too
            # (docs/rl.md, "no extra pass"); a rank group decides it on every rank alike from the
            # config (compute dtype = policy dtype)
            live_dtype = str(self.trainer.param_dtype).removeprefix("torch.")
            self.trainer.live_is_published = self.trainer.live_is_published and dtype == live_dtype
        self.version = self.trainer.version

    def _check_store(self) -> None:
        """Refuse to run if this node's chunk store holds a version newer than the one resumed:
        it was announced, so training that number again would give the run two different
        versions under one number. Commit-before-publish makes this impossible unless the
        ledger or the training state was rolled back by hand."""
        ahead = sorted(v for v in self.store.versions if v > self.version)
        if ahead:
            raise CheckpointError(
                f"the chunk store holds published versions {ahead} but the trainer resumes at version "
                f"{self.version} (the ledger's last commit): the ledger or {self.states.root} was rolled back; "
                "refusing to publish a second, different version under a number the run has seen"
            )

    def _reevaluate_pending(self) -> None:
        """Batches undecided at a crash: decide each again (its votes may all be in, or it may
        have gone stale against the resumed version); quorum-accepted ones whose bytes are
        gone are fetched again. Retention runs first: pending rows out of the window are
        rejected in one query instead of one by one."""
        self.ledger.prune()
        pending = self.ledger.pending_ids()
        for b in pending:
            self._decide(b)
        if pending:
            log.info("re-evaluated %d pending batches after the restart", len(pending))

    async def _commit_step(self, batch_ids: list[bytes]) -> None:
        """Make the step just taken durable, then tell the run (order: node/roles/resume.py)."""
        version = self.trainer.version
        await trio.to_thread.run_sync(self.states.write, self.trainer)
        self.ledger.commit_step(batch_ids, version)  # the commit point
        crash_point("ledger.committed", version)
        self.version = version
        await trio.to_thread.run_sync(self.states.prune, version)
        crash_point("state.pruned", version)
        await self._publish_current()
        crash_point("published", version)
        if self.evals is not None and self._nursery is not None:
            self.evals.due(self._nursery, version, self._evaluate)

    async def _publish_current(self) -> None:
        """Announce the current version; after a restart, re-announce the manifest already in the store."""
        from node.roles.checkpoint_wiring import publish_checkpoint

        st = self.store.get(self.version)
        if st is not None and st.complete:
            await self.node.gossip.publish(CheckpointAnnounce(manifest=st.manifest))
            return
        out = self.export_root / f"v{self.version}"
        if self.version == 0 and self.ctx.model_dir is not None:
            out = self.ctx.model_dir  # a pinned model: version 0 is the genesis's files, byte for byte
        else:
            group_export = getattr(self.trainer, "export", None)  # a rank group gathers its shards
            if group_export is not None:
                await trio.to_thread.run_sync(group_export, out, self.ctx.policy_dtype)
            else:
                await trio.to_thread.run_sync(export_weights, self.trainer.model, out, self.ctx.policy_dtype)
        assert self.checkpoints is not None
        await publish_checkpoint(self.node, self.checkpoints, self.version, out)
        log.info("published policy version %d", self.version)

    async def _reannounce_loop(self) -> None:
        """Late joiners learn the newest version without waiting for the next step (and, when the
        genesis pins the model, version 0: their model's config and tokenizer)."""
        while True:
            await trio.sleep(5.0)
            for version in sorted({self.version} | self.store.keep):
                st = self.store.get(version)
                if st is not None and st.complete:
                    await self.node.gossip.publish(CheckpointAnnounce(manifest=st.manifest))

    async def _retention_loop(self) -> None:
        """The ledger's retention rules (stale pending rows, capped metadata, orphan votes)."""
        while True:
            pruned = self.ledger.prune()
            if any(pruned.values()):
                log.info("ledger retention: %s", pruned)
            await trio.sleep(self.prune_interval_s)

    async def _committee_loop(self) -> None:
        """With committees a batch's reach grows with time (a silent member is replaced after
        ``committee_deadline_s``): the votes of a validator called on late count only once the
        ledger's clock has reached it too, so pending batches are decided again a few times per
        deadline, not only when a vote arrives."""
        period = max(0.5, self.ctx.config.committee_deadline_s / 4)
        while True:
            await trio.sleep(period)
            for batch_id in self.ledger.pending_ids():
                self._decide(batch_id)

    # ------------------------------------------------------------ admission
    def _on_announce(self, env: Envelope) -> None:
        if self.node.standing.is_banned(env.sender):
            return
        ann: RolloutAnnounce = env.body
        owner = self.ledger.owner(ann.batch_id)
        if owner is not None and owner != env.sender:
            # the ledger holds this id as the batch its signer served: this announcer claims
            # someone else's batch. Charged, not fetched; the signer's row is untouched.
            self.stolen_announces += 1
            self.node.standing.penalise(env.sender, "batch_stolen")
            return
        # Nothing is written to the ledger before the batch is fetched: announces from free
        # identities must not grow the database (the row is written with the bytes below).
        # A batch already decided or held is not fetched again (a rejected batch stores nothing).
        key = batch_key(env.sender, ann)
        if key in self._queued or not self.ledger.needs_fetch(ann.batch_id):
            self.intake.dropped += 1
            return
        if self.intake.offer(env):
            self._queued.add(key)

    def _unqueue(self, env: Envelope) -> None:
        """A queued announce displaced by a sender with a smaller share: it may come again."""
        key = batch_key(env.sender, env.body)
        self._queued.discard(key)
        self._refetching.discard(key)

    async def _fetch_one(self, env: Envelope) -> None:
        key = batch_key(env.sender, env.body)
        try:
            await self._fetch_and_record(env)
        finally:
            self._queued.discard(key)
            self._refetching.discard(key)

    async def _fetch_and_record(self, env: Envelope) -> None:
        last: Exception | None = None
        for attempt in range(2):
            if self.node.standing.is_banned(env.sender):
                return
            try:
                raw, _batch = await self.fetch_batch(env, timeout=30.0)
            except RequestError as exc:
                last = exc
                log.info("batch fetch from %s failed (%s), attempt %d", env.sender[:12], exc, attempt + 1)
                if exc.code in ("unreachable", "not_found", "refused"):
                    break  # a dead or forgetful announcer: do not hold a fetch slot for it
                await trio.sleep(1.0)
                continue
            except ProtocolError as exc:
                log.warning("bad batch from %s: %s", env.sender, exc)
                return
            ann = env.body
            self.ledger.record_batch(
                ann.batch_id, env.sender, ann.policy_version, ann.batch_counter, ann.num_samples, raw
            )
            self._decide(ann.batch_id)
            # later counters of the same worker waited for this one (one chain per worker)
            for later in self.ledger.waiting_after(env.sender, ann.batch_counter):
                self._decide(later)
            return
        self.fetch_failures += 1
        if last is not None and batch_key(env.sender, env.body) not in self._refetching:
            # (a worker that no longer holds a batch the ledger evicted is not charged for it)
            self.charge_unserved(env.sender, last)

    def _on_vote(self, env: Envelope) -> None:
        vote = env.body
        if env.sender not in self.ctx.genesis.validators:
            return  # only the genesis's validators count
        # a vote is on one announce, (vote.worker, batch id): it counts only for that worker's batch
        if self.ledger.record_vote(
            vote.batch_id, env.sender, vote.accept, vote.reason, vote.rewards, worker=vote.worker
        ):
            self._decide(vote.batch_id)

    def _decide(self, batch_id: bytes) -> None:
        status = self.ledger.try_admit(batch_id)
        if status == "admitted":
            log.info("admitted batch %s", batch_id.hex()[:12])
            self._admitted.set()
        elif status == "pending":
            want = self.ledger.bytes_wanted(batch_id)
            if want is not None:
                self._refetch(batch_id, *want)

    def _refetch(self, batch_id: bytes, worker: str, version: int, counter: int, num_samples: int) -> None:
        """A quorum accepts a batch whose bytes the ledger evicted (retention caps): fetch it
        again from its worker, through the same queue and per-announcer limits as announces."""
        key: BatchKey = (worker, batch_id)
        if key in self._queued or self.node.standing.is_banned(worker):
            return
        ann = RolloutAnnounce(
            batch_id=batch_id, policy_version=version, batch_counter=counter, num_samples=num_samples, size_bytes=1
        )
        env = Envelope(self.ctx.genesis.run_id, RolloutAnnounce.TYPE_ID, worker, 0, 0, ann, b"")
        if self.intake.offer(env, count_drops=False):
            self._queued.add(key)
            self._refetching.add(key)
            self.refetches += 1
            log.info("fetching evicted batch %s again: a quorum accepts it", batch_id.hex()[:12])

    # ------------------------------------------------------------ training
    def _batch_groups(self, b: AdmittedBatch) -> list[list[Any]]:
        """One admitted batch as GRPO groups (rollouts with the validators' rewards)."""
        from node.rl.grpo import Rollout

        g = self.ctx.genesis
        env = open_envelope(b.envelope, run_id=g.run_id, now_ms=0, guard=None, allowed_types={RolloutBatch.TYPE_ID})
        batch = env.body
        assert isinstance(batch, RolloutBatch)
        rollouts = [
            Rollout(self.ctx.prompt_tokens(s.prompt_index), s.token_ids(), reward, policy_version=batch.policy_version)
            for s, reward in zip(batch.samples, b.rewards)
        ]
        return [rollouts[i : i + g.group_size] for i in range(0, len(rollouts), g.group_size)]

    def _weights_held(self, version: int) -> bool:
        """Whether the weights that generated ``version``'s rollouts can be read back: the
        current version is the live model; older ones must still be in the store."""
        return version == self.version or self.weights.held(version)

    def _select(self, candidates: list[AdmittedBatch]) -> tuple[list[AdmittedBatch], list[list[Any]], int, list[bytes]]:
        """The step's batches (``protocol.admission.select_for_step`` decides: oldest policy
        first, the token budget, ``max_batches_per_step``). Returns the batches, their groups,
        their tokens, and the batches whose generating weights are gone (to discard)."""
        groups_of: dict[bytes, list[list[Any]]] = {}

        def facts() -> Iterator[StepCandidate]:  # lazily: a batch's groups are decoded only if reached
            for b in candidates:
                if not self._weights_held(b.policy_version):
                    yield StepCandidate(b.batch_id, b.policy_version, 0, weights_held=False)
                    continue
                bg = groups_of[b.batch_id] = self._batch_groups(b)
                n = sum(len(r.prompt_tokens) + len(r.completion_tokens) for g in bg for r in g)
                yield StepCandidate(b.batch_id, b.policy_version, n, weights_held=True)

        sel = select_for_step(facts(), self.step_token_budget, self.max_batches_per_step)
        by_id = {b.batch_id: b for b in candidates}
        chosen = [by_id[i] for i in sel.chosen]
        groups = [g for i in sel.chosen for g in groups_of[i]]
        return chosen, groups, sel.tokens, list(sel.unusable)

    def _behaviour_weights(self, version: int) -> Any:
        """The published weights of ``version`` for the step's old log-probs. Called from the
        step's worker thread: the store is read on the trio thread (it pins the version)."""
        try:
            return trio.from_thread.run(self.weights.get, version)
        except Exception as exc:  # a store problem: the step drops the groups (missing_policy_groups)
            log.warning("cannot read the weights of policy version %d: %s", version, exc)
            return None

    def _step(self, groups: Any) -> Any:
        """One optimizer step (a worker thread)."""
        stop_point("trainer.step")
        return self.trainer.step(groups, self._behaviour_weights)

    async def _train_loop(self) -> None:
        discarded_step: dict[str, int] = {}
        while self.steps is None or self.version < self.steps:
            if n := self.ledger.drop_stale():
                discarded_step[STALE_BEFORE_TRAINING] = discarded_step.get(STALE_BEFORE_TRAINING, 0) + n
            candidates = self.ledger.untrained(oldest_first=True)
            if len(candidates) < self.batches_per_step:
                self._admitted = trio.Event()
                with trio.move_on_after(1.0):
                    await self._admitted.wait()
                continue
            batches, groups, step_tokens, unusable = self._select(candidates)
            if unusable:
                n = self.ledger.discard(unusable, NO_POLICY_WEIGHTS)
                discarded_step[NO_POLICY_WEIGHTS] = discarded_step.get(NO_POLICY_WEIGHTS, 0) + n
                log.warning("discarded %d admitted batches: %s", n, NO_POLICY_WEIGHTS)
            if not batches:
                continue
            t0 = time.monotonic()  # wall time: measured seconds for metrics
            try:
                # abandonable: a stop must not wait out a step (minutes on a real model); the
                # step writes nothing, so the run resumes at the last committed version
                step = functools.partial(self._step, groups)
                metrics = await trio.to_thread.run_sync(step, abandon_on_cancel=True)  # type: ignore[call-arg]  # mypy: kwargs after *args: Unpack[Ts]
            except trio.Cancelled:
                log.info(
                    "stopping mid-step %d: the step is abandoned, the run resumes at version %d",
                    self.version + 1,
                    self.version,
                )
                abandon(f"trainer step {self.version + 1}")
                raise
            await trio.to_thread.run_sync(release_free_memory)  # the step's transient tensors (node/memory.py)
            staleness = collections.Counter(str(self.version - b.policy_version) for b in batches)
            if metrics.skipped:
                # every group filtered out (all-equal rewards): no optimizer step, the policy
                # is unchanged, so the batches are consumed at the current checkpoint
                self.ledger.mark_trained([b.batch_id for b in batches], self.version)
            else:
                await self._commit_step([b.batch_id for b in batches])
            counts = self.ledger.counts()
            self.last_metrics = {
                **metrics.as_dict(),
                "step": self.version,
                "policy_version": self.version,
                "batches": len(batches),
                "batch_versions": sorted({b.policy_version for b in batches}),
                "batch_staleness": dict(sorted(staleness.items())),
                "step_tokens": step_tokens,
                "discarded": discarded_step,
                "batches_used": counts["trained"],
                "batches_discarded": self.ledger.discarded(),
                "admitted": counts["admitted"],
                "rejected": counts["rejected"],
                "buffer": counts["buffer"],
                "step_wall_s": round(time.monotonic() - t0, 3),
                "time": time.time(),
            }
            discarded_step = {}
            await trio.to_thread.run_sync(self._append_metrics, json.dumps(self.last_metrics))
            log.info(
                "step %d%s: reward %.3f over %d rollouts from %d batches",
                self.version,
                " (skipped: no group with signal)" if metrics.skipped else "",
                metrics.reward_mean,
                metrics.num_rollouts,
                len(batches),
            )
            assert self.checkpoints is not None
            self.checkpoints.gc()
        log.info("reached %s steps; serving until stopped", self.steps)
        await trio.sleep_forever()

    async def _evaluate(self, version: int) -> None:
        """Score ``version`` (its published weights, read from the store) on the held-out
        problems in a thread of its own: the train loop never waits for it. The result is a
        ``"kind": "eval"`` line of metrics.jsonl and ``last_eval`` in the status."""
        from node.roles.weights import load_state_dict

        assert self.checkpoints is not None and self.evals is not None
        try:
            with self.checkpoints.open_version(version) as files:
                state = await trio.to_thread.run_sync(load_state_dict, files)
        except (RuntimeError, KeyError, OSError) as exc:
            log.warning("held-out evaluation of version %d skipped: its weights are not readable (%s)", version, exc)
            return
        run = functools.partial(self.evals.run, version, state)
        try:
            record = await trio.to_thread.run_sync(run, abandon_on_cancel=True)  # type: ignore[call-arg]
        except Exception:  # a score is a report, never a reason to stop training
            log.exception("held-out evaluation of version %d failed", version)
            return
        await trio.to_thread.run_sync(self._append_metrics, json.dumps(record))
        e = record["eval"]
        log.info(
            "held-out eval of version %d: pass@1 %.3f [%.3f, %.3f], reward %.3f over %d problems (%.1f s)",
            version,
            e["pass@1"],
            *e["pass@1_ci95"],
            e["reward_mean"],
            e["problems"],
            e["seconds"],
        )

    def _append_metrics(self, line: str) -> None:
        """One JSON line per step (blocking: runs in a thread)."""
        with open(self.metrics_path, "a") as f:
            f.write(line + "\n")

    # ------------------------------------------------------------ status
    def heartbeat_fields(self) -> dict[str, Any]:
        return {**super().heartbeat_fields(), "step": self.version, "batches": self.ledger.counts()["admitted"]}

    def status(self) -> dict[str, Any]:
        counts = self.ledger.counts()
        m = self.last_metrics
        return {
            "step": self.version,
            "policy_version": self.version,
            "target_steps": self.steps,
            "reward_mean": m.get("reward_mean"),
            "admitted": counts["admitted"],
            "rejected": counts["rejected"],
            "pending": counts["pending"],
            "buffer": counts["buffer"],
            "trained_batches": counts["trained"],
            "discarded_batches": self.ledger.discarded(),
            "restored_after_crash": self.restored,
            "dropped_announces": self.dropped_announces,
            "stolen_announces": self.stolen_announces,
            "ledger": {**self.ledger.storage(), "refetches": self.refetches},
            "last_step": {
                k: m[k]
                for k in (
                    "loss",
                    "grad_norm",
                    "clip_fraction",
                    "entropy",
                    "filtered_groups",
                    "stale_groups",
                    "missing_policy_groups",
                    "batches",
                    "batch_staleness",
                    "step_tokens",
                    "by_staleness",
                    "tokens_per_s",
                    "length_mean",
                )
                if k in m
            },
            "distribution": self.checkpoints_status(),
            "last_eval": self.evals.last if self.evals is not None else None,
        }
