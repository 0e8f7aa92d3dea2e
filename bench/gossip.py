"""Gossip benchmark: N nodes, R messages per second, delivery ratio and latency.

    python bench/gossip.py [--nodes 20] [--rate 100] [--seconds 10] [--procs 2] [--target-peers 6]

Real libp2p hosts on 127.0.0.1 (Noise + Yamux, our Plumtree gossip, full
envelope validation with signatures, dedup and relay), production overlay
intervals. ``--procs P`` (default 2, this machine's cores) spreads the nodes
over P OS processes (bench/gossip_procs.py says how they coordinate);
``--procs 1`` runs all N nodes in this process, one trio event loop, where
they share one core, so latencies include queueing behind the other nodes'
work (a deployment with one node per machine sees less).

The first node is the bootstrap; the others join it and keep ``target_peers``
connections (the production default is 6). Once every node sees every other
node's heartbeat, a publisher task sends R ``Vote`` messages per second, each
from a random node (every node is a validator in the bench genesis, since only
validators may send votes). The vote's ``batch_id`` carries the message number
and the send time (``time.perf_counter`` in one process, ``time.time`` across
processes: one clock on one machine). Every node records when each vote reaches its handler.

Reported:

* ``delivery_ratio``: deliveries / (messages x (N - 1)), counting each node at
  most once per message; ``duplicates`` counts second deliveries (should be 0);
* propagation latency p50/p90/p99/max over all deliveries, and per hop count.
  Hops are not carried in the message (our envelope has no TTL field); the hop
  count of a delivery is the shortest-path distance from the publisher to the
  receiver in the connection graph, sampled every 0.5 s (the snapshot nearest
  to the send time). This is the hop count of the fastest possible route; the
  Plumtree copy may travel a longer path along the tree.

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import logging
import random
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import trio  # noqa: E402

from protocol import NodeKey, Vote  # noqa: E402


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def bfs(graph: dict[str, set[str]], src: str) -> dict[str, int]:
    dist = {src: 0}
    q = collections.deque([src])
    while q:
        u = q.popleft()
        for v in graph.get(u, ()):
            if v not in dist:
                dist[v] = dist[u] + 1
                q.append(v)
    return dist


def encode_id(seq: int, sent: float) -> bytes:
    return struct.pack(">Qd", seq, sent).ljust(32, b"\0")


def decode_id(batch_id: bytes) -> tuple[int, float]:
    return struct.unpack(">Qd", batch_id[:16])


def record_votes(node, into: dict[int, list], clock: Callable[[], float]) -> None:
    """``into[seq] = [first arrival time, copies]`` for every bench vote ``node`` receives."""

    def handler(env) -> None:
        now = clock()
        seq, _ = decode_id(env.body.batch_id)
        rec = into.get(seq)
        if rec is None:
            into[seq] = [now, 1]
        else:
            rec[1] += 1

    node.gossip.on("vote", handler)


async def run_bench(args) -> dict:
    from harness.genesis import overlay_genesis
    from node.p2p.node import P2PConfig
    from node.p2p.testing import NodeFactory

    rng = random.Random(args.seed)
    keys = [NodeKey.generate() for _ in range(args.nodes)]
    publishers = keys[:64]  # a genesis names at most 64 validators
    genesis = overlay_genesis(owner=keys[0], trainer=keys[0], validators=publishers, name="gossip-bench")
    # received[node index][seq] = (receive time, count)
    received: list[dict[int, list]] = [dict() for _ in keys]
    sent: dict[int, tuple[float, int]] = {}  # seq -> (send time, publisher index)
    snapshots: list[tuple[float, dict[str, set[str]]]] = []
    info: dict = {}

    async with trio.open_nursery() as nursery:
        # Production overlay intervals (P2PConfig defaults), not the test factory's short ones.
        prod = P2PConfig()
        net = NodeFactory(
            nursery,
            genesis=genesis,
            target_peers=args.target_peers,
            heartbeat_interval_s=args.heartbeat_s,
            forget_after_s=max(10.0, 5 * args.heartbeat_s),
            conn_interval_s=prod.conn_interval_s,
            px_interval_s=prod.px_interval_s,
            dial_timeout_s=prod.dial_timeout_s,
        )
        t0 = time.perf_counter()
        nodes = []
        for k in keys:
            nodes.append(await net.start(key=k))
        try:
            await net.wait_connected(nodes, min_peers=min(2, args.nodes - 1), timeout=args.connect_timeout)
            info["overlay_formed"] = True
        except trio.TooSlowError:
            # Measure anyway (unless --strict): the delivery ratio then shows what a
            # half-formed overlay delivers; the JSON says the overlay never formed.
            ids = {n.peer_id for n in nodes}
            info["overlay_formed"] = False
            info["connections_at_start"] = [len(n.conns.connected()) if n.conns else 0 for n in nodes]
            info["peers_heard_at_start"] = [len((ids - {n.peer_id}) & set(n.swarm.peers())) for n in nodes]
            if args.strict:
                nursery.cancel_scope.cancel()
                return {
                    "error": f"the overlay did not form within {args.connect_timeout:g} s",
                    "nodes": len(nodes),
                    "rate": args.rate,
                    "one_process": True,
                    "target_peers": args.target_peers,
                    "delivery_ratio": None,
                    "p50_ms": None,
                    "p99_ms": None,
                    **info,
                }
        info["connect_s"] = round(time.perf_counter() - t0, 1)
        index = {n.peer_id: i for i, n in enumerate(nodes)}

        for i, n in enumerate(nodes):
            record_votes(n, received[i], time.perf_counter)

        def snapshot() -> None:
            graph = {n.peer_id: set(n.conns.connected()) & set(index) for n in nodes}
            # a link counts in both directions if either side lists it
            for u, vs in list(graph.items()):
                for v in vs:
                    graph.setdefault(v, set()).add(u)
            snapshots.append((time.perf_counter(), graph))

        async def sampler() -> None:
            while True:
                snapshot()
                await trio.sleep(0.5)

        nursery.start_soon(sampler)
        total = int(args.rate * args.seconds)
        lag_max = 0.0
        # CPU of the quiet overlay (heartbeats, peer exchange) for one second, then under load.
        cpu0 = time.process_time()
        await trio.sleep(1.0)
        info["idle_cpu_per_s"] = round(time.process_time() - cpu0, 3)
        cpu0 = time.process_time()
        start = time.perf_counter()
        for seq in range(total):
            due = start + seq / args.rate
            delay = due - time.perf_counter()
            if delay > 0:
                await trio.sleep(delay)
            else:
                lag_max = max(lag_max, -delay)
            p = rng.randrange(len(publishers))
            node = nodes[p]
            t = time.perf_counter()
            sent[seq] = (t, p)
            await node.gossip.publish(
                Vote(
                    batch_id=encode_id(seq, t),
                    worker=node.peer_id,
                    policy_version=0,
                    accept=True,
                    reason="",
                    rewards=(),
                )
            )
        publish_s = time.perf_counter() - start
        expected = total * (len(nodes) - 1)

        def delivered() -> int:
            return sum(len(r) for r in received)

        drain_start = time.perf_counter()
        while delivered() < expected and time.perf_counter() - drain_start < args.drain:
            await trio.sleep(0.1)
        info["drain_s"] = round(time.perf_counter() - drain_start, 2)
        info["load_cpu_per_s"] = round((time.process_time() - cpu0) / (time.perf_counter() - start), 3)
        info["publish_s"] = round(publish_s, 2)
        info["publish_lag_max_ms"] = round(lag_max * 1000, 1)
        info["connections_per_node"] = round(statistics.mean(len(n.conns.connected()) for n in nodes), 1)
        # Gossip internals summed over nodes: how many copies and repairs the overlay needed.
        totals: collections.Counter = collections.Counter()
        for n in nodes:
            for k, v in n.gossip.status().items():
                if isinstance(v, int):
                    totals[k] += v
        info["gossip_totals"] = dict(sorted(totals.items()))
        nursery.cancel_scope.cancel()

    snap_times = [t for t, _ in snapshots]

    def graph_near(t: float) -> tuple[int, dict[str, set[str]]]:
        si = min(max(bisect.bisect_left(snap_times, t), 0), len(snapshots) - 1) if snapshots else -1
        return si, (snapshots[si][1] if si >= 0 else {})

    peer_ids = [n.peer_id for n in nodes]
    received_by_index = dict(enumerate(received))
    return {**summarise(args, sent, received_by_index, peer_ids, graph_near), "one_process": True, **info}


def summarise(
    args,
    sent: dict[int, tuple[float, int]],
    received: dict[int, dict[int, list]],
    peer_ids: list[str],
    graph_near: Callable[[float], tuple[int, dict[str, set[str]]]],
) -> dict:
    """Delivery ratio, latency percentiles and per-hop numbers from send and receive records.

    ``sent[seq] = (send time, publisher index)``; ``received[node index][seq] = [first
    receive time, copies]``; ``graph_near(t)`` gives (a cache key, the connection graph
    sampled nearest to ``t``).
    """
    dist_cache: dict[tuple[int, int], dict[str, int]] = {}
    latencies: list[float] = []
    by_hop: dict[int, list[float]] = collections.defaultdict(list)
    missing_by_hop: collections.Counter = collections.Counter()
    duplicates = 0
    for seq, (t_sent, p) in sent.items():
        key, graph = graph_near(t_sent)
        if (key, p) not in dist_cache:
            dist_cache[(key, p)] = bfs(graph, peer_ids[p])
        dists = dist_cache[(key, p)]
        for i, pid in enumerate(peer_ids):
            if i == p:
                continue
            hop = dists.get(pid, -1)
            rec = received[i].get(seq)
            if rec is None:
                missing_by_hop[hop] += 1
                continue
            duplicates += rec[1] - 1
            ms = (rec[0] - t_sent) * 1000
            latencies.append(ms)
            by_hop[hop].append(ms)
    latencies.sort()
    expected = len(sent) * (len(peer_ids) - 1)
    result = {
        "nodes": len(peer_ids),
        "rate": args.rate,
        "seconds": args.seconds,
        "messages": len(sent),
        "target_peers": args.target_peers,
        "delivered": len(latencies),
        "expected": expected,
        "delivery_ratio": round(len(latencies) / expected, 6) if expected else None,
        "duplicates": duplicates,
        "p50_ms": round(percentile(latencies, 0.50), 2),
        "p90_ms": round(percentile(latencies, 0.90), 2),
        "p99_ms": round(percentile(latencies, 0.99), 2),
        "max_ms": round(latencies[-1], 2) if latencies else None,
        "by_hop": {},
    }
    for hop in sorted(set(by_hop) | set(missing_by_hop)):
        v = sorted(by_hop.get(hop, []))
        n_exp = len(v) + missing_by_hop.get(hop, 0)
        result["by_hop"][str(hop)] = {
            "deliveries": len(v),
            "delivery_ratio": round(len(v) / n_exp, 6) if n_exp else None,
            "p50_ms": round(percentile(v, 0.5), 2),
            "p99_ms": round(percentile(v, 0.99), 2),
        }
    return result


def print_table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    where = "in one process (one trio loop)" if r.get("one_process", True) else f"in {r['processes']} processes"
    c.print(
        f"{r['nodes']} nodes {where} on 127.0.0.1, target_peers {r['target_peers']}, "
        f"{r['connections_per_node']} connections per node on average; {r['messages']} votes at {r['rate']}/s "
        f"for {r['seconds']} s (published in {r['publish_s']} s, worst publish lag {r['publish_lag_max_ms']} ms); "
        f"waited {r['connect_s']} s for the overlay; drained in {r['drain_s']} s"
    )
    t = Table(title="gossip propagation (hops = shortest path in the connection graph at send time)")
    for col in ("hops", "deliveries", "delivery ratio", "p50 ms", "p99 ms"):
        t.add_column(col, justify="right")
    for hop, h in r["by_hop"].items():
        t.add_row(
            "unreachable" if hop == "-1" else hop,
            str(h["deliveries"]),
            f"{h['delivery_ratio']:.4%}" if h["delivery_ratio"] is not None else "-",
            f"{h['p50_ms']:.1f}",
            f"{h['p99_ms']:.1f}",
        )
    t.add_row(
        "all",
        f"{r['delivered']}/{r['expected']}",
        f"{r['delivery_ratio']:.4%}",
        f"{r['p50_ms']:.1f}",
        f"{r['p99_ms']:.1f}",
        style="bold",
    )
    if not r.get("overlay_formed", True):
        c.print(
            f"[bold red]overlay NOT fully formed before publishing[/]: connections per node "
            f"{r['connections_at_start']}, peers heard from (of {r['nodes'] - 1}) {r['peers_heard_at_start']}"
        )
    c.print(t)
    c.print(f"p90 {r['p90_ms']} ms, max {r['max_ms']} ms, duplicate deliveries {r['duplicates']}")
    if r.get("timeline"):
        tl = Table(title="per second of load (all nodes): when GRAFTs and PRUNEs happen")
        for col in ("second", "p99 ms", "GRAFTs", "PRUNEs", "duplicate frames", "eager links"):
            tl.add_column(col, justify="right")
        for row in r["timeline"]:
            tl.add_row(
                *(str(row[k]) for k in ("second", "p99_ms", "graft_sent", "prune_sent", "duplicates", "eager_links"))
            )
        c.print(tl)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=20)
    p.add_argument("--rate", type=float, default=100.0, help="messages per second, all publishers together")
    p.add_argument("--seconds", type=float, default=10.0, help="how long to publish")
    p.add_argument("--target-peers", type=int, default=6, help="connections each node keeps (production default 6)")
    p.add_argument("--heartbeat-s", type=float, default=2.0, help="heartbeat interval (production default 2 s)")
    p.add_argument("--drain", type=float, default=30.0, help="seconds to wait for stragglers after publishing")
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=120.0,
        help="wait this long for every node to hear every other; then measure anyway (see --strict)",
    )
    p.add_argument("--strict", action="store_true", help="fail instead of measuring when the overlay did not form")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--libp2p-logs", action="store_true", help="print py-libp2p's error logs instead of counting them")
    p.add_argument(
        "--procs",
        type=int,
        default=2,
        help="OS processes to spread the nodes over (1: all in this process; see bench/gossip_procs.py)",
    )
    p.add_argument("--shard", type=int, default=None, help=argparse.SUPPRESS)  # internal: one shard of --procs
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    args = p.parse_args()
    if args.nodes < 2:
        p.error("--nodes must be at least 2")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from node.p2p.host import attach_libp2p_logging

    attach_libp2p_logging(logging.ERROR)
    for h in logging.getLogger("libp2p").handlers:  # some libp2p child loggers set INFO themselves
        h.setLevel(logging.ERROR)
    counter = _CountingHandler()
    if not args.libp2p_logs:  # count py-libp2p's errors instead of printing their tracebacks
        lg = logging.getLogger("libp2p")
        for h in list(lg.handlers):
            lg.removeHandler(h)
        lg.addHandler(counter)
    if args.procs > 1:
        from bench import gossip_procs

        if args.shard is not None:
            gossip_procs.shard_main(args, encode_id, decode_id)
            return
        result = gossip_procs.coordinate(args, argv)
    else:
        result = trio.run(run_bench, args)
    result["libp2p_error_logs"] = counter.count
    if "error" in result:
        print(
            f"FAILED: {result['error']}; connections per node {result['connections_at_start']}, "
            f"peers heard from per node {result['peers_heard_at_start']}"
        )
    else:
        print_table(result)
    print(json.dumps(result))


class _CountingHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


if __name__ == "__main__":
    main()
