"""A peer that stalls is dropped after the stall timeout and its chunks re-assigned.

The staller holds the whole version and is known to before the fetch starts (as from
a heartbeat), so the fetcher asks it for chunks first. It then either never answers
at all, or starts a chunk and stops half-way. The end game is off, so only the stall
timeout can take those chunks back. The fetch must complete, byte-identical, from
the good seed, and the staller be charged ``chunk_stall``.
"""

from __future__ import annotations

import pytest
import trio

from harness.checkpoints import RUN_ID, keys, make_checkpoint, same_files
from node.checkpoints import ChunkStore, LocalControlPlane, VersionFetcher
from node.checkpoints.server import ChunkServer
from node.checkpoints.wire import recv_exactly, send_all
from protocol import chunk_frames as F


class MuteServer(ChunkServer):
    """Welcomes the fetcher, reads its requests, never answers one (not even HAVE)."""

    requested: list

    async def _serve(self, sock, t, flags=0):
        while True:
            op, idx, _ = F.REQUEST.unpack(await recv_exactly(sock, F.REQUEST.size, 3600))
            if op == F.OP_BYE:
                return
            if op == F.OP_GET:
                self.requested.append(idx)


class HalfChunkServer(ChunkServer):
    """Answers HAVE; for a GET sends the header and half the chunk, then nothing more."""

    requested: list

    async def _send_chunk(self, sock, st, idx, peer):
        self.requested.append(idx)
        data = self.store.read_chunk_blocking(st, idx)
        await send_all(sock, F.REPLY.pack(F.OP_GET, F.OK, idx, len(data)) + data[: len(data) // 2], 10)
        await trio.sleep_forever()


@pytest.mark.parametrize("staller_cls", [MuteServer, HalfChunkServer])
async def test_stalled_peer_is_dropped_and_its_chunks_reassigned(tmp_path, staller_cls):
    src = make_checkpoint(tmp_path / "ckpt", 2, seed=41)
    trainer, staller, me = keys(3)
    good_store = ChunkStore(tmp_path / "good", RUN_ID, trainer.peer_id)
    _, raw = await trio.to_thread.run_sync(good_store.import_directory_blocking, trainer, 1, src, 128 * 1024)
    good_st, _ = good_store.add_announce(raw)
    stall_store = ChunkStore(tmp_path / "staller", RUN_ID, trainer.peer_id)
    stall_store.add_announce(raw)
    for i in range(good_st.bitmap.n):
        h = good_st.chunks[i][3]
        stall_store.write_object_blocking(h, good_store.read_chunk_blocking(good_st, i))
        stall_store.mark_held(h)
    bad = staller_cls(stall_store)
    bad.requested = []
    servers = {trainer.peer_id: ChunkServer(good_store), staller.peer_id: bad}

    store = ChunkStore(tmp_path / "me", RUN_ID, trainer.peer_id)
    store.add_announce(raw)
    overlay = LocalControlPlane(me.peer_id, servers)
    fetcher = VersionFetcher(store, 1, overlay, stall_timeout=0.5, endgame_after_s=None)
    fetcher.update_have(staller.peer_id, good_st.bitmap.to_bytes())  # known first: it is asked first
    fetcher.add_peer(trainer.peer_id)
    async with trio.open_nursery() as nursery:
        for s in servers.values():
            await nursery.start(s.run)
        with trio.fail_after(60):
            await fetcher.run()
        nursery.cancel_scope.cancel()

    total = good_st.manifest.total_bytes
    assert fetcher.complete
    await store.assemble(1)
    assert same_files(src, store.files_dir(1))
    # the staller was asked for chunks, delivered none, and those chunks came from the good seed
    assert bad.requested, "the staller was never asked: the test did not exercise a stall"
    stuck = fetcher.peers[staller.peer_id]
    assert stuck.chunks == 0 and stuck.bytes == 0 and stuck.failures >= 1
    assert "TooSlowError" in stuck.last_error
    assert overlay.penalties[(staller.peer_id, "chunk_stall")] >= 1
    assert fetcher.peers[trainer.peer_id].bytes == total == fetcher.bytes_fetched
    assert servers[trainer.peer_id].bytes_served == total  # every chunk exactly once, stalled ones included
    assert not any(reason == "chunk_stall" for (pid, reason) in overlay.penalties if pid == trainer.peer_id)
    assert fetcher.status()["fed_from"] == [trainer.peer_id]
