"""Trainer, workers and validators on real libp2p hosts in one trio process (tiny model)."""

from __future__ import annotations

import trio

from node.home import NodeHome
from node.p2p.testing import NodeFactory, wait_until
from node.roles.context import RunContext
from node.roles.trainer import TrainerRole
from node.roles.validator import ValidatorRole
from node.roles.worker import WorkerRole

from .roles_support import TRAINER, VALIDATORS, WORKERS, tiny_genesis


def homes(tmp_path, name):
    h = NodeHome(tmp_path / name)
    h.path.mkdir(parents=True, exist_ok=True)
    return h


async def start_network(nursery, tmp_path, genesis, worker_tamper=(None, None), steps=3):
    ctx = RunContext.from_genesis(genesis.genesis, tmp_path / "cache")
    # Production heartbeat interval: every node of this in-process network shares two cores,
    # and flooding 0.5 s heartbeats from ten nodes starves the model threads of the GIL.
    net = NodeFactory(nursery, genesis=genesis, heartbeat_interval_s=2.0, forget_after_s=15.0)
    await net.start()  # bootstrap
    trainer = TrainerRole(homes(tmp_path, "trainer"), ctx)
    await net.start(hook=trainer, key=TRAINER)
    validators = []
    for i, k in enumerate(VALIDATORS):
        v = ValidatorRole(homes(tmp_path, f"validator-{i}"), ctx)
        validators.append(v)
        await net.start(hook=v, key=k)
    workers = []
    for i, (k, tamper) in enumerate(zip(WORKERS, worker_tamper)):
        w = WorkerRole(homes(tmp_path, f"worker-{i}"), ctx, tamper=tamper)
        workers.append(w)
        await net.start(hook=w, key=k)
    return net, trainer, validators, workers


async def test_network_advances_versions_with_quorum_admission(tmp_path):
    genesis = tiny_genesis(steps=3, batches_per_step=1)
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            net, trainer, validators, workers = await start_network(nursery, tmp_path, genesis)
            await wait_until(lambda: trainer.version >= 3, 200, poll=0.2, what="three trainer steps")
            admitted = trainer.ledger.admitted_ids()
            assert admitted
            for b in admitted:
                assert len(trainer.ledger.accept_voters(b)) >= genesis.genesis.quorum
            # workers hot-reload new versions; every validator voted
            await wait_until(lambda: all(w.loaded_version >= 1 for w in workers), 60, what="workers on a new version")
            assert all(v.verdicts["accept"] >= 1 for v in validators)
            metrics = trainer.home.path / "metrics.jsonl"
            await wait_until(lambda: len(metrics.read_text().splitlines()) >= 3, 30, what="three metrics lines")
            nursery.cancel_scope.cancel()


async def test_cheating_workers_are_refused_and_banned_while_training_continues(tmp_path):
    from protocol import NodeKey

    genesis = tiny_genesis(steps=3, batches_per_step=1)
    tampers = ["weights", "tokens", "prompts", "rewards"]
    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            net, trainer, validators, workers = await start_network(nursery, tmp_path, genesis,
                                                                    worker_tamper=(None,))
            ctx = trainer.ctx
            cheats = {}
            for i, mode in enumerate(tampers):
                key = NodeKey(bytes([0x40 + i]) * 32)
                w = WorkerRole(homes(tmp_path, f"cheat-{mode}"), ctx, tamper=mode)
                cheats[mode] = (key.peer_id, w)
                await net.start(hook=w, key=key)
            await wait_until(lambda: trainer.version >= 3, 240, poll=0.2, what="three honest trainer steps")
            banned_modes = ["weights", "tokens", "prompts"]
            await wait_until(
                lambda: all(all(v.node.policy.is_banned(cheats[m][0]) for v in validators) for m in banned_modes),
                60, poll=0.2, what="the cheating workers banned by every validator")
            admitted_workers = {
                row[0] for row in trainer.ledger.db.execute("SELECT worker FROM batches WHERE status = 'admitted'")
            }
            assert admitted_workers == {workers[0].node.peer_id}
            for mode, (pid, w) in cheats.items():
                assert w.stats["batches_produced"] >= 1, mode
                assert pid not in admitted_workers
            # the ban notice reaches the trainer too (network-wide; gossip takes a moment,
            # longer when a ban just cut a tree link and GRAFT has to repair it)
            await wait_until(lambda: all(trainer.node.policy.is_banned(cheats[m][0]) for m in banned_modes),
                             30, poll=0.2, what="the ban notices at the trainer")
            nursery.cancel_scope.cancel()
