"""One overlay node as its own process, for the namespace tests (tests/test_nat_netns.py).

``python -m tests.support.nat_child --seed HEX --listen MADDR --status FILE [--bootstrap MADDR]
[--advertise IP] [--target-peers N] [--stock-autonat] [--data-port N] [--heartbeat-s S]
[--nat-interval-s S] [--deployed-intervals] [--measure-file PATH]``: runs a :class:`node.p2p.Node` (no role: the
overlay, AutoNAT, relay and hole punching are what is under test) and rewrites ``FILE`` with
the node's status JSON twice a second, so the test (in another network namespace) can read it.

``--measure-file``: once that file exists (bench/wan.py creates it when every node has heard
every other, i.e. after start-up), the node forgets the heartbeat delivery samples it has so
far and records its gossip counters at that moment under ``"measure"`` in its status, so the
bench reports the steady state, not connection set-up.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import trio

from node.p2p.host import attach_libp2p_logging
from node.p2p.nat import NatConfig
from node.p2p.node import Node, P2PConfig, RoleHook
from node.p2p.testing import fast_config
from protocol import NodeKey

RUN_ID = bytes(range(32))


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
    node = Node(key, run_id=RUN_ID, config=cfg, hook=RoleHook())
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
    trio.run(main, p.parse_args())
