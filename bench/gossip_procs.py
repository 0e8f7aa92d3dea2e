"""Multi-process mode of bench/gossip.py: the N nodes split over P OS processes.

    python bench/gossip.py --procs 2 [--nodes 20] [--rate 100] [--seconds 10]

Why: one trio loop is one core; a deployment runs one node per machine. With
``--procs P`` the coordinator starts P shard processes (``--shard i``), each
running N/P nodes on 127.0.0.1. They agree on everything through the seed
(node keys, genesis, who publishes message k) and a work directory:

1. shard 0 starts the bootstrap node and writes its addresses (``bootstrap.json``);
2. every shard starts its nodes, waits until each of them has heard every
   other node's heartbeat (the whole overlay, across processes) and writes
   ``ready-i``;
3. the coordinator writes ``go`` with a start time a second ahead; message k is
   due at start + k / rate and is published by the shard that hosts its
   (seeded, random) publisher; the send time (``time.time``, one clock for all
   processes on this machine) rides in the vote's ``batch_id``;
4. each shard waits until its nodes hold every message (or the drain timeout),
   writes ``result-i.json`` (receipts, connection snapshots, CPU seconds,
   gossip totals) and keeps serving until the coordinator writes ``stop``.

The coordinator merges the shards' receipts into the same report as one process.
"""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from protocol import NodeKey, Vote

POLL = 0.1


def seeded_keys(seed: int, n: int) -> list[NodeKey]:
    rng = random.Random(f"gossip-bench-keys/{seed}")
    return [NodeKey(rng.randbytes(32)) for _ in range(n)]


def schedule(seed: int, total: int, n_publishers: int) -> list[int]:
    rng = random.Random(f"gossip-bench-publishers/{seed}")
    return [rng.randrange(n_publishers) for _ in range(total)]


def shard_of(index: int, procs: int) -> int:
    return index % procs


async def _wait_file(path: Path, timeout: float) -> str:
    with trio.fail_after(timeout):
        while not path.exists():
            await trio.sleep(POLL)
    return path.read_text()


async def run_shard(args, encode_id, decode_id) -> None:
    from harness.genesis import overlay_genesis
    from node.p2p.node import P2PConfig
    from node.p2p.testing import NodeFactory

    work = Path(args.workdir)
    keys = seeded_keys(args.seed, args.nodes)
    publishers = keys[:64]
    genesis = overlay_genesis(
        owner=keys[0], trainer=keys[0], validators=publishers, name="gossip-bench", created_ms=1_700_000_000_000
    )
    mine = [i for i in range(args.nodes) if shard_of(i, args.procs) == args.shard]
    received: dict[int, dict[int, list]] = {i: {} for i in mine}
    snapshots: list[tuple[float, dict[str, list[str]]]] = []
    prod = P2PConfig()
    async with trio.open_nursery() as nursery:
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
        nodes = {}
        if args.shard == 0:
            nodes[0] = await net.start(key=keys[0])
            (work / "bootstrap.json").write_text(json.dumps(nodes[0].full_addrs()))
        boot = json.loads(await _wait_file(work / "bootstrap.json", 60))
        for i in mine:
            if i not in nodes:
                nodes[i] = await net.start(key=keys[i], bootstrap=boot)
        all_ids = {k.peer_id for k in keys}

        def whole_overlay() -> bool:
            return all(
                len(n.conns.connected()) >= 2 and (all_ids - {n.peer_id}) <= set(n.swarm.peers())
                for n in nodes.values()
            )

        with trio.move_on_after(args.connect_timeout):
            while not whole_overlay():
                await trio.sleep(0.2)
        (work / f"ready-{args.shard}").write_text(json.dumps(whole_overlay()))

        from bench.gossip import record_votes

        for i, n in nodes.items():
            record_votes(n, received[i], time.time)

        counter_series: list[tuple[float, dict[str, int]]] = []

        def counter_sum() -> dict[str, int]:
            c: collections.Counter = collections.Counter()
            for n in nodes.values():
                st = n.gossip.status()
                for k in ("graft_sent", "prune_sent", "duplicates", "relayed_frames", "eager", "lazy"):
                    c[k] += int(st.get(k, 0))
            return dict(c)

        async def sampler() -> None:
            while True:
                snapshots.append((time.time(), {n.peer_id: sorted(n.conns.connected()) for n in nodes.values()}))
                counter_series.append((time.time(), counter_sum()))
                await trio.sleep(0.5)

        nursery.start_soon(sampler)
        start = float(await _wait_file(work / "go", args.connect_timeout + 120))
        total = int(args.rate * args.seconds)
        who = schedule(args.seed, total, len(publishers))
        cpu0 = time.process_time()
        sent, lag_max = {}, 0.0
        for seq, p in enumerate(who):
            if shard_of(p, args.procs) != args.shard:
                continue
            delay = start + seq / args.rate - time.time()
            if delay > 0:
                await trio.sleep(delay)
            else:
                lag_max = max(lag_max, -delay)
            t = time.time()
            sent[seq] = (t, p)
            node = nodes[p]
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
        await trio.sleep_until(trio.current_time() + max(0.0, start + total / args.rate - time.time()))
        want = {i: {s for s, p in enumerate(who) if p != i} for i in mine}
        drain_start = time.time()
        while time.time() - drain_start < args.drain and any(want[i] - set(received[i]) for i in mine):
            await trio.sleep(0.1)
        totals: collections.Counter = collections.Counter()
        for n in nodes.values():
            for k, v in n.gossip.status().items():
                if isinstance(v, int):
                    totals[k] += v
        result = {
            "shard": args.shard,
            "nodes": {i: nodes[i].peer_id for i in mine},
            "received": {i: {s: r for s, r in rec.items()} for i, rec in received.items()},
            "sent": sent,
            "snapshots": snapshots,
            "publish_lag_max_ms": round(lag_max * 1000, 1),
            "load_cpu_s": time.process_time() - cpu0,
            "load_wall_s": time.time() - start,
            "connections": [len(n.conns.connected()) for n in nodes.values()],
            "gossip_totals": dict(totals),
            "counter_series": counter_series,
        }
        tmp = work / f"result-{args.shard}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.rename(work / f"result-{args.shard}.json")
        await _wait_file(work / "stop", 600)
        nursery.cancel_scope.cancel()


def coordinate(args, argv: list[str]) -> dict:
    """Start the shards, give the start signal, merge their reports."""
    work = Path(tempfile.mkdtemp(prefix="gossip-bench-"))
    script = str(Path(__file__).resolve().parent / "gossip.py")
    procs = []
    t0 = time.time()
    for shard in range(args.procs):
        procs.append(subprocess.Popen([sys.executable, script, *argv, "--shard", str(shard), "--workdir", str(work)]))
        if shard == 0:
            while not (work / "bootstrap.json").exists():
                time.sleep(POLL)
    try:
        deadline = time.time() + args.connect_timeout + 60
        while not all((work / f"ready-{s}").exists() for s in range(args.procs)):
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("a shard died or the overlay never formed")
            time.sleep(POLL)
        formed = all(json.loads((work / f"ready-{s}").read_text()) for s in range(args.procs))
        connect_s = round(time.time() - t0, 1)
        (work / "go").write_text(repr(time.time() + 1.0))
        deadline = time.time() + args.seconds + args.drain + 120
        while not all((work / f"result-{s}.json").exists() for s in range(args.procs)):
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("a shard died or never reported")
            time.sleep(POLL)
        shards = [json.loads((work / f"result-{s}.json").read_text()) for s in range(args.procs)]
    finally:
        (work / "stop").write_text("")
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    return merge(args, shards, formed, connect_s)


def merge(args, shards: list[dict], formed: bool, connect_s: float) -> dict:
    from bench.gossip import summarise

    peer_of = {int(i): pid for s in shards for i, pid in s["nodes"].items()}
    peer_ids = [peer_of[i] for i in range(args.nodes)]
    sent = {int(seq): tuple(v) for s in shards for seq, v in s["sent"].items()}
    received = {int(i): {int(seq): r for seq, r in rec.items()} for s in shards for i, rec in s["received"].items()}
    times = [t for t, _ in shards[0]["snapshots"]]

    def graph_near(t: float) -> tuple[int, dict[str, set[str]]]:
        """Every shard's connection snapshot nearest to ``t``, joined into one graph."""
        key = min(range(len(times)), key=lambda k: abs(times[k] - t)) if times else -1
        g: dict[str, set[str]] = collections.defaultdict(set)
        for s in shards:
            if s["snapshots"]:
                _, conns = min(s["snapshots"], key=lambda x: abs(x[0] - t))
                for u, vs in conns.items():
                    for v in vs:
                        g[u].add(v)
                        g[v].add(u)
        return key, g

    totals: collections.Counter = collections.Counter()
    for s in shards:
        totals.update(s["gossip_totals"])
    conns = [c for s in shards for c in s["connections"]]
    return {
        **summarise(args, sent, received, peer_ids, graph_near),
        "one_process": False,
        "processes": args.procs,
        "overlay_formed": formed,
        "connect_s": connect_s,
        "drain_s": None,
        "publish_s": args.seconds,
        "publish_lag_max_ms": max(s["publish_lag_max_ms"] for s in shards),
        "connections_per_node": round(sum(conns) / len(conns), 1),
        "load_cpu_per_s": round(sum(s["load_cpu_s"] / max(s["load_wall_s"], 1e-9) for s in shards), 3),
        "gossip_totals": dict(sorted(totals.items())),
        "timeline": timeline(args, shards, sent, received),
    }


def timeline(args, shards: list[dict], sent: dict, received: dict) -> list[dict]:
    """Per second of the load: p99 latency of the messages sent in it, and the GRAFTs, PRUNEs,
    duplicate frames and eager links of all nodes (to see when a GRAFT storm happens)."""
    if not sent:
        return []
    t0 = min(t for t, _ in sent.values())
    lat: dict[int, list[float]] = collections.defaultdict(list)
    for seq, (t_sent, _p) in sent.items():
        for rec in received.values():
            r = rec.get(seq)
            if r is not None:
                lat[int(t_sent - t0)].append((r[0] - t_sent) * 1000)

    def counters_at(t: float) -> collections.Counter:
        c: collections.Counter = collections.Counter()
        for s in shards:
            series = s.get("counter_series") or []
            if series:
                c.update(min(series, key=lambda x: abs(x[0] - t))[1])
        return c

    rows = []
    for sec in range(int(args.seconds) + 1):
        if sec not in lat:
            continue
        v = sorted(lat[sec])
        a, b = counters_at(t0 + sec), counters_at(t0 + sec + 1)
        rows.append(
            {
                "second": sec,
                "p99_ms": round(v[min(len(v) - 1, int(0.99 * len(v)))], 1),
                "graft_sent": b["graft_sent"] - a["graft_sent"],
                "prune_sent": b["prune_sent"] - a["prune_sent"],
                "duplicates": b["duplicates"] - a["duplicates"],
                "eager_links": b["eager"],
            }
        )
    return rows


def shard_main(args, encode_id, decode_id) -> None:
    os.environ.setdefault("PYTHONHASHSEED", "0")
    trio.run(run_shard, args, encode_id, decode_id)
