"""A node that serves corrupt chunks is detected, banned, and everyone still completes."""

from __future__ import annotations

import os

import trio

from harness.checkpoints import RUN_ID, keys, make_checkpoint, same_files
from node.checkpoints import Checkpoints, ChunkStore, LocalControlPlane
from node.checkpoints.server import ChunkServer
from node.checkpoints.wire import send_all
from protocol import chunk_frames as F


class CorruptServer(ChunkServer):
    """Serves every chunk with the right length but flipped bytes."""

    async def _send_chunk(self, sock, st, idx, peer):
        data = bytearray(self.store.read_chunk_blocking(st, idx))
        data[len(data) // 2] ^= 0xFF
        await send_all(sock, F.REPLY.pack(F.OP_GET, F.OK, idx, len(data)) + bytes(data), self.stall_timeout_s)
        self.bytes_served += len(data)


async def test_corrupt_server_is_banned_and_everyone_completes(tmp_path):
    src = make_checkpoint(tmp_path / "ckpt", 16, seed=3)
    ks = keys(5)
    trainer, bad = ks[0], ks[1]
    servers: dict = {}
    overlays = {}
    dists = []
    for i, k in enumerate(ks):
        store = ChunkStore(tmp_path / f"node{i}", RUN_ID, trainer.peer_id)
        overlays[k.peer_id] = LocalControlPlane(k.peer_id, servers)
        d = Checkpoints(store, overlays[k.peer_id], max_upload_mbps=100.0)
        if k is bad:
            d.server = CorruptServer(store, max_upload_mbps=0)
        servers[k.peer_id] = d.server
        dists.append(d)
    async with trio.open_nursery() as nursery:
        for d in dists:
            await nursery.start(d.run)
        # the corrupt node holds the whole checkpoint (so it advertises everything)
        raw = await dists[0].import_version(trainer, 1, src, chunk_size=1 << 20)
        dists[1].store.add_announce(raw)
        for h in dists[0].store.get(1).by_hash:
            dists[1].store.write_object_blocking(h, dists[0].store.read_object_blocking(h))
            dists[1].store.mark_held(h)
        for d, k in zip(dists[2:], ks[2:]):
            for other in ks:
                if other is not k:
                    d.add_peer(other.peer_id)
            d.on_announce(raw)
        with trio.fail_after(120):
            for d in dists[2:]:
                await d.wait_version(1)
        nursery.cancel_scope.cancel()

    for d, k in zip(dists[2:], ks[2:]):
        assert same_files(src, d.store.files_dir(1))
        hist = d.fetch_history[1]
        ov = overlays[k.peer_id]
        if hist["chunks_rejected"]:  # everyone who met the corrupt node banned it
            assert bad.peer_id in ov.banned and bad.peer_id in d.banned
            assert ov.penalties[(bad.peer_id, "bad_chunk")] >= 3
        assert bad.peer_id not in hist["fed_from"]
        assert not any(pid != bad.peer_id for pid, _ in ov.penalties if _ == "bad_chunk")
    assert sum(d.fetch_history[1]["chunks_rejected"] for d in dists[2:]) >= 3
    # nothing corrupt reached a store: every chunk range of every file matches its hash
    for d in dists[2:]:
        st = d.store.get(1)
        for i in range(len(st.chunks)):
            import hashlib

            assert hashlib.sha256(d.store.read_chunk_blocking(st, i)).digest() == st.chunks[i][3]
    assert not any(os.listdir(d.store.tmp) for d in dists)
