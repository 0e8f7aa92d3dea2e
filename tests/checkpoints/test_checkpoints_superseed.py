"""Super-seeding, pushed have-sets and the end game of the chunk data plane.

* A server holding a whole version answers ELSEWHERE to a second peer asking
  for a chunk it sent to someone else moments ago, serves it again once the
  hold-off has passed, and never refuses the peer it sent it to; a server
  holding only part of a version never refuses.
* With ``FLAG_PUSH_HAVE`` a server pushes its bitmap ahead of a GET reply when
  it changed; without the flag it never does.
* End game: a fetcher whose remaining chunks are all stuck at a peer that
  never sends them completes from the seed without waiting for the stall
  timeout.

The hold-offs run on trio's clock: the tests that wait one out use pytest-trio's
``mock_clock`` (time stands still unless the test jumps it) instead of sleeping.
"""

from __future__ import annotations

import socket
import time

import trio
import trio.testing

from harness.checkpoints import RUN_ID, keys, make_checkpoint, same_files
from node.checkpoints import ChunkStore, DataConnection, LocalControlPlane, VersionFetcher
from node.checkpoints.server import ChunkServer
from protocol import ChunkTicketRequest
from protocol import chunk_frames as F
from protocol.bitmap import Bitmap


async def _seeded_store(tmp_path, name="seeder", size_mib=4, chunk=512 * 1024):
    src = make_checkpoint(tmp_path / "ckpt", size_mib, seed=11)
    trainer = keys(1)[0]
    store = ChunkStore(tmp_path / name, RUN_ID, trainer.peer_id)
    _, raw = await trio.to_thread.run_sync(store.import_directory_blocking, trainer, 1, src, chunk)
    st, _ = store.add_announce(raw)
    return src, trainer, store, st, raw


async def _connect(server, peer_id, st, flags=0) -> DataConnection:
    t = server.grant_ticket(peer_id, ChunkTicketRequest(version=1, root=st.root, chunk_indices=(0,)))
    assert t.ok
    return await DataConnection.open(t.host, t.port, t.ticket, flags=flags)


async def _get(conn: DataConnection, idx: int) -> tuple[int, bytes]:
    """GET ``idx``; returns (status, payload), skipping pushed bitmaps."""
    await conn.send(F.OP_GET, idx)
    while True:
        op, status, ridx, length = await conn.read_header()
        buf = bytearray(length)
        await conn.read_payload_into(memoryview(buf))
        if op == F.OP_HAVE and ridx == F.PUSH_INDEX:
            continue
        assert (op, ridx) == (F.OP_GET, idx)
        return status, bytes(buf)


async def _send_started(server: ChunkServer, st, idx: int) -> None:
    """Wait (real time, clock standing still) until the server has begun sending chunk ``idx``:
    its send's start time is recorded. ``wait_all_tasks_blocked`` alone does not say the GET
    arrived: on a loaded machine a request over loopback can take longer than its cushion,
    and a clock jump made before the send starts is not counted in the send's time."""
    guard = time.monotonic() + 120
    while time.monotonic() < guard:
        sl = server._seed_log(st)
        if sl is not None and idx in sl.running:
            break
        await trio.testing.wait_all_tasks_blocked(cushion=0.01)
    sl = server._seed_log(st)
    assert sl is not None and idx in sl.running, f"the server never began sending chunk {idx}"
    await trio.testing.wait_all_tasks_blocked(cushion=0.01)  # and is now blocked mid-send


async def test_seed_refuses_a_second_peer_then_serves_after_the_hold_off(tmp_path, mock_clock):
    _, _, store, st, _ = await _seeded_store(tmp_path)
    a, b = (k.peer_id for k in keys(3)[1:])
    server = ChunkServer(store, reseed_after_s=0.3, reseed_after_all_s=0.3)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        ca, cb = await _connect(server, a, st), await _connect(server, b, st)
        status, data = await _get(ca, 0)
        assert status == F.OK and data == store.read_chunk_blocking(st, 0)
        assert (await _get(cb, 0))[0] == F.ELSEWHERE  # b should get chunk 0 from a
        assert (await _get(cb, 1))[0] == F.OK  # an unsent chunk is served
        assert (await _get(ca, 0))[0] == F.OK  # the recipient itself may ask again
        await trio.testing.wait_all_tasks_blocked()  # the server has logged the send to a as finished
        mock_clock.jump(0.5)  # past the hold-off: served again (a recipient may have vanished)
        status, data = await _get(cb, 0)
        assert status == F.OK and data == store.read_chunk_blocking(st, 0)
        assert server.chunks_elsewhere == 1
        for c in (ca, cb):
            await c.aclose()
        nursery.cancel_scope.cancel()


async def test_shorter_hold_off_once_every_chunk_went_out(tmp_path):
    _, _, store, st, _ = await _seeded_store(tmp_path, size_mib=1, chunk=256 * 1024)
    a, b = (k.peer_id for k in keys(3)[1:])
    server = ChunkServer(store, reseed_after_s=3600.0, reseed_after_all_s=0.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        ca, cb = await _connect(server, a, st), await _connect(server, b, st)
        n = st.bitmap.n
        assert n >= 3
        for i in range(n - 1):
            assert (await _get(ca, i))[0] == F.OK
        assert (await _get(cb, 0))[0] == F.ELSEWHERE  # one chunk never sent: the long hold-off holds
        assert (await _get(ca, n - 1))[0] == F.OK  # now every chunk went out once
        assert (await _get(cb, 0))[0] == F.OK  # end game: the seed helps again
        for c in (ca, cb):
            await c.aclose()
        nursery.cancel_scope.cancel()


async def test_partial_holder_never_refuses_and_pushes_its_bitmap(tmp_path):
    _, _, seed_store, seed_st, raw = await _seeded_store(tmp_path)
    a, b = (k.peer_id for k in keys(3)[1:])
    store = ChunkStore(tmp_path / "partial", RUN_ID, keys(1)[0].peer_id)
    st, _ = store.add_announce(raw)

    def give(i):
        h = seed_st.chunks[i][3]
        store.write_object_blocking(h, seed_store.read_chunk_blocking(seed_st, i))
        store.mark_held(h)

    give(0)
    give(1)
    server = ChunkServer(store, reseed_after_s=3600.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        pushing = await _connect(server, a, st, flags=F.FLAG_PUSH_HAVE)
        plain = await _connect(server, b, st)

        async def get_with_pushes(conn, idx):
            await conn.send(F.OP_GET, idx)
            pushes = []
            while True:
                op, status, ridx, length = await conn.read_header()
                buf = bytearray(length)
                await conn.read_payload_into(memoryview(buf))
                if op == F.OP_HAVE:
                    assert ridx == F.PUSH_INDEX and status == F.OK
                    pushes.append(Bitmap(st.bitmap.n, bytes(buf)))
                    continue
                return status, pushes

        status, pushes = await get_with_pushes(pushing, 0)
        assert status == F.OK and len(pushes) == 1 and pushes[0].indices() == [0, 1]
        status, pushes = await get_with_pushes(pushing, 1)
        assert status == F.OK and pushes == []  # unchanged: nothing pushed
        give(2)
        status, pushes = await get_with_pushes(pushing, 2)
        assert status == F.OK and [p.indices() for p in pushes] == [[0, 1, 2]]
        # not a seed: a second peer gets the same chunks at once, and no pushes without the flag
        for i in (0, 1, 2):
            status, pushes = await get_with_pushes(plain, i)
            assert status == F.OK and pushes == []
        status, pushes = await get_with_pushes(plain, 3)
        assert status == F.NOT_HELD
        assert server.chunks_elsewhere == 0
        for c in (pushing, plain):
            await c.aclose()
        nursery.cancel_scope.cancel()


class SilentServer(ChunkServer):
    """Accepts GETs, answers HAVE, never sends a chunk (a peer stuck on its uplink)."""

    async def _send_chunk(self, sock, st, idx, peer):
        await trio.sleep_forever()


async def test_end_game_takes_stuck_chunks_from_the_seed(tmp_path):
    src, trainer, seed_store, seed_st, raw = await _seeded_store(tmp_path)
    me, stuck = (k.peer_id for k in keys(3)[1:])
    # the stuck peer holds every chunk but the last (so it is not a seed and fetchers prefer it)
    stuck_store = ChunkStore(tmp_path / "stuck", RUN_ID, trainer.peer_id)
    stuck_store.add_announce(raw)
    for i in range(seed_st.bitmap.n - 1):
        h = seed_st.chunks[i][3]
        stuck_store.write_object_blocking(h, seed_store.read_chunk_blocking(seed_st, i))
        stuck_store.mark_held(h)
    servers = {trainer.peer_id: ChunkServer(seed_store), stuck: SilentServer(stuck_store)}
    store = ChunkStore(tmp_path / "me", RUN_ID, trainer.peer_id)
    store.add_announce(raw)
    # a stall timeout far beyond the test's limit: only the end game can finish this fetch
    fetcher = VersionFetcher(store, 1, LocalControlPlane(me, servers), stall_timeout=3600.0)
    fetcher.add_peer(trainer.peer_id)
    fetcher.add_peer(stuck)
    async with trio.open_nursery() as nursery:
        for s in servers.values():
            await nursery.start(s.run)
        with trio.fail_after(120):
            await fetcher.run()
        nursery.cancel_scope.cancel()
    assert fetcher.complete and fetcher.schedule.chunks_endgame >= 1
    assert fetcher.peers[stuck].chunks == 0
    assert servers[trainer.peer_id].bytes_served == seed_st.manifest.total_bytes  # nothing twice
    await store.assemble(1)
    assert same_files(src, store.files_dir(1))


async def test_a_peer_that_never_reads_pins_no_chunk_beyond_the_hold_off(tmp_path, mock_clock):
    """A hoarder asks the seed for every chunk and reads none: the send that blocks on its
    full socket must not keep the chunk refused (ELSEWHERE) to everyone else."""
    _, _, store, st, _ = await _seeded_store(tmp_path, size_mib=32, chunk=512 * 1024)
    hoarder, honest = (k.peer_id for k in keys(3)[1:])
    server = ChunkServer(store, reseed_after_s=0.5, stall_timeout_s=3600.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        ch, cb = await _connect(server, hoarder, st), await _connect(server, honest, st)
        n = st.bitmap.n
        for i in range(n):
            await ch.send(F.OP_GET, i)  # never read
        # the server gets stuck mid-send on the hoarder's full socket
        guard = time.monotonic() + 120
        while (server.bytes_served == 0 or server._sending == 0) and time.monotonic() < guard:
            await trio.testing.wait_all_tasks_blocked(cushion=0.01)
        await trio.testing.wait_all_tasks_blocked(cushion=0.2)
        assert 0 < server.bytes_served < st.manifest.total_bytes
        mock_clock.jump(1.0)
        for i in range(n):  # past the hold-off: every chunk, the one stuck mid-send too
            status, data = await _get(cb, i)
            assert status == F.OK, f"chunk {i} still refused to others"
            assert data == store.read_chunk_blocking(st, i)
        for c in (ch, cb):
            await c.aclose()
        nursery.cancel_scope.cancel()


async def test_a_copy_sent_to_a_slow_recipient_holds_nothing_off(tmp_path, mock_clock):
    """Super-seeding sends each chunk once and tells the others to get it from its recipient;
    a recipient that takes the chunk at a fraction of the seed's fastest send rate (a slow
    link: its uplink is as slow) would make everyone wait on it. Control: a send that runs
    at a normal pace keeps the chunk held off."""
    # chunks larger than both sockets' buffers (4 MiB each, doubled by the kernel), so that a
    # send blocks until the recipient reads
    _, _, store, st, _ = await _seeded_store(tmp_path, size_mib=72, chunk=24 * 1024 * 1024)
    fast, slow, other = (k.peer_id for k in keys(4)[1:])
    server = ChunkServer(store)  # hold-off 10 s: longer than anything below
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        cf, cs, co = [await _connect(server, p, st) for p in (fast, slow, other)]

        async def send_blocked_then_read(conn: DataConnection, idx: int, seconds: float) -> None:
            """GET ``idx`` and read it only ``seconds`` (trio clock) after the server blocked
            on the full socket: the send takes that long."""
            await conn.send(F.OP_GET, idx)
            await _send_started(server, st, idx)
            mock_clock.jump(seconds)
            op, status, ridx, length = await conn.read_header()
            assert (op, status, ridx) == (F.OP_GET, F.OK, idx)
            await conn.read_payload_into(memoryview(bytearray(length)))

        await send_blocked_then_read(cf, 1, 0.1)  # the fastest send: 24 MiB in 0.1-0.2 s
        await cs.send(F.OP_GET, 0)  # the slow peer's send of chunk 0 starts and blocks
        await _send_started(server, st, 0)
        mock_clock.jump(0.2)  # within 3x the fast time: a normal pace, held off
        assert (await _get(co, 0))[0] == F.ELSEWHERE
        mock_clock.jump(1.8)  # 2 s: far over 3x what the fastest send needed: a slow recipient
        status, data = await _get(co, 0)
        assert status == F.OK and data == store.read_chunk_blocking(st, 0)
        # a finished slow send holds nothing off either; a finished fast one does
        op, status, ridx, length = await cs.read_header()  # the slow send of chunk 0, at last
        assert (op, status, ridx) == (F.OP_GET, F.OK, 0)
        await cs.read_payload_into(memoryview(bytearray(length)))
        await send_blocked_then_read(cs, 2, 1.0)
        assert (await _get(co, 2))[0] == F.OK
        assert (await _get(co, 1))[0] == F.ELSEWHERE
        for c in (cf, cs, co):
            await c.aclose()
        nursery.cancel_scope.cancel()


async def test_chunks_inside_the_caps_burst_make_no_later_send_look_slow(tmp_path, mock_clock):
    """A delta travels in 256 KiB chunks. Under an upload cap the first of them go out inside
    the token bucket's 512 KiB burst, in no time: timing those made the seed's idea of a
    normal pace limitless, every send paced by the cap "slow", and a slow send holds nothing
    off, so the seed sent a 5 MB delta about twice over (bench/delta.py). Sends under
    RATE_MIN_BYTES are neither timed nor judged slow. Control: chunk 0, sent in the burst,
    is held off too; a slow recipient of a bigger chunk still holds nothing off
    (test_a_copy_sent_to_a_slow_recipient_holds_nothing_off)."""
    # the cap's waits pass once every task has waited 20 ms of real time (at 0, a reply still
    # in flight over loopback on a loaded machine let the clock jump to a stall timeout)
    mock_clock.autojump_threshold = 0.02
    _, _, store, st, _ = await _seeded_store(tmp_path, size_mib=2, chunk=256 * 1024)
    a, b, other = (k.peer_id for k in keys(4)[1:])
    server = ChunkServer(store, max_upload_mbps=8)  # 1 MB/s, bursts of 512 KiB; hold-off 10 s
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        ca, cb, co = [await _connect(server, p, st) for p in (a, b, other)]
        t0 = trio.current_time()
        for i in (0, 1):  # the burst: no time passes
            assert (await _get(ca, i))[0] == F.OK
        assert trio.current_time() - t0 < 0.01
        assert (await _get(cb, 2))[0] == F.OK  # paced by the cap
        assert trio.current_time() - t0 > 0.2
        assert (await _get(co, 2))[0] == F.ELSEWHERE, "a send at the cap's pace was taken for a slow recipient"
        assert (await _get(co, 0))[0] == F.ELSEWHERE
        for c in (ca, cb, co):
            await c.aclose()
        nursery.cancel_scope.cancel()


async def test_a_chunk_queued_in_the_send_buffer_is_not_counted_as_delivered(tmp_path, mock_clock):
    """A 4 MiB chunk (the default size) fits in the kernel's send buffer (4 MiB asked, 8 MiB
    given): without a limit on unsent bytes (TCP_NOTSENT_LOWAT) the send "finished" the
    moment it was queued, even to a recipient whose link takes seconds, and super-seeding
    then held the chunk off (ELSEWHERE) for everyone while it trickled out. Here the slow
    recipient's receive buffer is tiny and it reads nothing: its send must stay running,
    prove slow and hold nothing off. Control: a recipient that reads at once keeps its
    chunk held off for the others."""
    _, _, store, st, _ = await _seeded_store(tmp_path, size_mib=16, chunk=4 * 1024 * 1024)
    fast, slow, other = (k.peer_id for k in keys(4)[1:])
    server = ChunkServer(store)  # hold-off 10 s: longer than anything below
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        cf, cs, co = [await _connect(server, p, st) for p in (fast, slow, other)]
        cs.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)  # a thin link, in effect
        status, _ = await _get(cf, 1)  # a fast send: the server's idea of a normal pace
        assert status == F.OK
        await cs.send(F.OP_GET, 0)  # never read (until the end)
        await _send_started(server, st, 0)
        mock_clock.jump(1.0)
        status, data = await _get(co, 0)
        assert status == F.OK, "a chunk sitting in the slow recipient's send queue was held off"
        assert data == store.read_chunk_blocking(st, 0)
        assert (await _get(co, 1))[0] == F.ELSEWHERE  # control: the fast recipient's chunk is held off
        op, status, ridx, length = await cs.read_header()  # the slow send, at last
        assert (op, status, ridx) == (F.OP_GET, F.OK, 0)
        await cs.read_payload_into(memoryview(bytearray(length)))
        for c in (cf, cs, co):
            await c.aclose()
        nursery.cancel_scope.cancel()


async def test_a_fast_fetcher_asks_a_refused_chunk_again_within_a_fraction_of_a_second(tmp_path, mock_clock):
    """A seed answers ELSEWHERE for a chunk it just sent to someone else; how soon the fetcher
    asks again bounds how soon it gets the chunk once the seed lets it go. A fixed second was
    twice a whole 64 MiB fetch at 1000 Mbit/s (bench/distribution.py --link-caps). A fetcher
    that receives fast asks again after two chunk times at its rate (at least 0.1 s); after
    0.3 s without an answer it has asked again. Control: the chunk is served once the seed's
    hold-off passes, and every other chunk came from the seed at once."""
    _, trainer, seed_store, seed_st, raw = await _seeded_store(tmp_path, size_mib=2, chunk=512 * 1024)
    me, first = (k.peer_id for k in keys(3)[1:])
    seed = ChunkServer(seed_store)  # hold-off 10 s
    store = ChunkStore(tmp_path / "me", RUN_ID, trainer.peer_id)
    store.add_announce(raw)
    fetcher = VersionFetcher(store, 1, LocalControlPlane(me, {trainer.peer_id: seed}), stall_timeout=3600.0)
    fetcher.add_peer(trainer.peer_id)
    async with trio.open_nursery() as nursery:
        await nursery.start(seed.run)
        c = await _connect(seed, first, seed_st)
        assert (await _get(c, 0))[0] == F.OK  # chunk 0 went to ``first``: held off for 10 s
        nursery.start_soon(fetcher.run)
        # wait on the *fetcher* having read the refusal: the seed counts it before it sends it,
        # and a jump made before the fetcher reads it would start its retry timer after the jump
        # (seen in a loaded CI run: the retry was due at 0.4 s of a clock that stood at 0.3 s)
        while fetcher.st.bitmap.count < seed_st.bitmap.n - 1 or fetcher.schedule.chunks_elsewhere < 1:
            await trio.testing.wait_all_tasks_blocked(cushion=0.01)
        assert seed.chunks_elsewhere == 1 and fetcher.schedule.chunks_elsewhere == 1 and 0 not in fetcher.st.bitmap
        mock_clock.jump(0.3)
        # let the retry go out over the socket and its refusal come back: the mock clock stands
        # still (a fetcher that waits a second never asks), only real I/O and threads run. The
        # wall-clock bound is a hang guard, not a threshold (500 rounds of 10 ms were too few
        # once in a loaded CI run)
        guard = time.monotonic() + 120
        while seed.chunks_elsewhere < 2 and time.monotonic() < guard:
            await trio.testing.wait_all_tasks_blocked(cushion=0.01)
        # asked again (the old fetcher waited a whole second)
        assert seed.chunks_elsewhere >= 2, "the refused chunk was not asked again within 0.3 s"
        mock_clock.jump(10.0)  # past the hold-off: the seed serves it
        with trio.fail_after(3600):
            while not fetcher.complete:
                await trio.testing.wait_all_tasks_blocked(cushion=0.01)
                mock_clock.jump(0.1)
        await c.aclose()
        nursery.cancel_scope.cancel()
    assert fetcher.complete and fetcher.peers[trainer.peer_id].chunks == seed_st.bitmap.n
