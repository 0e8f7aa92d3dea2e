"""Swarm distribution: six nodes, only the trainer holds a 64 MiB checkpoint at the start.

``test_six_nodes_one_seeder`` runs six stores, chunk servers and fetchers in one
process over real TCP, with tickets granted in-process (LocalControlPlane): the
ticket step is a few bytes, and py-libp2p request/response on a freshly
connected 6-node overlay takes 1-5 s per new stream here, which would test the
overlay rather than the swarm.  ``test_libp2p_overlay_end_to_end`` runs the
same path through real libp2p nodes: the announce over gossip, have-sets in
heartbeats, tickets over request/response.

The seeder must upload about one copy (super-seeding), not five.

Every node's upload is capped at 200 Mbit/s (as on home links): uncapped on
loopback the seeder pushes 64 MiB to everyone before the fetchers have
exchanged a single have-set, which is not the situation under test.
"""

from __future__ import annotations

import trio
from safetensors.numpy import load_file

from harness.checkpoints import RUN_ID, keys, make_checkpoint, same_files
from node.checkpoints import Checkpoints, ChunkStore, LocalControlPlane

CAP_MBPS = 200.0


async def test_six_nodes_one_seeder(tmp_path):
    src = make_checkpoint(tmp_path / "ckpt", 64, seed=1)
    ks = keys(6)
    trainer = ks[0]
    servers: dict = {}
    dists = []
    for i, k in enumerate(ks):
        store = ChunkStore(tmp_path / f"node{i}", RUN_ID, trainer.peer_id)
        d = Checkpoints(store, LocalControlPlane(k.peer_id, servers), max_upload_mbps=CAP_MBPS)
        servers[k.peer_id] = d.server
        dists.append(d)
    progress = []
    dists[1].progress_callbacks.append(progress.append)
    async with trio.open_nursery() as nursery:
        for d in dists:
            await nursery.start(d.run)
        raw = await dists[0].import_version(trainer, 1, src, chunk_size=1 << 20)
        for d, k in zip(dists[1:], ks[1:]):
            for other in ks:
                if other is not k:
                    d.add_peer(other.peer_id)  # as heartbeats would
            assert d.on_announce(raw) == 1
        with trio.fail_after(120):
            for d in dists[1:]:
                await d.wait_version(1)
        nursery.cancel_scope.cancel()

    manifest = dists[0].store.get(1).manifest
    total = manifest.total_bytes
    for d in dists:
        with d.open_version(1) as files:
            assert sorted(files) == sorted(f.path for f in manifest.files)
            for path in files.values():
                assert load_file(str(path))  # loadable safetensors
        assert same_files(src, d.store.files_dir(1))  # byte-identical to the trainer's
    seeder = dists[0].server.bytes_served
    # super-seeding: the seeder sends each chunk about once (1.00 copies in every run seen;
    # 1.7-1.8 with super-seeding off), the fetchers multiply it among themselves
    assert seeder <= 1.2 * total, f"the seeder served {seeder / total:.2f} copies"
    assert sum(d.server.bytes_served for d in dists[1:]) > 2.5 * total  # fetchers fed each other
    for d in dists[1:]:
        st = d.status()["versions"][0]
        assert st["chunks_held"] == st["chunks_total"] == manifest.num_chunks
        assert st["bytes_fetched"] == total
        assert len(st["fed_from"]) >= 3
    assert progress[-1].done and progress[-1].held == progress[-1].total == manifest.num_chunks


async def test_libp2p_overlay_end_to_end(tmp_path):
    from harness.genesis import overlay_genesis
    from node.p2p.node import RoleHook
    from node.p2p.testing import NodeFactory, wait_until
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
            store = ChunkStore(self.home, node.run_id, node.genesis.trainer)
            self.checkpoints = Checkpoints(
                store, P2PControlPlane(node), max_async=node.genesis.max_async, max_upload_mbps=CAP_MBPS
            )
            async with trio.open_nursery() as n:
                await n.start(serve_checkpoints, node, self.checkpoints)
                self.started.set()

        def heartbeat_fields(self):
            return checkpoint_heartbeat_fields(self.checkpoints) if self.checkpoints is not None else {}

    src = make_checkpoint(tmp_path / "ckpt", 16, seed=2)
    trainer_key = keys(1)[0]
    genesis = overlay_genesis(owner=trainer_key, trainer=trainer_key, chunk_size=1 << 20)
    hooks = [CheckpointsHook(tmp_path / f"node{i}", "trainer" if i == 0 else "worker") for i in range(3)]
    async with trio.open_nursery() as nursery:
        net = NodeFactory(nursery, genesis=genesis)
        nodes = [await net.start(hook=hooks[0], key=trainer_key)]
        for h in hooks[1:]:
            nodes.append(await net.start(hook=h))
        await net.wait_connected(min_peers=2, timeout=60)
        for h in hooks:
            await h.started.wait()
        await publish_checkpoint(nodes[0], hooks[0].checkpoints, 1, src)  # gossip announce
        with trio.fail_after(120):
            for h in hooks[1:]:
                await h.checkpoints.wait_version(1)
        for h in hooks:
            assert same_files(src, h.checkpoints.store.files_dir(1))
        # tickets went over libp2p request/response
        assert hooks[0].checkpoints.server.tickets_granted >= 2
        await wait_until(
            lambda: all(
                (s := nodes[0].swarm.get(n.peer_id)) is not None and s.heartbeat.policy_version == 1 for n in nodes[1:]
            ),
            timeout=30,
            what="heartbeats to show version 1",
        )
        nursery.cancel_scope.cancel()
