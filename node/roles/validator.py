"""The validator: fetch each announced batch, check it (owed prompts, TOPLOC against
its own prefill with the same policy version, rule rewards), gossip a signed vote,
and ban workers that keep cheating."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
from typing import Any

import trio

from node.memory import release_free_memory
from node.p2p.reqresp import RequestError
from node.p2p.services import NodeServices
from node.roles.fair_queue import FairQueue
from node.roles.intake import AnnounceIntake, verify_queue
from node.roles.learning import EngineRole
from node.roles.rollouts import REASON_LIMIT, BatchVerdict, PolicyFacts, check_batch_rules, verify_batch
from node.util import thread_cpu
from protocol import BatchKey, Envelope, ProtocolError, RolloutBatch, Vote, batch_key
from protocol.committee import Ballot, CommitteeRule
from protocol.rules import Quorum, is_stale

log = logging.getLogger(__name__)

# How long a batch may wait for the checkpoint version it claims (fetched on demand) ...
VERSION_WAIT_S = 60
# ... and for that version's announcement, if the validator has not heard of it yet (gossip
# races are sub-second; a version nobody announced is a lie, and is struck as one).
ANNOUNCE_GRACE_S = 10
# Batches waiting for their checkpoint at once (each waits in its own task, never in the
# verify queue, so one unavailable version cannot stall the batches behind it).
MAX_PARKED = 32

# Rejections that only a dishonest worker produces; "stale" and "unverifiable" are not held against it.
CHEATING_RULES = {
    "toploc",
    "proof",
    "prompts",
    "tokens",
    "termination",
    "reward",
    "worker",
    "sampling",
    "slot",
    "run",
    "version",
}
# Accepted slots (worker, batch counter) remembered, so a second batch for one slot (the same
# counter made with another version, say) is refused: a slot is worth one batch, not a choice.
MAX_SLOTS = 100_000
# Announces queued for a fetch, remembered (worker, batch id) so a repeat is not fetched again.
MAX_SEEN = 10_000
# Batch ids whose signer a fetch proved: another peer's announce of one is refused unfetched.
MAX_SIGNERS = 10_000
# Announces of batches whose committee this validator is not on (yet), watched until their
# votes decide them or their order calls on this validator (protocol/committee.py).
MAX_STANDBY = 10_000


@dataclasses.dataclass
class _Standby:
    """An announce this validator is next in line for, should its committee fall short."""

    env: Envelope
    order: tuple[str, ...]
    position: int  # this validator's place in the batch's order (>= the committee size)
    seen: float  # trio clock when the announce arrived
    ballots: dict[str, Ballot] = dataclasses.field(default_factory=dict)


class ValidatorRole(EngineRole):
    role = "validator"

    def __init__(
        self,
        *args: Any,
        fetchers: int = 4,
        queue: int = 256,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.n_fetchers = fetchers
        self.ban_after = self.ctx.config.ban_after_rejections
        self.intake = AnnounceIntake(queue, unproven_slots=max(1, fetchers // 2), on_evicted=self._unsee)
        # fetched batches that passed every rule needing no model, waiting for a prefill:
        # announcers this validator accepted a batch of go first (intake.verify_queue)
        self._verify: FairQueue[tuple[Envelope, RolloutBatch]] = verify_queue()
        self.verdicts: collections.Counter[str] = collections.Counter()
        self.reasons: collections.Counter[str] = collections.Counter()
        self.strikes: collections.Counter[str] = collections.Counter()
        self.last_reasons: collections.deque[str] = collections.deque(maxlen=10)
        self.fetch_failures = 0
        self.verify_s = 0.0
        # CPU seconds spent replaying batches (loading their version into the engine, the
        # prefill and the rules), each counted in the thread that did it (``thread_cpu``): the
        # work committees divide among validators, as opposed to following the checkpoints,
        # which every node does (bench/committees.py)
        self.replay_cpu_s = 0.0
        self.replays = 0
        # Announces are keyed (announcer, batch id) (protocol/batches.py): one peer's announce of
        # an id never stands for another's, so a copy announced first cannot shadow the signer's.
        self._seen: collections.OrderedDict[BatchKey, None] = collections.OrderedDict()
        self._signers: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self.stolen_announces = 0  # announces of a batch another peer signed, refused unfetched
        self._slots: collections.OrderedDict[tuple[str, int], bytes] = collections.OrderedDict()
        self._parking = trio.Semaphore(MAX_PARKED)
        self._nursery: trio.Nursery | None = None
        g, cfg = self.ctx.genesis, self.ctx.config
        # committees (protocol/committee.py): batches whose committee this validator is not on
        # are watched, not fetched; it steps in when their order reaches it
        self.committee = CommitteeRule(cfg.committee_size, g.quorum, cfg.committee_deadline_s, cfg.reward_agreement)
        self._standby: collections.OrderedDict[BatchKey, _Standby] = collections.OrderedDict()
        self.committee_counts: collections.Counter[str] = collections.Counter()

    async def run(self, node: NodeServices) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self.start_common(node, nursery)
            node.gossip.on("rollout", self._on_announce)
            if not self.committee.everyone(len(self.ctx.genesis.validators)):
                node.gossip.on("vote", self._on_vote)
                nursery.start_soon(self._standby_loop)
            for _ in range(self.n_fetchers):
                nursery.start_soon(self._fetch_loop)
            nursery.start_soon(self._verify_loop)

    def _on_announce(self, env: Envelope) -> None:
        key = batch_key(env.sender, env.body)
        if self.node.standing.is_banned(env.sender) or key in self._seen:
            return
        signer = self._signers.get(env.body.batch_id)
        if signer is not None and signer != env.sender:
            # a batch this validator fetched from its signer, announced as someone else's:
            # the announcer is charged and struck without a fetch; the signer's batch is untouched
            self.stolen_announces += 1
            self.node.standing.penalise(env.sender, "batch_stolen")
            assert self._nursery is not None
            self._nursery.start_soon(self._strike, env.sender, "announced a batch signed by another peer")
            return
        if key in self._standby or self._stand_by(key, env):
            return
        self._take(key, env)

    def _take(self, key: BatchKey, env: Envelope) -> None:
        """Queue an announce for a fetch (and remember it, so a repeat is not fetched again)."""
        if self.intake.offer(env):  # seen only once queued: an announce shed by a full lane may come again
            self._seen[key] = None
            while len(self._seen) > MAX_SEEN:
                self._seen.popitem(last=False)

    # ------------------------------------------------------------ committees
    def _stand_by(self, key: BatchKey, env: Envelope) -> bool:
        """Whether this validator is off the batch's committee: then the announce is watched
        (:meth:`_standby_loop`) instead of fetched. A batch whose order is unknown here (the
        version's manifest has not arrived) is verified, as without committees."""
        if self.committee.everyone(len(self.ctx.genesis.validators)):
            return False
        ann = env.body
        order = self.committee_order(env.sender, ann.policy_version, ann.batch_counter)
        if order is None or self.node.peer_id not in order:
            return False
        position = order.index(self.node.peer_id)
        if position < self.committee.size:
            self.committee_counts["member"] += 1
            return False
        self._standby[key] = _Standby(env, order, position, trio.current_time())
        while len(self._standby) > MAX_STANDBY:
            self._standby.popitem(last=False)
        return True

    def _on_vote(self, env: Envelope) -> None:
        """A validator's vote on a batch this validator watches: it may decide the batch, or
        (members that disagree) call on the next validator at once."""
        vote: Vote = env.body
        entry = self._standby.get((vote.worker, vote.batch_id))
        if entry is None or env.sender not in entry.order:
            return
        entry.ballots.setdefault(env.sender, Ballot(vote.accept, tuple(vote.rewards)))
        self._review((vote.worker, vote.batch_id), entry)

    def _review(self, key: BatchKey, entry: _Standby) -> None:
        """Drop a watched batch its votes decided; take it once its order reaches this validator."""
        elapsed = trio.current_time() - entry.seen
        d = self.committee.outcome(entry.order, entry.ballots, elapsed, entry.env.body.num_samples)
        if d.outcome is not Quorum.PENDING:
            del self._standby[key]
            self._seen[key] = None  # decided without this validator: a re-announce is not watched again
            while len(self._seen) > MAX_SEEN:
                self._seen.popitem(last=False)
            self.committee_counts["decided_without_us"] += 1
        elif d.reach > entry.position:
            del self._standby[key]
            self.committee_counts["escalated_to_us"] += 1
            log.info(
                "batch %s: called on as validator %d of its order (%d accept, %d reject, %d silent of %d called)",
                entry.env.body.batch_id.hex()[:12],
                entry.position + 1,
                len(d.accepts),
                len(d.rejects),
                len(d.unvoted),
                d.reach,
            )
            self._take(key, entry.env)
        elif elapsed > (len(entry.order) + 1) * self.committee.deadline_s:
            del self._standby[key]  # stale watch (the batch went stale, or its worker vanished)

    async def _standby_loop(self) -> None:
        """Review watched batches a few times per deadline (a silent member is replaced by time)."""
        period = max(0.25, self.committee.deadline_s / 4)
        while True:
            await trio.sleep(period)
            for key, entry in list(self._standby.items()):
                if key in self._standby:
                    self._review(key, entry)

    def _unsee(self, env: Envelope) -> None:
        """A queued announce displaced by a sender with a smaller share: it may come again."""
        self._seen.pop(batch_key(env.sender, env.body), None)

    def _proved_signer(self, batch_id: bytes, signer: str) -> None:
        self._signers[batch_id] = signer
        self._signers.move_to_end(batch_id)
        while len(self._signers) > MAX_SIGNERS:
            self._signers.popitem(last=False)

    async def _fetch_one(self, env: Envelope) -> None:
        if self.node.standing.is_banned(env.sender):
            return
        try:
            _, batch = await self.fetch_batch(env, timeout=30.0)
        except (RequestError, ProtocolError) as exc:
            log.info("could not fetch batch %s from %s: %s", env.body.batch_id.hex()[:12], env.sender[:12], exc)
            if isinstance(exc, ProtocolError):
                await self._vote(env, BatchVerdict.reject("batch", str(exc), limit=REASON_LIMIT))
            else:
                self.fetch_failures += 1
                self.charge_unserved(env.sender, exc)
                # Not seen any more: the worker announces an undecided batch again, and a fetch
                # that timed out on a loaded link must not leave its batch without this vote for
                # good (with a quorum of every validator it stayed pending forever). Each failed
                # fetch is charged, so an announcer that never serves pays for every retry.
                self._unsee(env)
            return
        self._proved_signer(env.body.batch_id, env.sender)
        v = batch.policy_version
        stale = self._stale(v)
        if stale is not None:
            await self._vote(env, stale)
            return
        checked = v in self.store.versions  # the manifest is known: the model-free rules can run now
        if checked:
            broken = await self._check_without_model(env, batch)
            if broken is not None:
                await self._vote(env, broken)
                return
        if self.weights.held(v):
            await self._enqueue(env, batch)
        else:
            await self._parking.acquire()
            assert self._nursery is not None
            self._nursery.start_soon(self._park, env, batch, checked)

    async def _check_without_model(self, env: Envelope, batch: RolloutBatch) -> BatchVerdict | None:
        """Every rule that needs no model (``rollouts.check_batch_rules`` and the slot rule),
        run before the batch may wait for a prefill, so a batch that breaks one costs no place
        in the verify queue. Needs the manifest of the batch's version in the store."""
        slot = self._slot_verdict(env, batch)
        if slot is not None:
            return slot
        policy = PolicyFacts.of(self.store.versions[batch.policy_version].manifest)
        engine, ctx = self.engine, self.ctx

        def check() -> BatchVerdict | None:
            if engine is not None:
                vocab, eos, hidden = engine.vocab_size, engine.eos_token_ids, int(engine.lm_head_weight().shape[1])
            else:  # no verification yet built the engine: the tokenizer's view, no proof-size rule
                eos_id = ctx.eos_token_id
                vocab, eos, hidden = ctx.vocab_size, frozenset(() if eos_id is None else (eos_id,)), None
            return check_batch_rules(ctx, batch, env.sender, policy, vocab_size=vocab, eos_ids=eos, hidden_size=hidden)

        verdict = await trio.to_thread.run_sync(check)
        if verdict is None:
            return None
        return BatchVerdict.reject(verdict.rule, verdict.detail, limit=REASON_LIMIT)

    def _slot_verdict(self, env: Envelope, batch: RolloutBatch) -> BatchVerdict | None:
        """The "slot" rejection when another batch was accepted for this batch's slot."""
        used = self._slots.get((batch.worker, batch.batch_counter))
        if used is not None and used != env.body.batch_id:
            return BatchVerdict.reject(
                "slot", f"batch counter {batch.batch_counter} was used by batch {used.hex()[:12]}"
            )
        return None

    async def _enqueue(self, env: Envelope, batch: RolloutBatch) -> None:
        if not (await self._verify.put(env.sender, (env, batch))).queued:
            log.info(
                "verify queue: dropped batch %s of unproven announcer %s",
                env.body.batch_id.hex()[:12],
                env.sender[:12],
            )

    def _newest_known(self) -> int:
        """Newest version whose signed manifest we hold (complete or not)."""
        return max(self.store.versions, default=-1)

    def _stale(self, version: int) -> BatchVerdict | None:
        """The "stale" verdict when ``version`` fell out of the window of the newest known one."""
        newest, max_async = self._newest_known(), self.ctx.genesis.max_async
        if is_stale(version, newest, max_async):
            return BatchVerdict.reject("stale", f"policy version {version}, newest {newest}, max_async {max_async}")
        return None

    async def _park(self, env: Envelope, batch: RolloutBatch, checked: bool = False) -> None:
        """Wait (in its own task) for the checkpoint ``batch`` claims, fetching it on demand,
        then queue the batch for verification. A version never announced is rejected; the
        model-free rules run as soon as the version's manifest is known (unless ``checked``)."""
        v = batch.policy_version
        try:
            with trio.move_on_after(ANNOUNCE_GRACE_S):
                # the store has no event for "a manifest arrived": a manifest lands within a gossip hop
                while v not in self.store.versions and self._newest_known() < v:  # noqa: ASYNC110
                    await trio.sleep(0.25)
            if v > self._newest_known():
                await self._vote(
                    env,
                    BatchVerdict.reject(
                        "version", f"policy version {v} was never announced (newest {self._newest_known()})"
                    ),
                )
                return
            if not checked and v in self.store.versions:
                broken = await self._check_without_model(env, batch)
                if broken is not None:
                    await self._vote(env, broken)
                    return
            # (an older version we never heard announced, having joined after it, stays unverifiable)
            with trio.move_on_after(VERSION_WAIT_S if v in self.store.versions else 0):
                assert self.checkpoints is not None
                if self.checkpoints.want_version(v):
                    await self.checkpoints.wait_assembled(v)
            if not self.weights.held(v):
                self.verdicts["unverifiable"] += 1
                log.info(
                    "batch %s: checkpoint v%d not available within %ds; no vote",
                    env.body.batch_id.hex()[:12],
                    v,
                    VERSION_WAIT_S,
                )
                return
            await self._enqueue(env, batch)
        finally:
            self._parking.release()

    async def _verify_loop(self) -> None:
        while True:
            taken = await self._verify.get()
            try:
                await self._verify_one(*taken.item)
            finally:
                self._verify.done(taken)

    async def _verify_one(self, env: Envelope, batch: RolloutBatch) -> None:
        """Verify one queued batch (unless what it waited for changed) and vote."""
        if self.node.standing.is_banned(env.sender):  # banned while it waited: no prefill, no vote
            self._verify.dropped["banned"] += 1
            return
        v = batch.policy_version
        stale = self._stale(v)
        if stale is not None:  # a newer version arrived while the batch waited
            await self._vote(env, stale)
            return
        if not self.weights.held(v):
            self.verdicts["unverifiable"] += 1  # collected since it was queued
            return
        slot = (batch.worker, batch.batch_counter)
        used_slot = self._slot_verdict(env, batch)  # another batch of the slot accepted while it waited
        if used_slot is not None:
            await self._vote(env, used_slot)
            return
        state = self.store.versions.get(v)
        if state is None:  # its manifest was collected while the batch waited
            self.verdicts["unverifiable"] += 1
            return
        load0 = self.load_cpu_s
        await self._ensure_version(v)
        policy = PolicyFacts.of(state.manifest)
        assert self.engine is not None  # _ensure_version built it
        verdict, cpu = await trio.to_thread.run_sync(
            thread_cpu, functools.partial(verify_batch, self.ctx, self.engine, batch, env.sender, policy)
        )
        self.replay_cpu_s += cpu + (self.load_cpu_s - load0)
        self.replays += 1
        if verdict.accept:
            self._slots[slot] = env.body.batch_id
            while len(self._slots) > MAX_SLOTS:
                self._slots.popitem(last=False)
            self._verify.mark_proven(env.sender)
        await trio.to_thread.run_sync(release_free_memory)  # the prefill's transient tensors
        self.verify_s = round(verdict.seconds, 3)
        await self._vote(env, verdict)

    async def _ensure_version(self, version: int) -> None:
        if self.loaded_version == version:
            return
        await self.load_policy(version)
        self.loaded_version = version

    async def _vote(self, env: Envelope, verdict: BatchVerdict) -> None:
        """Gossip the signed vote; a rejection for a cheating rule is a strike against the worker."""
        ann = env.body
        vote = Vote(
            batch_id=ann.batch_id,
            worker=env.sender,
            policy_version=ann.policy_version,
            accept=verdict.accept,
            reason="" if verdict.accept else (verdict.reason or "rejected")[:256],
            rewards=tuple(float(r) for r in verdict.rewards),
        )
        await self.node.gossip.publish(vote)
        self.verdicts["accept" if verdict.accept else "reject"] += 1
        if verdict.accept:
            return
        self.reasons[verdict.rule] += 1
        self.last_reasons.append(f"{env.sender[:12]}: {verdict.reason[:120]}")
        log.warning("rejected batch %s from %s: %s", ann.batch_id.hex()[:12], env.sender, verdict.reason)
        if verdict.rule in CHEATING_RULES or verdict.rule == "batch":
            await self._strike(env.sender, verdict.reason)

    async def _strike(self, peer: str, reason: str) -> None:
        """A cheating strike against ``peer``; ``ban_after`` of them ban it network-wide."""
        self._verify.forget(peer)  # its next batches queue as a stranger's
        if peer not in self.strikes and len(self.strikes) >= 10_000:
            del self.strikes[min(self.strikes, key=lambda p: self.strikes[p])]  # bounded: forget the mildest
        self.strikes[peer] += 1
        if self.strikes[peer] >= self.ban_after and not self.node.standing.is_banned(peer):
            await self.publish_ban(peer, f"{self.strikes[peer]} rejected batches, last: {reason}")
            self._verify.discard(peer)

    def heartbeat_fields(self) -> dict[str, Any]:
        return {**super().heartbeat_fields(), "batches": sum(self.verdicts.values())}

    def status(self) -> dict[str, Any]:
        return {
            "policy_version": self.loaded_version,
            "verdicts": dict(self.verdicts),
            "reasons": dict(self.reasons),
            "recent_rejections": list(self.last_reasons),
            "strikes": dict(self.strikes),
            "queued": len(self.intake),
            "dropped_announces": self.dropped_announces,
            "stolen_announces": self.stolen_announces,
            # committees: batches verified as a member / as an escalation, left to their committee
            "committee": {**self.committee_counts, "watching": len(self._standby)},
            # batches waiting for a prefill, and those dropped (unproven lane full, per-announcer cap, banned)
            "verify_queue": self._verify.status(),
            "dropped_batches": sum(self._verify.dropped.values()),
            "last_verify_s": self.verify_s,
            "replays": self.replays,
            "replay_cpu_s": round(self.replay_cpu_s, 3),
            "policy_loads": dict(self.policy_loads),
            "distribution": self.checkpoints_status(),
        }
