"""Trainer, workers and validators on real libp2p hosts in one trio process (tiny model)."""

from __future__ import annotations

import pytest
import trio

from harness.genesis import tiny_genesis
from harness.network import start_network
from harness.roles import homes
from node.p2p.testing import wait_until
from node.roles.worker import WorkerRole


async def test_network_advances_versions_with_quorum_admission(tmp_path):
    genesis = tiny_genesis(steps=3, batches_per_step=1)
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            _net, trainer, validators, workers = await start_network(nursery, tmp_path, genesis)
            await wait_until(lambda: trainer.version >= 3, 200, poll=0.2, what="three trainer steps")
            admitted = trainer.ledger.admitted_ids()
            assert admitted
            for b in admitted:
                assert len(trainer.ledger.accept_voters(b)) >= genesis.genesis.quorum
            # workers hot-reload new versions; every validator voted
            await wait_until(lambda: all(w.loaded_version >= 1 for w in workers), 60, what="workers on a new version")
            assert all(v.verdicts["accept"] >= 1 for v in validators)
            # a worker's status counts batches (a quorum of accepts), not votes
            await wait_until(
                lambda: sum(w.stats["batches_accepted"] for w in workers) >= 1,
                30,
                what="a worker to see a quorum of accepts on a batch",
            )
            for w in workers:
                assert w.stats["batches_accepted"] + w.stats["batches_rejected"] <= w.stats["batches_produced"]
                assert w.stats["accept_votes"] >= genesis.genesis.quorum * w.stats["batches_accepted"]
            metrics = trainer.home.metrics_path
            await wait_until(lambda: len(metrics.read_text().splitlines()) >= 3, 30, what="three metrics lines")
            nursery.cancel_scope.cancel()


# Each cheat, the rule (rollouts.verify_batch / the validator) its batches must be refused by.
CHEAT_RULES = {
    "weights": {"toploc"},  # generated with other weights: the proofs do not match the prefill
    "tokens": {"tokens", "toploc"},  # claims tokens it did not generate
    "prompts": {"prompts"},  # answers prompts it was not assigned
    "rewards": {"reward"},  # claims rewards the rules do not give
    "version": {"version"},  # signs batches as a policy version nobody announced
    # decodes greedily, claims the run's temperature: not the seeded samples; where the first
    # token off the seeded sample is an EOS (greedy stopped, or the seeded sample stops), the
    # replay names it "termination" (node/roles/rollouts.py), a chance per batch
    "greedy": {"sampling", "termination"},
}
# "grind" skips batch counters looking for easy prompts: its batches are real work that
# validators accept, but a worker's counters form one chain (protocol.rules.counter_gap),
# so the trainer's ledger never trains one: they wait for counter 0 for good.


def votes_on(trainer, batch_ids):
    """(batch, validator, accept, rule) of every vote the trainer's ledger holds on ``batch_ids``."""
    out = []
    for b in batch_ids:
        for v in trainer.ledger.votes(b):
            # the wire carries the reason as "rule: detail" text; the rule is its first word
            out.append((b, v.validator, v.accept, v.reason.split(":", 1)[0] if v.reason else ""))
    return out


@pytest.mark.slow  # ~40-190 s on two quiet cores: the slow tier (README)
async def test_cheating_workers_are_refused_and_banned_while_training_continues(tmp_path):
    from protocol import NodeKey

    genesis = tiny_genesis(steps=3, batches_per_step=1)
    with trio.fail_after(900):
        async with trio.open_nursery() as nursery:
            net, trainer, validators, workers = await start_network(nursery, tmp_path, genesis, worker_tamper=(None,))
            ctx = trainer.ctx
            cheats = {}
            for i, mode in enumerate(CHEAT_RULES):
                key = NodeKey(bytes([0x40 + i]) * 32)
                w = WorkerRole(homes(tmp_path, f"cheat-{mode}"), ctx, tamper=mode)
                cheats[mode] = (key.peer_id, w)
                await net.start(hook=w, key=key)
            grinder = WorkerRole(homes(tmp_path, "cheat-grind"), ctx, tamper="grind")
            await net.start(hook=grinder, key=NodeKey(bytes([0x40 + len(CHEAT_RULES)]) * 32))
            banned_modes = ["weights", "tokens", "prompts", "version", "greedy"]

            def unbanned() -> dict[str, list[int]]:
                """Each cheat some validator has not banned yet: its strikes at each validator."""
                return {
                    m: [v.strikes[cheats[m][0]] for v in validators]
                    for m in banned_modes
                    if not all(v.node.standing.is_banned(cheats[m][0]) for v in validators)
                }

            try:  # a hang guard: the bans come as fast as the cheats' batches (one CI run took > 180 s)
                await wait_until(lambda: not unbanned(), 360, poll=0.5, what="every cheat banned")
            except trio.TooSlowError:
                raise AssertionError(f"not banned by every validator (strikes per validator): {unbanned()}") from None

            # Why: every vote on a cheat's batches is a rejection naming the rule that cheat
            # breaks ("stale" aside: a batch can also age out while it waits). The votes reach
            # the trainer by gossip, so wait until each cheat has one.
            def explained(mode: str) -> bool:
                return any(rule in CHEAT_RULES[mode] for *_, rule in votes_on(trainer, list(cheats[mode][1].batches)))

            await wait_until(
                lambda: all(explained(m) for m in cheats),
                120,
                poll=0.5,
                what="a vote naming each cheat's rule at the trainer",
            )
            # the ban notices reach the trainer too (network-wide; gossip takes a moment,
            # longer when a ban just cut a tree link and GRAFT has to repair it)
            await wait_until(
                lambda: all(trainer.node.standing.is_banned(cheats[m][0]) for m in banned_modes),
                30,
                poll=0.2,
                what="the ban notices at the trainer",
            )

            # the grinder's batches reach the ledger and wait there for the counter it skipped
            def grinder_waits() -> bool:
                recs = [trainer.ledger.batch(b) for b in grinder.batches]
                return any(r is not None and r.reason == "waiting for the worker's batch counter 0" for r in recs)

            await wait_until(grinder_waits, 120, poll=0.5, what="a grinder batch waiting for counter 0")
            # Banned cheats would keep generating for nobody, on the two cores the honest
            # nodes share: stop them, then training must go on.
            for mode, (_pid, w) in [*cheats.items(), ("grind", (None, grinder))]:
                assert w.stats["batches_produced"] >= 1, mode
                net.kill(w.node)
            await wait_until(lambda: trainer.version >= 3, 240, poll=0.5, what="three honest trainer steps")

            admitted_workers = {trainer.ledger.batch(b).worker for b in trainer.ledger.admitted_ids()}
            assert admitted_workers == {workers[0].node.peer_id}
            for mode, (_pid, w) in cheats.items():
                votes = votes_on(trainer, list(w.batches))
                assert not any(accept for _, _, accept, _ in votes), (mode, votes)
                rules = {rule for *_, rule in votes}
                assert rules <= CHEAT_RULES[mode] | {"stale"}, (mode, rules)
            # the validators' own books say the same
            for rule in ("toploc", "prompts", "reward", "version", "sampling"):
                assert sum(v.reasons[rule] for v in validators) >= 1, (rule, [dict(v.reasons) for v in validators])
            assert all(v.verdicts["accept"] >= 1 for v in validators)  # honest batches still pass
            nursery.cancel_scope.cancel()


async def test_rollouts_older_than_max_async_are_refused_as_stale(tmp_path):
    """A worker stuck on the first version it loaded keeps producing for it: once the
    trainer is more than max_async versions ahead, every validator votes 'stale', the
    trainer never admits those batches, and nobody bans the worker (slow is not cheating).
    The first version it loads is usually 0, sometimes 1 (the trainer may publish 1 before
    the worker has fetched 0): the checks follow whichever it was."""
    # a short idle: once the trainer stops publishing, the stuck worker's next slot opens soon
    genesis = tiny_genesis(steps=6, batches_per_step=1, worker_idle_s=3)
    max_async = genesis.genesis.max_async
    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            _net, trainer, validators, workers = await start_network(
                nursery, tmp_path, genesis, worker_tamper=(None, "stale")
            )
            honest, stuck = workers
            validator_ids = {v.node.peer_id for v in validators}
            await wait_until(lambda: stuck.loaded_version >= 0, 120, poll=0.2, what="the stuck worker's first load")
            pinned = stuck.loaded_version

            def refused_by_all() -> list[bytes]:
                """The stuck worker's batches with a 'stale' vote from every validator."""
                by_batch: dict[bytes, set[str]] = {}
                for b, validator, accept, rule in votes_on(trainer, list(stuck.batches)):
                    if not accept and rule == "stale":
                        by_batch.setdefault(b, set()).add(validator)
                return [b for b, vs in by_batch.items() if vs == validator_ids]

            await wait_until(
                lambda: trainer.version > pinned + max_async and refused_by_all(),
                270,
                poll=0.5,
                what="a stale batch refused by every validator",
            )
            # the honest worker hot-reloads between batches: it may still be on an older version here
            await wait_until(
                lambda: honest.loaded_version > pinned + max_async,
                120,
                poll=0.2,
                what="the honest worker on a version beyond the stuck one's window",
            )
            assert stuck.loaded_version == pinned

            def ledger_status(b: bytes) -> str | None:
                rec = trainer.ledger.batch(b)
                return rec.status if rec is not None else None

            refused = refused_by_all()
            await wait_until(
                lambda: all(ledger_status(b) == "rejected" for b in refused),
                30,
                poll=0.2,
                what="the trainer's ledger to reject the stale batches",
            )
            for b in refused:
                rec = trainer.ledger.batch(b)
                assert rec.policy_version == pinned and "stale" in rec.reason, rec
            for b, _validator, _accept, rule in votes_on(trainer, list(stuck.batches)):
                if rule == "stale":
                    assert (ledger_status(b) or "pending") != "admitted"
            vote_reasons = [v.reason for v in trainer.ledger.votes(refused[0])]
            assert all(
                r.startswith(f"stale: policy version {pinned},") and f"max_async {max_async}" in r for r in vote_reasons
            )
            # what the trainer did admit had its quorum
            for b in trainer.ledger.admitted_ids():
                assert len(trainer.ledger.accept_voters(b)) >= genesis.genesis.quorum
            assert all(v.reasons["stale"] >= 1 for v in validators)
            assert not any(v.node.standing.is_banned(stuck.node.peer_id) for v in validators)
            assert stuck.stats["batches_rejected"] >= len(refused)
            nursery.cancel_scope.cancel()
