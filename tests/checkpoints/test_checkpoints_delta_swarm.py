"""A late joiner catches up on a delta chain through real libp2p hosts, with the trainer
gone: it learns the newest version from its peers' heartbeats, asks them for the trainer's
signed announces (``ManifestRequest``) down to the anchor, fetches the anchor and every
delta after it from them over the data plane and applies the chain to the exact bytes.
"""

from __future__ import annotations

import pytest
import trio

from harness.checkpoints import keys
from harness.deltas import equal_dirs, make_versions
from harness.genesis import overlay_genesis
from node.checkpoints import Checkpoints, ChunkStore
from node.p2p.node import RoleHook
from node.p2p.testing import NodeFactory
from node.roles.checkpoint_wiring import (
    P2PControlPlane,
    checkpoint_heartbeat_fields,
    publish_checkpoint,
    serve_checkpoints,
)


class CheckpointsHook(RoleHook):
    def __init__(self, home, role):
        self.home, self.role, self.checkpoints = home, role, None
        self.started = trio.Event()

    async def run(self, node):
        store = ChunkStore(self.home, node.run_id, node.genesis.trainer, durable=False)
        self.checkpoints = Checkpoints(store, P2PControlPlane(node), max_async=node.genesis.max_async)
        async with trio.open_nursery() as n:
            await n.start(serve_checkpoints, node, self.checkpoints)
            self.started.set()

    def heartbeat_fields(self):
        return checkpoint_heartbeat_fields(self.checkpoints) if self.checkpoints is not None else {}


@pytest.mark.slow  # ~20 s on two quiet cores: the slow tier (README)
async def test_late_joiner_fetches_anchor_and_delta_chain_from_peers_not_the_trainer(tmp_path):
    srcs = make_versions(tmp_path / "src", 4, seed=11)
    trainer_key = keys(1)[0]
    genesis = overlay_genesis(
        owner=trainer_key, trainer=trainer_key, chunk_size=64 * 1024, config_toml="anchor_every = 10\n"
    )
    hooks = [CheckpointsHook(tmp_path / f"node{i}", "trainer" if i == 0 else "worker") for i in range(4)]
    async with trio.open_nursery() as nursery:
        net = NodeFactory(nursery, genesis=genesis)
        await net.start()  # the bootstrap
        trainer = await net.start(hook=hooks[0], key=trainer_key)
        for h in hooks[1:3]:
            await net.start(hook=h)
        await net.wait_connected(min_peers=2, timeout=60)
        for h in hooks[:3]:
            await h.started.wait()
        for v, src in enumerate(srcs):
            await publish_checkpoint(trainer, hooks[0].checkpoints, v, src)  # gossip announce
            with trio.fail_after(60):
                for h in hooks[1:3]:
                    await h.checkpoints.wait_assembled(v)
        kinds = [hooks[0].checkpoints.store.get(v).delta is None for v in range(4)]
        assert kinds == [True, False, False, False]  # anchor 0, deltas 1..3

        net.kill(trainer)  # from here on nobody can ask the trainer anything
        late = hooks[3]
        await net.start(hook=late)
        await late.started.wait()
        with trio.fail_after(90):
            assert await late.checkpoints.wait_outcome(3) is None
        nursery.cancel_scope.cancel()

    c = late.checkpoints
    with c.open_version(3) as files:
        assert equal_dirs(srcs[3], files["model.safetensors"].parent)
    assert sorted(c.store.versions) == [0, 1, 2, 3]  # the anchor and the chain after it
    assert c.store.get(0).delta is None and c.deltas_applied == 3
    fed = {p for h in c.fetch_history.values() for p in h.get("fed_from", [])}
    assert fed and trainer_key.peer_id not in fed
    assert fed <= {n.peer_id for n in net.nodes}  # the two workers (and nobody else)
