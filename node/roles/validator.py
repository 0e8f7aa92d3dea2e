"""The validator: fetch each announced batch, check it (owed prompts, TOPLOC against
its own prefill with the same policy version, rule rewards), gossip a signed vote,
and ban workers that keep cheating."""

from __future__ import annotations

import collections
import functools
import logging
from typing import Any

import trio

from node.memory import release_free_memory
from node.p2p.reqresp import RequestError
from node.roles.common import AnnounceIntake, EngineRole
from node.roles.rollouts import REASON_LIMIT, BatchVerdict, PolicyFacts, verify_batch
from protocol import Envelope, ProtocolError, RolloutBatch, Vote
from protocol.rules import is_stale

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
    "counter",
    "slot",
    "run",
    "version",
}
# Accepted slots (worker, version, batch counter) remembered, so a second batch for one slot
# is refused: a slot is worth one batch, not a choice among several.
MAX_SLOTS = 100_000


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
        self.ban_after = int(self.ctx.config.get("ban_after_rejections", 2))
        self.intake = AnnounceIntake(queue, unproven_slots=max(1, fetchers // 2))
        self._verify_in, self._verify_out = trio.open_memory_channel[tuple[Envelope, RolloutBatch]](16)
        self.verdicts: collections.Counter[str] = collections.Counter()
        self.reasons: collections.Counter[str] = collections.Counter()
        self.strikes: collections.Counter[str] = collections.Counter()
        self.last_reasons: collections.deque[str] = collections.deque(maxlen=10)
        self.fetch_failures = 0
        self.verify_s = 0.0
        self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._slots: collections.OrderedDict[tuple[str, int, int], bytes] = collections.OrderedDict()
        self._parking = trio.Semaphore(MAX_PARKED)
        self._nursery: trio.Nursery | None = None

    async def run(self, node: Any) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self.start_common(node, nursery)
            node.gossip.on("rollout", self._on_announce)
            for _ in range(self.n_fetchers):
                nursery.start_soon(self._fetch_loop)
            nursery.start_soon(self._verify_loop)

    def _on_announce(self, env: Envelope) -> None:
        if self.node.policy.is_banned(env.sender) or env.body.batch_id in self._seen:
            return
        self.intake.offer(env, on_admitted=lambda: self._remember(env.body.batch_id))

    def _remember(self, batch_id: bytes) -> None:
        self._seen[batch_id] = None
        while len(self._seen) > 10_000:
            self._seen.popitem(last=False)

    async def _fetch_one(self, env: Envelope) -> None:
        if self.node.policy.is_banned(env.sender):
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
            return
        stale = self._stale(batch.policy_version)
        if stale is not None:
            await self._vote(env, stale)
        elif self.weights.held(batch.policy_version):
            await self._verify_in.send((env, batch))
        else:
            await self._parking.acquire()
            assert self._nursery is not None
            self._nursery.start_soon(self._park, env, batch)

    def _newest_known(self) -> int:
        """Newest version whose signed manifest we hold (complete or not)."""
        return max(self.store.versions, default=-1)

    def _stale(self, version: int) -> BatchVerdict | None:
        """The "stale" verdict when ``version`` fell out of the window of the newest known one."""
        newest, max_async = self._newest_known(), self.ctx.genesis.max_async
        if is_stale(version, newest, max_async):
            return BatchVerdict.reject("stale", f"policy version {version}, newest {newest}, max_async {max_async}")
        return None

    async def _park(self, env: Envelope, batch: RolloutBatch) -> None:
        """Wait (in its own task) for the checkpoint ``batch`` claims, fetching it on demand,
        then queue the batch for verification. A version never announced is rejected."""
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
            await self._verify_in.send((env, batch))
        finally:
            self._parking.release()

    async def _verify_loop(self) -> None:
        async for env, batch in self._verify_out:
            v = batch.policy_version
            stale = self._stale(v)
            if stale is not None:  # a newer version arrived while the batch waited
                await self._vote(env, stale)
                continue
            if not self.weights.held(v):
                self.verdicts["unverifiable"] += 1  # collected since it was queued
                continue
            slot = (batch.worker, v, batch.batch_counter)
            used = self._slots.get(slot)
            if used is not None and used != env.body.batch_id:
                await self._vote(
                    env,
                    BatchVerdict.reject(
                        "slot", f"version {v} counter {batch.batch_counter} was used by batch {used.hex()[:12]}"
                    ),
                )
                continue
            state = self.store.versions.get(v)
            if state is None:  # its manifest was collected while the batch waited
                self.verdicts["unverifiable"] += 1
                continue
            await self._ensure_version(v)
            policy = PolicyFacts.of(state.manifest)
            verdict = await trio.to_thread.run_sync(
                functools.partial(verify_batch, self.ctx, self.engine, batch, env.sender, policy)
            )
            if verdict.accept:
                self._slots[slot] = env.body.batch_id
                while len(self._slots) > MAX_SLOTS:
                    self._slots.popitem(last=False)
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
            if env.sender not in self.strikes and len(self.strikes) >= 10_000:
                del self.strikes[min(self.strikes, key=lambda peer: self.strikes[peer])]  # bounded: forget the mildest
            self.strikes[env.sender] += 1
            if self.strikes[env.sender] >= self.ban_after and not self.node.policy.is_banned(env.sender):
                await self.publish_ban(
                    env.sender, f"{self.strikes[env.sender]} rejected batches, last: {verdict.reason}"
                )

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
            "last_verify_s": self.verify_s,
            "distribution": self.checkpoints_status(),
        }
