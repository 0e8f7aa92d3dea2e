"""The upload cap (``--max-upload-mbps``): a token bucket shared by every upload of a node.

All rates are measured in trio's virtual time (``autojump_clock``: the clock jumps
to the next deadline whenever every task is blocked), so nothing here depends on
how fast this machine is. On loopback within one process a byte written is
readable at once, so the only time that passes is the bucket's own waiting.
"""

from __future__ import annotations

import trio

from harness.checkpoints import RUN_ID, keys, make_checkpoint
from node.checkpoints import ChunkStore, DataConnection, UploadLimiter
from node.checkpoints.server import ChunkServer
from protocol import ChunkTicketRequest
from protocol import chunk_frames as F

RATE = 1_000_000.0  # bytes/s
BURST = 256 * 1024
SLICE = 64 * 1024


async def _saturate(bucket: UploadLimiter, until: float, log: list, name: str = "") -> None:
    """Take SLICE-byte grants back to back until virtual time ``until``; log (time, name)."""
    while trio.current_time() < until:
        await bucket.take(SLICE)
        log.append((trio.current_time(), name))
        await trio.lowlevel.checkpoint()  # as the chunk server does after each slice


def _never_above_the_cap(log, t0: float, rate: float, burst: int) -> None:
    for k, (t, _) in enumerate(log, 1):
        assert k * SLICE <= burst + rate * (t - t0) + 1e-6, f"{k * SLICE} bytes granted by t={t - t0:.3f}s"


async def test_bytes_granted_over_virtual_time_match_the_cap(autojump_clock):
    bucket = UploadLimiter(RATE, burst=BURST)
    t0 = trio.current_time()
    log: list = []
    await _saturate(bucket, t0 + 20.0, log)
    _never_above_the_cap(log, t0, RATE, BURST)
    granted = len(log) * SLICE
    elapsed = log[-1][0] - t0
    # and the cap is reached, not just respected: 20 s at 1 MB/s plus the initial burst
    assert abs(granted - (BURST + RATE * elapsed)) <= SLICE
    assert 20.0 - SLICE / RATE <= elapsed <= 20.0 + SLICE / RATE

    # tokens saved while idle never exceed the burst
    await trio.sleep(100.0)
    t1 = trio.current_time()
    at_once = 0
    while True:
        await bucket.take(SLICE)
        if trio.current_time() > t1:
            break
        at_once += SLICE
    assert BURST - SLICE <= at_once <= BURST


async def test_the_cap_is_shared_fairly_by_concurrent_uploads(autojump_clock):
    bucket = UploadLimiter(RATE, burst=BURST)
    t0 = trio.current_time()
    log: list = []
    async with trio.open_nursery() as nursery:
        for name in "abc":
            nursery.start_soon(_saturate, bucket, t0 + 15.0, log, name)
    log.sort()
    _never_above_the_cap(log, t0, RATE, BURST)  # three takers together get one cap, not three
    granted = len(log) * SLICE
    elapsed = log[-1][0] - t0
    assert abs(granted - (BURST + RATE * elapsed)) <= 3 * SLICE
    share = {name: sum(SLICE for _, n in log if n == name) for name in "abc"}
    assert max(share.values()) - min(share.values()) <= 2 * SLICE, share  # FIFO: nobody starves


async def test_unlimited_and_mbps_conversion(autojump_clock):
    assert UploadLimiter.from_mbps(400).rate == 50e6 and UploadLimiter.from_mbps(400).limited
    free = UploadLimiter.from_mbps(0)
    assert not free.limited
    t0 = trio.current_time()
    for _ in range(1000):
        await free.take(1 << 30)
    assert trio.current_time() == t0


async def test_capped_chunk_server_serves_at_the_cap_across_connections(tmp_path, mock_clock):
    """Two fetchers pull from one capped server over real sockets, pipelining GETs: the
    bytes the server sends, in sum, follow the cap (1 MB/s here), not twice the cap."""
    # the clock jumps to the next deadline once every task has waited 20 ms of real time, not
    # at once: over real sockets a reply still in flight (a loaded machine) would otherwise let
    # it jump to a connect, handshake or stall timeout while no bucket wait was due
    mock_clock.autojump_threshold = 0.02
    src = make_checkpoint(tmp_path / "ckpt", 6, seed=31)
    trainer, a, b = keys(3)
    store = ChunkStore(tmp_path / "seed", RUN_ID, trainer.peer_id)
    _, raw = store.import_directory_blocking(trainer, 1, src, 512 * 1024)
    st, _ = store.add_announce(raw)
    n = st.bitmap.n
    mbps = RATE * 8 / 1e6
    server = ChunkServer(store, max_upload_mbps=mbps, superseed=False)
    burst = server.bucket.burst
    got = {a.peer_id: 0, b.peer_id: 0}
    done_at = {}

    async def pull(peer_id: str, indices) -> None:
        t = server.grant_ticket(peer_id, ChunkTicketRequest(version=1, root=st.root, chunk_indices=(0,)))
        conn = await DataConnection.open(t.host, t.port, t.ticket)
        for i in indices:  # all pipelined at once
            await conn.send(F.OP_GET, i)
        for i in indices:
            op, status, idx, length = await conn.read_header()
            assert (op, status, idx) == (F.OP_GET, F.OK, i)
            buf = bytearray(length)
            await conn.read_payload_into(memoryview(buf))
            assert bytes(buf) == store.read_chunk_blocking(st, i)
            got[peer_id] += length
        done_at[peer_id] = trio.current_time()
        await conn.aclose()

    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        t0 = trio.current_time()
        with trio.fail_after(3600):
            async with trio.open_nursery() as pulls:
                pulls.start_soon(pull, a.peer_id, list(range(n)))
                pulls.start_soon(pull, b.peer_id, list(range(n))[::-1])
        nursery.cancel_scope.cancel()

    total = sum(got.values())
    assert total == 2 * st.manifest.total_bytes == server.bytes_served
    elapsed = max(done_at.values()) - t0
    # the whole transfer took as long as the cap says (give or take one send slice), so the
    # two connections shared one cap; each alone would have been done in half the time
    expected = (total - burst) / RATE
    assert abs(elapsed - expected) <= server.send_slice / RATE, (elapsed, expected)
    # and both moved at once (FIFO across connections), neither waited for the other to finish
    assert min(done_at.values()) - t0 >= 0.8 * expected
