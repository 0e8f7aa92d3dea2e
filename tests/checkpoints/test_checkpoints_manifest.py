"""Manifests only from the run's trainer; chunks of the wrong size or hash refused."""

from __future__ import annotations

import hashlib

import pytest
import trio

from harness.checkpoints import RUN_ID, keys, make_checkpoint
from node.checkpoints import (
    ChunkRejected,
    ChunkStore,
    DataConnection,
    DataPlaneError,
    LocalControlPlane,
    VersionFetcher,
    build_manifest,
    sign_announce,
)
from node.checkpoints.server import ChunkServer
from node.checkpoints.wire import send_all
from protocol import ChunkTicketRequest, ProtocolError
from protocol import chunk_frames as F


def test_manifest_signed_by_non_trainer_is_refused(tmp_path):
    src = make_checkpoint(tmp_path / "ckpt", 2, seed=4)
    trainer, mallory = keys(2)
    store = ChunkStore(tmp_path / "node", RUN_ID, trainer.peer_id)
    m = build_manifest(RUN_ID, 1, src, chunk_size=256 * 1024)
    with pytest.raises(ProtocolError) as e:
        store.add_announce(sign_announce(mallory, m))
    assert e.value.rule == "manifest.signer"
    assert store.get(1) is None and not any(store.versions_dir.iterdir())
    # another run's manifest, even from the trainer
    other = build_manifest(hashlib.sha256(b"other run").digest(), 1, src, chunk_size=256 * 1024)
    with pytest.raises(ProtocolError):
        store.add_announce(sign_announce(trainer, other))
    # a conflicting second manifest for a known version
    store.add_announce(sign_announce(trainer, m))
    m2 = build_manifest(RUN_ID, 1, make_checkpoint(tmp_path / "ckpt2", 2, seed=5), chunk_size=256 * 1024)
    with pytest.raises(ProtocolError) as e:
        store.add_announce(sign_announce(trainer, m2))
    assert e.value.rule == "manifest.conflict"
    # a tampered manifest (root no longer matches) fails inside the envelope check
    raw = bytearray(sign_announce(trainer, m))
    raw[-80] ^= 1
    with pytest.raises(ProtocolError):
        store.add_announce(bytes(raw))
    # the stored announce survives a restart and is re-verified
    again = ChunkStore(tmp_path / "node", RUN_ID, trainer.peer_id)
    assert again.get(1).root == m.root
    # a store that expects another trainer drops it on restart
    assert ChunkStore(tmp_path / "node", RUN_ID, mallory.peer_id).get(1) is None


def test_checkpoints_store_refuses_wrong_chunks(tmp_path):
    src = make_checkpoint(tmp_path / "ckpt", 1, seed=6)
    trainer = keys(1)[0]
    seeder = ChunkStore(tmp_path / "seeder", RUN_ID, trainer.peer_id)
    _, raw = seeder.import_directory_blocking(trainer, 1, src, chunk_size=128 * 1024)
    st_seed, _ = seeder.add_announce(raw)
    store = ChunkStore(tmp_path / "node", RUN_ID, trainer.peer_id)
    st, _ = store.add_announce(raw)
    good = seeder.read_chunk_blocking(st_seed, 0)
    with pytest.raises(ChunkRejected):
        store.put_chunk_blocking(st, 0, good[:-1])  # short
    with pytest.raises(ChunkRejected):
        store.put_chunk_blocking(st, 0, good + b"x")  # long
    bad = bytearray(good)
    bad[0] ^= 1
    with pytest.raises(ChunkRejected):
        store.put_chunk_blocking(st, 0, bytes(bad))  # wrong hash
    with pytest.raises(ChunkRejected):
        store.put_chunk_blocking(st, 1, good)  # right bytes, wrong index
    assert 0 not in st.bitmap and not st.written and not (store.version_dir(st) / "parts").exists()
    store.put_chunk_blocking(st, 0, good)
    store.mark_held(st.chunks[0][3])
    assert 0 in st.bitmap


class WrongSizeServer(ChunkServer):
    async def _send_chunk(self, sock, st, idx, peer):
        data = self.store.read_chunk_blocking(st, idx) + b"extra"
        await send_all(sock, F.REPLY.pack(F.OP_GET, F.OK, idx, len(data)) + data, self.stall_timeout_s)


async def test_wrong_size_chunk_on_the_wire_is_refused(tmp_path):
    src = make_checkpoint(tmp_path / "ckpt", 1, seed=7)
    trainer, fetcher_key = keys(2)
    seeder = ChunkStore(tmp_path / "seeder", RUN_ID, trainer.peer_id)
    _, raw = seeder.import_directory_blocking(trainer, 1, src, chunk_size=256 * 1024)
    seeder.add_announce(raw)
    store = ChunkStore(tmp_path / "node", RUN_ID, trainer.peer_id)
    store.add_announce(raw)
    server = WrongSizeServer(seeder)
    overlay = LocalControlPlane(fetcher_key.peer_id, {trainer.peer_id: server})
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        # a ticket for an unknown version is refused; a garbage ticket is refused on the wire
        t = server.grant_ticket(fetcher_key.peer_id, ChunkTicketRequest(version=9, root=bytes(32), chunk_indices=(0,)))
        assert not t.ok
        with pytest.raises(DataPlaneError) as refused:
            await DataConnection.open("127.0.0.1", server.port, b"\x01" * 32)
        assert refused.value.status == F.BAD_TICKET
        f = VersionFetcher(store, 1, overlay, max_strikes=2)
        f.add_peer(trainer.peer_id)
        with trio.move_on_after(5):
            await f.run()
        nursery.cancel_scope.cancel()
    assert not f.complete and f.st.bitmap.count == 0
    assert f.peers[trainer.peer_id].banned and trainer.peer_id in overlay.banned
    assert overlay.penalties[(trainer.peer_id, "bad_chunk")] == 2
