"""In-process networks of real roles over real libp2p hosts, shared by the role tests, the
evaluation tests and the js-libp2p interop tests."""

from __future__ import annotations

from harness.genesis import TRAINER, VALIDATORS, WORKERS
from harness.roles import homes
from node.p2p.testing import NodeFactory
from node.roles.context import RunContext
from node.roles.trainer import TrainerRole
from node.roles.validator import ValidatorRole
from node.roles.worker import WorkerRole


async def start_network(nursery, tmp_path, genesis, worker_tamper=(None, None), steps=3):
    ctx = RunContext.from_genesis(genesis.genesis, tmp_path / "cache")
    # Production heartbeat interval: every node of this in-process network shares two cores,
    # and flooding 0.5 s heartbeats from ten nodes starves the model threads of the GIL. For
    # the same reason a dial may wait on a busy process longer than fast_config's 3 s.
    net = NodeFactory(nursery, genesis=genesis, heartbeat_interval_s=2.0, forget_after_s=15.0, dial_timeout_s=10.0)
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


def record_charges(nodes) -> list[tuple[str, str, str]]:
    """(charging node, charged peer, reason) of every ``policy.penalise`` at ``nodes``."""
    charges: list[tuple[str, str, str]] = []
    for n in nodes:
        real = n.standing.penalise

        def penalise(peer_id, reason, points=None, _real=real, _me=n.peer_id):
            charges.append((_me, peer_id, reason))
            return _real(peer_id, reason, points)

        n.standing.penalise = penalise
    return charges
