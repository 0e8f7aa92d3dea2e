"""One overlay node as its own process, for the namespace tests (tests/system/test_nat_netns.py).

``python -m harness.nat_child --seed HEX --listen MADDR --status FILE [--bootstrap MADDR]
[--advertise IP] [--target-peers N] [--stock-autonat] [--data-port N] [--heartbeat-s S]
[--nat-interval-s S] [--deployed-intervals] [--measure-file PATH]``: runs a :class:`node.p2p.Node` (no role: the
overlay, AutoNAT, relay and hole punching are what is under test) and rewrites ``FILE`` with
the node's status JSON twice a second, so the test (in another network namespace) can read it.

Checkpoints (``--store DIR --trainer ID``): the node also runs the checkpoint subsystem on
that chunk store (its data plane on ``--data-port``, advertised at ``--advertise``), wired
into the overlay as the learning roles wire it; ``--announce FILE`` hands it the trainer's
announce of a version to fetch (once that file exists). ``--corrupt``: its chunk server flips a byte of every chunk
it sends; ``--replay``: after each reverse connection it opened, it dials again with the same
ticket and records whether the fetcher took it (``evil`` in its status).

``--measure-file``: once that file exists (bench/wan.py creates it when every node has heard
every other, i.e. after start-up), the node forgets the heartbeat delivery samples it has so
far and records its gossip counters at that moment under ``"measure"`` in its status, so the
bench reports the steady state, not connection set-up.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import time
from pathlib import Path

import trio

from node.checkpoints import Checkpoints, ChunkStore
from node.checkpoints.server import ChunkServer
from node.checkpoints.wire import recv_exactly, send_all
from node.p2p.host import attach_libp2p_logging
from node.p2p.nat import NatConfig
from node.p2p.node import Node, P2PConfig, RoleHook
from node.p2p.testing import fast_config
from node.roles.checkpoint_wiring import P2PControlPlane, checkpoint_heartbeat_fields, serve_checkpoints
from protocol import NodeKey
from protocol import chunk_frames as F

RUN_ID = bytes(range(32))


class CorruptReplayServer(ChunkServer):
    """A dishonest holder: ``corrupt`` flips a byte of every chunk it sends; ``replay`` presents
    each reverse ticket a second time on a new connection and counts what happened."""

    def __init__(self, *args, corrupt: bool = False, replay: bool = False, **kw) -> None:
        super().__init__(*args, **kw)
        self.corrupt, self.replay = corrupt, replay
        self.evil: collections.Counter[str] = collections.Counter()

    async def _send_chunk(self, sock, st, idx, peer):
        if not self.corrupt:
            return await super()._send_chunk(sock, st, idx, peer)
        data = bytearray(self.store.read_chunk_blocking(st, idx))
        data[len(data) // 2] ^= 0xFF
        await send_all(sock, F.REPLY.pack(F.OP_GET, F.OK, idx, len(data)) + bytes(data), self.stall_timeout_s)
        self.bytes_served += len(data)
        self.evil["corrupt_chunks_sent"] += 1

    async def _reverse_dial(self, peer_id, req):
        if self.replay:
            assert self._nursery is not None
            self._nursery.start_soon(self._replay, req)
        await super()._reverse_dial(peer_id, req)

    async def _replay(self, req) -> None:
        await trio.sleep(0.5)  # after the first connection with this ticket was taken
        try:
            with trio.fail_after(10):
                stream = await trio.open_tcp_stream(req.host, req.port)
                try:
                    await send_all(stream.socket, F.pack_hello(F.FLAG_REVERSE, req.ticket), 5)
                    await recv_exactly(stream.socket, F.HELLO.size, 5)
                    self.evil["replay_accepted"] += 1
                finally:
                    await stream.aclose()
        except (trio.BrokenResourceError, trio.TooSlowError, OSError):
            self.evil["replay_refused"] += 1  # closed without a HELLO back


class CheckpointsHook(RoleHook):
    """The checkpoint subsystem alone, wired like a learning role's (node/roles/learning.py)."""

    def __init__(self, args: argparse.Namespace) -> None:
        store = ChunkStore(args.store, RUN_ID, args.trainer, direct_io=False)
        self.cp_args = dict(advertise_host=args.advertise or "127.0.0.1", listen_host="0.0.0.0")
        self.store = store
        self.args = args
        self.checkpoints: Checkpoints | None = None

    async def run(self, node) -> None:
        self.checkpoints = cp = Checkpoints(
            self.store, P2PControlPlane(node), data_port=self.args.data_port, **self.cp_args
        )
        if self.args.corrupt or self.args.replay:
            cp.server = CorruptReplayServer(
                self.store, port=self.args.data_port, corrupt=self.args.corrupt, replay=self.args.replay, **self.cp_args
            )
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_checkpoints, node, cp)
            if self.args.announce:  # the test writes it when it wants the fetch to start
                path = trio.Path(self.args.announce)
                while True:  # another namespace's process writes it: nothing to wait on but the file
                    if await path.exists():
                        break
                    await trio.sleep(0.2)
                cp.on_announce(await path.read_bytes())
            await trio.sleep_forever()

    def heartbeat_fields(self) -> dict:
        return checkpoint_heartbeat_fields(self.checkpoints) if self.checkpoints is not None else {}

    def status(self) -> dict:
        cp = self.checkpoints
        if cp is None:
            return {}
        return {
            "checkpoints": cp.status(),
            "server": cp.server.status(),
            "evil": dict(getattr(cp.server, "evil", {})),
            "fetching": {v: f.status()["peers"] for v, f in cp.fetchers.items()},
            "fetch": {
                v: {k: h[k] for k in ("peers", "fed_from", "chunks_rejected")} for v, h in cp.fetch_history.items()
            },
        }


async def main(args: argparse.Namespace) -> None:
    # The log is what a failed test prints: reachability changes, reservations, hole punches.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("node.p2p.nat").setLevel(logging.INFO)
    attach_libp2p_logging(logging.WARNING)
    logging.getLogger("libp2p.relay.circuit_v2.dcutr").setLevel(logging.INFO)
    if args.stock_autonat:
        # Shows the library's own dial-back (``host.connect()``: reuses the requester's
        # connection) next to ours; see node/p2p/nat.py.
        from libp2p.host.autonat import AutoNATService

        from node.p2p.nat import DialBackAutoNAT

        DialBackAutoNAT._try_dial = AutoNATService._try_dial  # type: ignore[method-assign]
    key = NodeKey(bytes.fromhex(args.seed))
    nat = NatConfig(first_check_s=1.0, check_interval_s=args.nat_interval_s, dial_back_timeout_s=3.0)
    cfg = fast_config(
        listen=[args.listen],
        bootstrap=list(args.bootstrap),
        target_peers=args.target_peers,
        advertise_host=args.advertise or "127.0.0.1",
        dial_timeout_s=5.0,
        nat=nat,
        data_port=args.data_port,
    )
    if args.deployed_intervals:
        # the overlay's own defaults (node/p2p/node.py), not the short test intervals
        base = P2PConfig()
        cfg.conn_interval_s, cfg.px_interval_s = base.conn_interval_s, base.px_interval_s
    if args.heartbeat_s:
        cfg.heartbeat_interval_s = args.heartbeat_s
        cfg.forget_after_s = max(10.0, 5 * args.heartbeat_s)
    hook = CheckpointsHook(args) if args.store else RoleHook()
    node = Node(key, run_id=RUN_ID, config=cfg, hook=hook)
    out = Path(args.status)
    measure: dict | None = None
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        while True:
            if measure is None and args.measure_file and await trio.Path(args.measure_file).exists():
                node.swarm.delivery_ms.clear()
                accepted = node.metrics.gossip_summary().get("relayed", 0)  # valid new messages
                measure = {"since_wall": time.time(), "accepted_before": accepted}
            status = node.status()
            if measure is not None:
                status["measure"] = measure
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps(status))
            os.replace(tmp, out)
            await trio.sleep(0.5)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--seed", required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--status", required=True)
    p.add_argument("--bootstrap", action="append", default=[])
    p.add_argument("--advertise", default=None)
    p.add_argument("--target-peers", type=int, default=4)
    p.add_argument("--stock-autonat", action="store_true")
    p.add_argument("--heartbeat-s", type=float, default=0.0)
    p.add_argument("--data-port", type=int, default=0, help="advertised in heartbeats (no chunk server runs)")
    p.add_argument("--nat-interval-s", type=float, default=10.0, help="AutoNAT re-check interval (production: 60)")
    p.add_argument(
        "--deployed-intervals", action="store_true", help="connection and peer-exchange intervals as deployed"
    )
    p.add_argument("--measure-file", default="", help="start measuring delivery once this file exists")
    p.add_argument("--store", default="", help="run the checkpoint subsystem on this chunk store")
    p.add_argument("--trainer", default="", help="peer id whose signed manifests the store accepts")
    p.add_argument("--announce", default="", help="a trainer's announce (envelope bytes) to fetch")
    p.add_argument("--corrupt", action="store_true", help="serve every chunk with one byte flipped")
    p.add_argument("--replay", action="store_true", help="present every reverse ticket twice")
    trio.run(main, p.parse_args())
