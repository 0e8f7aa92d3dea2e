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
    net = NodeFactory(nursery, genesis=genesis)
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
            assert all(w.loaded_version >= 1 for w in workers)
            assert all(v.verdicts["accept"] >= 1 for v in validators)
            lines = (trainer.home.path / "metrics.jsonl").read_text().splitlines()
            assert len(lines) >= 3
            nursery.cancel_scope.cancel()
