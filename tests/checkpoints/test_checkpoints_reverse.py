"""Reverse connections: a holder nobody can dial (behind NAT) serves chunks over a TCP
connection it opens to the fetcher's data port, with a ticket the fetcher made.

In one process over real sockets (the namespace version, with NAT routers and a relay, is
in tests/system/test_nat_netns.py): the HELLO frame's round trip and refusals; a fetch fed only
by a reverse holder; a guessed and a replayed ticket refused beside an honest one; a
reverse holder serving corrupt chunks is charged while the fetch completes from an honest
one; a holder dials only an address the requester owns; a fetcher that is itself not
reachable asks no reverse holder.
"""

from __future__ import annotations

import os

import pytest
import trio
import trio.testing

from harness.checkpoints import RUN_ID, keys, make_checkpoint, same_files
from node.checkpoints import Checkpoints, ChunkStore, LocalControlPlane
from node.checkpoints.server import ChunkServer
from node.checkpoints.wire import recv_exactly, send_all
from protocol import Heartbeat, ProtocolError, ReverseChunkRequest
from protocol import chunk_frames as F

GUARD_S = 60  # hang guard, not a threshold


# ---------------------------------------------------------------- the frame


def test_hello_round_trips_with_the_reverse_flag():
    tok = bytes(range(32))
    for flags in (0, F.FLAG_PUSH_HAVE, F.FLAG_REVERSE, F.FLAG_REVERSE | F.FLAG_PUSH_HAVE):
        h = F.parse_hello(F.pack_hello(flags, tok))
        assert (h.flags, h.ticket) == (flags, tok)
        assert h.reverse == bool(flags & F.FLAG_REVERSE)
        assert h.push_have == bool(flags & F.FLAG_PUSH_HAVE)
    assert F.parse_hello(F.pack_hello(0, b"abc")).ticket == b"abc" + bytes(29)  # zero-padded


@pytest.mark.parametrize(
    "data, why",
    [
        (b"PNDP" + bytes(30), "bytes, a HELLO is 40"),
        (F.HELLO.pack(b"HTTP", F.WIRE_VERSION, 0, bytes(32)), "not a primenode data plane"),
        (F.HELLO.pack(F.MAGIC, 2, F.FLAG_REVERSE, bytes(32)), "wire version 2"),
    ],
)
def test_malformed_hello_is_refused_with_a_clear_error(data, why):
    with pytest.raises(ProtocolError) as exc:
        F.parse_hello(data)
    assert exc.value.rule == "frame:hello" and why in exc.value.detail


def test_hello_that_cannot_be_encoded_is_refused():
    with pytest.raises(ProtocolError, match="at most 32"):
        F.pack_hello(0, bytes(33))
    with pytest.raises(ProtocolError, match="16 bits"):
        F.pack_hello(1 << 16, bytes(32))


# ---------------------------------------------------------------- nodes in one process


class CorruptServer(ChunkServer):
    """Flips one byte of every chunk it sends (same length, wrong hash)."""

    async def _send_chunk(self, sock, st, idx, peer):
        data = bytearray(self.store.read_chunk_blocking(st, idx))
        data[len(data) // 2] ^= 0xFF
        await send_all(sock, F.REPLY.pack(F.OP_GET, F.OK, idx, len(data)) + bytes(data), self.stall_timeout_s)
        self.bytes_served += len(data)


def _nat_heartbeat(cp: Checkpoints) -> Heartbeat:
    """What a holder behind NAT gossips: its chunks, data port 0."""
    return Heartbeat(
        role="worker", policy_version=1, addrs=(), data_port=0, have=cp.have_entries(), uptime_s=1.0, step=-1, batches=0
    )


class Swarm:
    def __init__(self, tmp_path, n: int, corrupt: tuple[int, ...] = ()) -> None:
        self.keys = keys(n)
        self.trainer = self.keys[0]
        self.servers: dict = {}
        self.overlays: dict = {}
        self.cps: list[Checkpoints] = []
        for i, k in enumerate(self.keys):
            store = ChunkStore(tmp_path / f"node{i}", RUN_ID, self.trainer.peer_id)
            self.overlays[k.peer_id] = LocalControlPlane(k.peer_id, self.servers)
            cp = Checkpoints(store, self.overlays[k.peer_id])
            if i in corrupt:
                cp.server = CorruptServer(store)
            self.servers[k.peer_id] = cp.server
            self.cps.append(cp)

    def copy_version(self, src: int, dst: int, version: int, raw: bytes) -> None:
        a, b = self.cps[src].store, self.cps[dst].store
        b.add_announce(raw)
        st = a.get(version)
        assert st is not None
        for h in st.by_hash:
            b.write_object_blocking(h, a.read_object_blocking(h))
            b.mark_held(h)


async def test_a_fetch_fed_only_by_a_holder_behind_nat(tmp_path):
    """Node 1 holds the version, is not dialled by anyone (the publisher, node 0, is not a
    peer of node 2); node 2 learns node 1 from a data-port-0 heartbeat and gets every chunk
    over connections node 1 opened."""
    src = make_checkpoint(tmp_path / "ckpt", 4, seed=1)
    sw = Swarm(tmp_path, 3)
    holder, fetcher = sw.cps[1], sw.cps[2]
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            for cp in sw.cps:
                await nursery.start(cp.run)
            raw = await sw.cps[0].import_version(sw.trainer, 1, src, chunk_size=256 * 1024)
            sw.copy_version(0, 1, 1, raw)
            holder.server.port = 0  # what a NAT'd node's data port is to others: nothing to dial
            fetcher.on_announce(raw)
            fetcher.on_heartbeat(sw.keys[1].peer_id, _nat_heartbeat(holder))
            await fetcher.wait_version(1)
            nursery.cancel_scope.cancel()
    assert same_files(src, fetcher.store.files_dir(1))
    total = sum(c[2] for c in fetcher.store.get(1).chunks)
    assert holder.server.bytes_served_reverse == holder.server.bytes_served == total
    assert holder.server.reverse["served_connections"] >= 1
    assert fetcher.server.reverse["accepted"] == holder.server.reverse["served_connections"]
    assert fetcher.fetch_history[1]["fed_from"] == [sw.keys[1].peer_id]
    assert fetcher.fetch_history[1]["peers"][sw.keys[1].peer_id]["reverse"] is True
    assert fetcher.server.reverse["bad_tickets"] == 0


async def test_guessed_and_replayed_tickets_are_refused_an_honest_one_is_taken(tmp_path):
    sw = Swarm(tmp_path, 2)
    fetcher = sw.cps[1]
    holder_id = sw.keys[0].peer_id
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run)
            srv = fetcher.server

            async def dial(ticket: bytes) -> trio.SocketStream:
                s = await trio.open_tcp_stream("127.0.0.1", srv.port)
                await send_all(s.socket, F.pack_hello(F.FLAG_REVERSE, ticket), 5)
                return s

            async def refused(s: trio.SocketStream) -> bool:
                """Closed without a word: no HELLO comes back."""
                try:
                    await recv_exactly(s.socket, F.HELLO.size, 5)
                except trio.BrokenResourceError:
                    return True
                finally:
                    await s.aclose()
                return False

            tok = srv.expect_reverse(holder_id, 1, bytes(32))
            # a guessed ticket: refused, and the real one still works afterwards
            assert await refused(await dial(os.urandom(32)))
            # honest control: the holder's connection is handed to the fetcher waiting for it
            honest = await dial(tok)
            # it arrives before the fetcher waits for it: the server accepted it and read its
            # HELLO (real I/O; waiting for quiet alone did not say so on a loaded machine)
            with trio.fail_after(60):
                while srv.reverse["accepted"] < 1:
                    await trio.testing.wait_all_tasks_blocked(cushion=0.01)
            assert srv.reverse["accepted"] == 1
            got = await srv.accept_reverse(tok, 5)
            await got.send_all(b"x")
            assert await honest.receive_some(1) == b"x"  # the same TCP connection
            # the same ticket again (a replay, or a second connection): refused
            assert await refused(await dial(tok))
            # a ticket whose wait was given up (the fetcher timed out): refused
            late = srv.expect_reverse(holder_id, 1, bytes(32))
            with pytest.raises(trio.TooSlowError):
                await srv.accept_reverse(late, 0.05)
            assert await refused(await dial(late))
            await got.aclose()
            await honest.aclose()
            nursery.cancel_scope.cancel()
    assert srv.reverse["accepted"] == 1
    assert srv.reverse["bad_tickets"] == 3


async def test_a_corrupt_holder_behind_nat_is_charged_and_the_fetch_completes_from_an_honest_one(tmp_path):
    src = make_checkpoint(tmp_path / "ckpt", 4, seed=2)
    sw = Swarm(tmp_path, 4, corrupt=(2,))
    honest, bad, fetcher = sw.cps[1], sw.cps[2], sw.cps[3]
    honest_id, bad_id = sw.keys[1].peer_id, sw.keys[2].peer_id
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            for cp in sw.cps:
                await nursery.start(cp.run)
            raw = await sw.cps[0].import_version(sw.trainer, 1, src, chunk_size=256 * 1024)
            for i in (1, 2):
                sw.copy_version(0, i, 1, raw)
            fetcher.on_announce(raw)
            fetcher.on_heartbeat(bad_id, _nat_heartbeat(bad))
            fetcher.on_heartbeat(honest_id, _nat_heartbeat(honest))
            await fetcher.wait_version(1)
            nursery.cancel_scope.cancel()
    assert same_files(src, fetcher.store.files_dir(1))
    ov = sw.overlays[sw.keys[3].peer_id]
    hist = fetcher.fetch_history[1]
    assert hist["chunks_rejected"] >= 1 and ov.penalties[(bad_id, "bad_chunk")] >= 1
    assert bad_id not in hist["fed_from"] and honest_id in hist["fed_from"]
    assert not any(p == honest_id for p, _ in ov.penalties)
    assert honest.server.bytes_served_reverse > 0 and bad.server.reverse["served_connections"] >= 1


async def test_a_holder_dials_only_an_ip_address_the_requester_owns(tmp_path):
    src = make_checkpoint(tmp_path / "ckpt", 1, seed=3)
    sw = Swarm(tmp_path, 1)
    cp = sw.cps[0]
    requester = keys(9)[8].peer_id
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(cp.run)
            await cp.import_version(sw.trainer, 1, src, chunk_size=256 * 1024)
            st = cp.store.get(1)

            def ask(host: str, version: int = 1, allowed=("198.18.0.7",)):
                req = ReverseChunkRequest(
                    version=version, root=st.root, chunk_indices=(0,), ticket=bytes(32), host=host, port=9
                )
                return cp.grant_reverse(requester, req, set(allowed))

            assert ask("example.org").reason == "host must be an IP address"
            assert ask("10.0.0.1").reason == "host is not one of your advertised addresses"
            assert ask("198.18.0.7", version=2).reason == "version not held"
            for _ in range(cp.server.max_connections_per_peer):
                assert ask("198.18.0.7").ok  # control: its own address (the dials fail: port 9)
            assert ask("198.18.0.7").reason.startswith("busy")  # per-requester cap, dials in flight
            other = ReverseChunkRequest(
                version=1, root=st.root, chunk_indices=(0,), ticket=bytes(32), host="198.18.0.8", port=9
            )
            assert cp.grant_reverse(keys(9)[7].peer_id, other, {"198.18.0.8"}).ok  # control: another requester
            nursery.cancel_scope.cancel()
    assert cp.server.reverse["granted"] == cp.server.max_connections_per_peer + 1


async def test_a_fetcher_that_is_not_reachable_asks_no_holder_behind_nat(tmp_path):
    """Two NAT'd nodes exchange no bulk: the fetcher's own data port cannot be dialled, so it
    ignores data-port-0 holders (and so does not count their chunks as available)."""
    src = make_checkpoint(tmp_path / "ckpt", 1, seed=4)
    sw = Swarm(tmp_path, 3)
    holder, fetcher = sw.cps[1], sw.cps[2]
    fetcher.server.reachable = lambda: False
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            for cp in sw.cps:
                await nursery.start(cp.run)
            raw = await sw.cps[0].import_version(sw.trainer, 1, src, chunk_size=256 * 1024)
            sw.copy_version(0, 1, 1, raw)
            fetcher.on_announce(raw)
            fetcher.on_heartbeat(sw.keys[1].peer_id, _nat_heartbeat(holder))
            f = fetcher.fetchers[1]
            assert sw.keys[1].peer_id not in f.peers and not any(f.schedule.avail)
            # control: the same heartbeat with a data port makes it a peer to fetch from
            hb = _nat_heartbeat(holder)
            fetcher.on_heartbeat(sw.keys[1].peer_id, Heartbeat(**{**hb.__dict__, "data_port": holder.data_port}))
            await fetcher.wait_version(1)
            nursery.cancel_scope.cancel()
    assert holder.server.reverse["granted"] == 0 and fetcher.server.reverse["expected"] == 0
    assert holder.server.bytes_served > 0
