"""GC never collects a version the chunk server is sending from, and collects it once
the send is over (the server pins the version for the duration of each chunk send).

The server is capped so a 2 MiB chunk takes a while to send, in trio's virtual time, and
the fetcher reads the reply only when the test says so. The clock moves only when the test
moves it, in small steps and only after 10 ms of real quiet (:func:`_pumping`): with
``autojump_clock`` a reply still in flight over loopback on a loaded machine let the clock
jump to the next deadline, a 20 s handshake or stall timeout, and the connection closed.
"""

from __future__ import annotations

import numpy as np
import trio
import trio.testing
from safetensors.numpy import save_file

from harness.checkpoints import RUN_ID, keys
from node.checkpoints import ChunkStore, DataConnection
from node.checkpoints.server import ChunkServer
from protocol import ChunkTicketRequest
from protocol import chunk_frames as F

CHUNK = 2 * 2**20


async def _pumping(clock, fn, *args):
    """Await ``fn(*args)`` while moving ``clock`` 0.05 s each time every task has waited 10 ms
    of real time (the server's upload bucket waits on the clock; nothing else is due)."""
    result = []

    async def pump() -> None:
        while True:
            await trio.testing.wait_all_tasks_blocked(cushion=0.01)
            clock.jump(0.05)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump)
        result.append(await fn(*args))
        nursery.cancel_scope.cancel()
    return result[0]


def _publish(store: ChunkStore, key, version: int, tmp_path) -> None:
    d = tmp_path / f"ckpt{version}"
    d.mkdir()
    rng = np.random.default_rng(100 + version)
    save_file({"w": rng.standard_normal(3 * CHUNK // 4 // 2, dtype=np.float32)}, str(d / "model.safetensors"))
    _, raw = store.import_directory_blocking(key, version, d, chunk_size=CHUNK)
    st, _ = store.add_announce(raw)
    store.assemble_blocking(st)
    st.assembled = True


async def test_gc_spares_a_version_being_served_and_collects_it_after(tmp_path, mock_clock):
    trainer, fetcher = keys(2)
    store = ChunkStore(tmp_path / "store", RUN_ID, trainer.peer_id)
    _publish(store, trainer, 1, tmp_path)
    st1 = store.get(1)
    assert st1.chunks[0][2] == CHUNK  # bigger than the bucket's burst: the send has to wait for tokens
    v1_files = store.files_dir(1)
    chunk0 = store.read_chunk_blocking(st1, 0)
    server = ChunkServer(store, max_upload_mbps=8.0)  # 1 MB/s: ~1.5 s (virtual) for chunk 0
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        t = server.grant_ticket(fetcher.peer_id, ChunkTicketRequest(version=1, root=st1.root, chunk_indices=(0,)))
        conn = await DataConnection.open(t.host, t.port, t.ticket, stall_timeout=3600)
        await conn.send(F.OP_GET, 0)
        # the reply's header comes first, then as much of chunk 0 as the bucket's burst allows;
        # the clock stands still, so the server stays in the middle of sending it
        op, status, idx, length = await conn.read_header()
        assert (op, status, idx, length) == (F.OP_GET, F.OK, 0, CHUNK)
        assert server.bytes_served < CHUNK and st1.pins == 1

        # newer versions push v1 out of the window (max_async 2) while it is being sent
        for v in (2, 3, 4):
            _publish(store, trainer, v, tmp_path)
        assert store.gc(2) == []
        assert store.get(1) is st1
        assert v1_files.is_dir() and any(v1_files.iterdir())

        buf = bytearray(length)
        await _pumping(mock_clock, conn.read_payload_into, memoryview(buf))
        assert bytes(buf) == chunk0
        # one connection's requests are served in order: the HAVE reply comes once the
        # server is done with chunk 0 and has let go of the version
        await conn.send(F.OP_HAVE)
        op, status, _, length = await conn.read_header()
        assert (op, status) == (F.OP_HAVE, F.OK)
        await conn.read_payload_into(memoryview(bytearray(length)))
        assert st1.pins == 0

        assert store.gc(2) == [1]
        assert store.get(1) is None and not v1_files.exists()
        assert not v1_files.exists()
        assert sorted(store.versions) == [2, 3, 4]
        # the open connection is told the version is gone
        await conn.send(F.OP_GET, 0)
        assert (await conn.read_header())[:2] == (F.OP_GET, F.GONE)
        await conn.aclose()
        nursery.cancel_scope.cancel()
