"""Chunks written once, in place: the fetched file is the loadable file, and the served one.

Real chunk servers and fetchers over TCP, real files. What is specified:

* a fetch writes each verified chunk at its offset in the version's preallocated file;
  making it loadable renames that same file (same inode: nothing re-read or copied);
* a tampered chunk never reaches the disk (its range stays as preallocated, the journal
  does not name it), the honest copy from another peer does;
* a node re-serves chunks from that file, while it is still fetching (``parts/``) and
  once complete (``files/``), to a second fetcher;
* a chunk another version here shares is copied locally, not fetched again.

The kill -9 mid-fetch case is in test_checkpoints_resume.py.
"""

from __future__ import annotations

import os
import shutil
import time

import trio
from safetensors.numpy import load_file

from harness.checkpoints import RUN_ID, keys, make_checkpoint, same_files
from node.checkpoints import ChunkStore, LocalControlPlane, VersionFetcher
from node.checkpoints.server import ChunkServer

CHUNK = 256 * 1024


def _seeder(tmp_path, src, version=1, name="seeder"):
    trainer = keys(1)[0]
    store = ChunkStore(tmp_path / name, RUN_ID, trainer.peer_id)
    _, raw = store.import_directory_blocking(trainer, version, src, chunk_size=CHUNK)
    store.add_announce(raw)
    return store, raw


class TamperingServer(ChunkServer):
    """Flips one byte of every chunk it sends (a hostile peer)."""

    async def _send_chunk(self, sock, st, idx, peer):
        from node.checkpoints.server import send_all
        from protocol import chunk_frames as F

        data = bytearray(self.store.read_chunk_blocking(st, idx))
        data[len(data) // 2] ^= 0xFF
        await send_all(sock, F.REPLY.pack(F.OP_GET, F.OK, idx, len(data)) + bytes(data), self.stall_timeout_s)


async def test_a_fetch_writes_in_place_and_the_same_file_becomes_loadable(tmp_path):
    src = make_checkpoint(tmp_path / "ckpt", 4, seed=11)
    seed_store, raw = _seeder(tmp_path, src)
    me = keys(3)[2]
    store = ChunkStore(tmp_path / "node", RUN_ID, seed_store.trainer)
    st, _ = store.add_announce(raw)
    server = ChunkServer(seed_store)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        f = VersionFetcher(store, 1, LocalControlPlane(me.peer_id, {"seeder": server}))
        f.add_peer("seeder")
        with trio.fail_after(60):
            await f.run()
        nursery.cancel_scope.cancel()
    assert f.complete and f.chunks_fetched == len(st.chunks)
    vdir = store.version_dir(st)
    parts = vdir / "parts"
    # every byte is already where the engine will read it, before any "assembly"
    assert same_files(src, parts)
    inodes = {p.name: p.stat().st_ino for p in parts.iterdir()}
    assert not st.assembled and not (vdir / "files").exists()

    files = await store.assemble(1)
    assert st.assembled and files == vdir / "files"
    assert {p.name: p.stat().st_ino for p in files.iterdir()} == inodes  # renamed, not rewritten
    assert not parts.exists() and not (vdir / "held").exists()
    assert same_files(src, files)
    with store.open_version(1) as paths:
        for p in paths.values():
            load_file(str(p))  # a valid safetensors header and body
    # a restart finds it complete and loadable, from disk alone
    again = ChunkStore(tmp_path / "node", RUN_ID, seed_store.trainer)
    assert again.get(1).complete and again.get(1).assembled


async def test_a_tampered_chunk_is_never_written_and_the_honest_copy_is(tmp_path):
    src = make_checkpoint(tmp_path / "ckpt", 2, seed=12)
    seed_store, raw = _seeder(tmp_path, src)
    me = keys(3)[2]
    store = ChunkStore(tmp_path / "node", RUN_ID, seed_store.trainer)
    st, _ = store.add_announce(raw)
    bad = TamperingServer(seed_store)
    good = ChunkServer(seed_store)
    servers = {"mallory": bad, "honest": good}
    rejected = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(bad.run)
        await nursery.start(good.run)
        # first only the hostile peer: every chunk it sends is refused
        f = VersionFetcher(
            store,
            1,
            LocalControlPlane(me.peer_id, servers),
            max_strikes=2,
            on_progress=lambda _p: rejected.set() if f.chunks_rejected >= 2 else None,
        )
        f.add_peer("mallory")
        with trio.CancelScope() as scope:
            nursery.start_soon(f.run)
            await rejected.wait()
            scope.cancel()
        assert f.chunks_rejected >= 2 and st.bitmap.count == 0 and not st.written
        assert "mallory" in f.banned
        # nothing of it reached the file: no journal entry, the ranges as preallocated
        vdir = store.version_dir(st)
        assert not (vdir / "held").exists()
        for p in (vdir / "parts").rglob("*") if (vdir / "parts").exists() else ():
            if p.is_file():
                assert p.read_bytes() == bytes(p.stat().st_size)

        # the honest control: the same fetch from an honest peer completes, byte for byte
        g = VersionFetcher(store, 1, LocalControlPlane(me.peer_id, servers), banned=f.banned)
        g.add_peer("mallory")
        g.add_peer("honest")
        with trio.fail_after(60):
            await g.run()
        nursery.cancel_scope.cancel()
    assert g.complete and "mallory" not in g.status()["fed_from"]
    assert same_files(src, await store.assemble(1))


async def test_chunks_are_re_served_from_the_in_place_file(tmp_path):
    src = make_checkpoint(tmp_path / "ckpt", 4, seed=13)
    seed_store, raw = _seeder(tmp_path, src)
    a_key, b_key, c_key = keys(3)
    a = ChunkStore(tmp_path / "a", RUN_ID, seed_store.trainer)
    st_a, _ = a.add_announce(raw)
    seed_st = seed_store.get(1)
    n = len(seed_st.chunks)
    half = list(range(0, n, 2))
    for i in half:  # A holds every other chunk, in parts/ (still fetching)
        h = a.put_chunk_blocking(st_a, i, seed_store.read_chunk_blocking(seed_st, i))
        a.mark_held(h)
    assert (a.version_dir(st_a) / "parts").is_dir() and st_a.bitmap.count == len(half)

    seeder_srv = ChunkServer(seed_store)
    a_srv = ChunkServer(a)
    servers = {"seeder": seeder_srv, "a": a_srv}
    async with trio.open_nursery() as nursery:
        await nursery.start(seeder_srv.run)
        await nursery.start(a_srv.run)
        b = ChunkStore(tmp_path / "b", RUN_ID, seed_store.trainer)
        b.add_announce(raw)
        fb = VersionFetcher(b, 1, LocalControlPlane(b_key.peer_id, servers))
        fb.update_have("a", st_a.bitmap.to_bytes())
        fb.update_have("seeder", seed_st.bitmap.to_bytes())
        with trio.fail_after(60):
            await fb.run()
        # super-seeding: what A holds came from A, read from its partial file
        assert fb.peers["a"].chunks >= len(half) and a_srv.chunks_served >= len(half)
        assert same_files(src, await b.assemble(1))

        # A completes, becomes loadable, and serves everything from files/ alone
        fa = VersionFetcher(a, 1, LocalControlPlane(a_key.peer_id, servers))
        fa.add_peer("seeder")
        with trio.fail_after(60):
            await fa.run()
        await a.assemble(1)
        assert not (a.version_dir(st_a) / "parts").exists()
        c = ChunkStore(tmp_path / "c", RUN_ID, seed_store.trainer)
        c.add_announce(raw)
        fc = VersionFetcher(c, 1, LocalControlPlane(c_key.peer_id, servers))
        fc.add_peer("a")  # not the seeder
        with trio.fail_after(60):
            await fc.run()
        nursery.cancel_scope.cancel()
    assert fc.status()["fed_from"] == ["a"] and fc.chunks_fetched == n
    assert same_files(src, await c.assemble(1))


async def test_chunks_shared_with_a_held_version_are_copied_not_fetched(tmp_path):
    v1 = make_checkpoint(tmp_path / "v1", 4, seed=14)
    v2 = tmp_path / "v2"
    shutil.copytree(v1, v2)
    other = make_checkpoint(tmp_path / "other", 4, seed=15)  # same shapes, other values
    os.replace(other / "model-00001.safetensors", v2 / "model-00001.safetensors")
    trainer = keys(1)[0]
    seed_store = ChunkStore(tmp_path / "seeder", RUN_ID, trainer.peer_id)
    raws = []
    for v, d in ((1, v1), (2, v2)):
        _, raw = seed_store.import_directory_blocking(trainer, v, d, chunk_size=CHUNK)
        seed_store.add_announce(raw)
        raws.append(raw)
    me = keys(3)[2]
    store = ChunkStore(tmp_path / "node", RUN_ID, trainer.peer_id)
    server = ChunkServer(seed_store)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        fetched = {}
        for v, raw in ((1, raws[0]), (2, raws[1])):
            store.add_announce(raw)
            f = VersionFetcher(store, v, LocalControlPlane(me.peer_id, {"seeder": server}))
            f.add_peer("seeder")
            with trio.fail_after(60):
                await f.run()
            fetched[v] = f.chunks_fetched
            await store.assemble(v)
        nursery.cancel_scope.cancel()
    st2 = store.get(2)
    changed = next(f for f in st2.manifest.files if f.path == "model-00001.safetensors")
    assert fetched[1] == len(store.get(1).chunks)
    assert fetched[2] == len(changed.chunk_hashes)  # the unchanged file's chunks came from version 1
    assert same_files(v2, store.files_dir(2)) and same_files(v1, store.files_dir(1))


async def test_a_restart_between_the_last_chunk_and_the_rename_finishes_without_refetching(tmp_path):
    src = make_checkpoint(tmp_path / "ckpt", 2, seed=16)
    seed_store, raw = _seeder(tmp_path, src)
    seed_st = seed_store.get(1)
    store = ChunkStore(tmp_path / "node", RUN_ID, seed_store.trainer)
    st, _ = store.add_announce(raw)
    for i in range(len(st.chunks)):  # every chunk written, as a fetch leaves them; then the process dies
        store.put_chunk_blocking(st, i, seed_store.read_chunk_blocking(seed_st, i))
    journal = store.version_dir(st) / "held"
    journal.write_bytes(journal.read_bytes() + b"\x07\x00")  # a record torn by the crash
    del store, st

    again = ChunkStore(tmp_path / "node", RUN_ID, seed_store.trainer)
    st = again.get(1)
    assert st.complete and not st.assembled and not (again.version_dir(st) / "files").exists()
    files = await again.assemble(1)  # the rename only: nothing to fetch, nothing to copy
    assert same_files(src, files)

    # control: a journal that lost its last records means those chunks are fetched again
    other = ChunkStore(tmp_path / "other", RUN_ID, seed_store.trainer)
    st2, _ = other.add_announce(raw)
    for i in range(len(st2.chunks)):
        other.put_chunk_blocking(st2, i, seed_store.read_chunk_blocking(seed_st, i))
    j2 = other.version_dir(st2) / "held"
    j2.write_bytes(j2.read_bytes()[:-4])
    restarted = ChunkStore(tmp_path / "other", RUN_ID, seed_store.trainer)
    assert restarted.get(1).bitmap.count == len(st2.chunks) - 1 and not restarted.get(1).complete


async def test_an_idle_fetcher_sees_a_peers_fresh_small_chunk_within_a_few_chunk_times(tmp_path, mock_clock):
    """A fetcher whose only peer holds nothing yet polls that peer's HAVE while idle. With the
    run's 4 MiB chunks it polls every ``have_poll_s`` (0.25 s); a delta's chunks are 256 KiB
    (~21 ms at 100 Mbit/s), and a fresh chunk of a peer went unseen for up to 12 chunk times,
    so the poll shrinks with the chunk (not under HAVE_POLL_MIN_S): the peer's first chunk is
    asked for and fetched within 0.03 s of the mock clock. Control: a version of 4 MiB chunks
    keeps the 0.25 s poll."""
    from node.checkpoints.fetcher import HAVE_POLL_MIN_S

    src = make_checkpoint(tmp_path / "ckpt", 1, seed=17)  # 4 chunks of 256 KiB
    seed_store, raw = _seeder(tmp_path, src)
    seed_st = seed_store.get(1)
    b_key = keys(3)[2]
    a = ChunkStore(tmp_path / "a", RUN_ID, seed_store.trainer)
    st_a, _ = a.add_announce(raw)
    a_srv = ChunkServer(a)
    async with trio.open_nursery() as nursery:
        await nursery.start(a_srv.run)
        b = ChunkStore(tmp_path / "b", RUN_ID, seed_store.trainer)
        st_b, _ = b.add_announce(raw)
        fb = VersionFetcher(b, 1, LocalControlPlane(b_key.peer_id, {"a": a_srv}))
        assert fb.have_poll_s == HAVE_POLL_MIN_S < 0.25
        fb.add_peer("a")  # A is its only peer: nothing to fetch until A holds a chunk
        nursery.start_soon(fb.run)
        for _ in range(50):  # connected, A's empty bitmap seen, idle
            await trio.testing.wait_all_tasks_blocked(cushion=0.01)
        assert st_b.bitmap.count == 0
        a.mark_held(a.put_chunk_blocking(st_a, 0, seed_store.read_chunk_blocking(seed_st, 0)))
        t0 = trio.current_time()
        mock_clock.jump(0.03)
        # the poll, the GET and the chunk's real I/O and durable write (a thread), clock standing
        # still; the wall-clock bound is a hang guard, not a threshold (500 rounds of 10 ms of
        # quiet were about 5 s, too few on a loaded machine)
        guard = time.monotonic() + 120
        while 0 not in st_b.bitmap and time.monotonic() < guard:
            await trio.testing.wait_all_tasks_blocked(cushion=0.01)
        assert 0 in st_b.bitmap, "a peer's fresh chunk went unseen for 0.03 s"
        assert trio.current_time() - t0 <= 0.03 + 1e-9
        nursery.cancel_scope.cancel()
    # the control: 4 MiB chunks poll at have_poll_s
    big = make_checkpoint(tmp_path / "big", 8, seed=18)
    trainer = keys(1)[0]
    c = ChunkStore(tmp_path / "c", RUN_ID, trainer.peer_id)
    _, raw_big = c.import_directory_blocking(trainer, 2, big, chunk_size=4 * 1024 * 1024)
    d = ChunkStore(tmp_path / "d", RUN_ID, trainer.peer_id)
    d.add_announce(raw_big)
    assert VersionFetcher(d, 2, LocalControlPlane(b_key.peer_id, {})).have_poll_s == 0.25
