"""A fetcher killed (SIGKILL) half-way and restarted completes without re-fetching verified
chunks, and the half-written checkpoint is never loadable."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from pathlib import Path

import pytest
import trio

from harness.checkpoints import RUN_ID, keys, make_checkpoint, same_files
from node.checkpoints import ChunkStore, LocalControlPlane, VersionFetcher
from node.checkpoints.server import ChunkServer
from protocol import ChunkTicketRequest

REPO = Path(__file__).resolve().parents[2]


async def test_killed_fetcher_resumes_from_disk(tmp_path):
    src = make_checkpoint(tmp_path / "ckpt", 16, seed=8)
    trainer, fetcher_key = keys(2)
    seeder = ChunkStore(tmp_path / "seeder", RUN_ID, trainer.peer_id)
    _, raw = await trio.to_thread.run_sync(seeder.import_directory_blocking, trainer, 1, src, 512 * 1024)
    st_seed, _ = seeder.add_announce(raw)
    n = st_seed.bitmap.n
    ann = tmp_path / "announce"
    ann.write_bytes(raw)
    server = ChunkServer(seeder, max_upload_mbps=40.0)  # ~5 MB/s: the fetch takes a few seconds
    node_dir = tmp_path / "node"
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        t = server.grant_ticket(
            fetcher_key.peer_id, ChunkTicketRequest(version=1, root=st_seed.root, chunk_indices=(0,))
        )
        proc = await trio.lowlevel.open_process(
            [
                sys.executable,
                "-m",
                "harness.fetch_child",
                str(node_dir),
                trainer.peer_id,
                str(ann),
                trainer.peer_id,
                t.host,
                str(t.port),
                t.ticket.hex(),
            ],
            cwd=REPO,
        )

        def held() -> int:  # chunks the child's journal names (appended after each write)
            return sum(j.stat().st_size // 4 for j in (node_dir / "versions").glob("*/held"))

        with trio.fail_after(60):
            while held() < n // 3:
                assert proc.poll() is None, "the child finished or died before the kill"
                await trio.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
        assert proc.returncode == -signal.SIGKILL
        served_before = server.chunks_served

        # restart: the store knows what it holds without any network
        store = ChunkStore(node_dir, RUN_ID, trainer.peer_id)
        st = store.get(1)
        before = st.bitmap.count
        assert n // 3 <= before < n
        # never loadable half-way: the partial file is under parts/, nothing under files/
        vdir = store.version_dir(st)
        assert not st.assembled and not (vdir / "files").exists() and (vdir / "parts").is_dir()
        with pytest.raises(RuntimeError):
            await store.assemble(1)
        # every chunk the journal names is on disk, verified
        for i in st.written:
            assert hashlib.sha256(store.read_chunk_blocking(st, i)).digest() == st.chunks[i][3]
        assert not any((node_dir / "tmp").iterdir())  # crash leftovers cleared, never trusted
        server.set_max_upload_mbps(0)
        f = VersionFetcher(store, 1, LocalControlPlane(fetcher_key.peer_id, {trainer.peer_id: server}))
        f.add_peer(trainer.peer_id)
        with trio.fail_after(60):
            await f.run()
        nursery.cancel_scope.cancel()

    assert f.complete and f.held_at_start == before
    assert f.chunks_fetched == n - before  # nothing verified was fetched again
    assert server.chunks_served - served_before == n - before
    await store.assemble(1)
    assert same_files(src, store.files_dir(1))
