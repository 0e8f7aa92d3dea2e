"""Hostile-network benchmark: honest gossip delivery and latency while attackers flood.

    python bench/hostile.py [--honest 6] [--attackers 5] [--rate 2000] [--phase-s 15]
                            [--scenarios quiet,invalid,replay,useless,connections]

Honest side (this process): ``--honest`` real primenode nodes (libp2p hosts, our
validated flood gossip, peer policy) in one trio process; one of them publishes
``--honest-rate`` small signed announcements per second, every other honest node
records when each arrives. Per scenario: delivery ratio (received / expected
(message, receiver) pairs after a grace period) and p50/p99 latency, bad inputs
the honest nodes dropped, bans, the process's RSS (all honest nodes share ONE
process: the number is process RSS, not per node), internal failures.

Attackers (a separate OS process, ``--attacker-child``, so their CPU is their own
process's): ``--attackers`` concurrent attackers, each on its own fresh identity
(a new ed25519 key and libp2p host), connected to one honest node, writing
``--rate`` frames per second on the gossip protocol. A banned identity is
replaced by a fresh one, and the attacker keeps going. Scenarios:

* ``invalid``: envelopes with bad signatures, wrong run ids, garbage msgpack,
  wrong topics (each costs the receiver a validation, and is charged);
* ``invalid_noban``: the same, with the honest nodes' misbehaviour budget set
  to infinity for the phase: nobody is banned, every attacker keeps its one
  connection and pushes the full rate (the validation cost at full rate, i.e.
  the worst case for latency; bans are what normally cut it short);
* ``replay``: one valid message re-sent (duplicates, free to drop) and reused
  sequence numbers with new content (charged as replays);
* ``useless``: valid, correctly signed announcements of batches that do not
  exist, from the attackers' identities (the rate limit and the announce
  fairness caps are what stop them);
* ``connections``: each attacker opens ``--conn-identities`` fresh-identity
  connections to the same honest node and holds them.

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import trio  # noqa: E402

from protocol import NodeKey, RolloutAnnounce, Vote, seal  # noqa: E402
from protocol.schema import pack, unpack  # noqa: E402

SCENARIOS = ("quiet", "invalid", "invalid_noban", "replay", "useless", "connections")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ===================================================================== attacker process


def _frames(mode: str, key: NodeKey, run_id: bytes, topics: dict[str, str], rnd: random.Random) -> list[bytes]:
    """Length-prefixed gossip frames for one identity."""
    out = []
    ann = lambda i: RolloutAnnounce(batch_id=rnd.randbytes(32), policy_version=0, batch_counter=i, num_samples=1,
                                    size_bytes=1)
    if mode == "invalid":
        for i in range(64):
            env = unpack(seal(key, run_id, ann(i), now_ms(), time.time_ns()))
            k = i % 4
            if k == 0:
                env[7] = rnd.randbytes(64)  # bad signature
                frame = pack([topics["rollout"], pack(env)])
            elif k == 1:
                frame = pack([topics["rollout"], seal(key, b"X" * 32, ann(i), now_ms(), time.time_ns())])  # other run
            elif k == 2:
                frame = rnd.randbytes(rnd.randint(1, 200))  # garbage
            else:
                frame = pack([topics["vote"], pack(env)])  # wrong topic for the type
            out.append(len(frame).to_bytes(4, "big") + frame)
    elif mode == "replay":
        same = pack([topics["rollout"], seal(key, run_id, ann(0), now_ms(), 1)])
        for i in range(64):
            if i % 2:
                frame = same  # exact duplicate
            else:
                frame = pack([topics["rollout"], seal(key, run_id, ann(i), now_ms(), 1)])  # seq 1 reused
            out.append(len(frame).to_bytes(4, "big") + frame)
    return out


async def _one_attacker(idx: int, args, run_id: bytes, topics, target: str, stats: dict, stop: float) -> None:
    from libp2p.peer.id import ID

    from node.p2p.gossip import GOSSIP_PROTOCOL
    from node.p2p.host import closing_host, make_host, parse_peer_addr

    rnd = random.Random(idx)
    info = parse_peer_addr(target)
    per_tick = max(1, int(args.rate * 0.02))  # frames per 20 ms tick
    while time.monotonic() < stop:
        key = NodeKey.generate()
        stats["identities"] += 1
        host = make_host(key)
        try:
            async with closing_host(host, ["/ip4/127.0.0.1/tcp/0"]):
                with trio.fail_after(10):
                    await host.connect(info)
                if args.mode == "connections":
                    extra = []
                    async with trio.open_nursery() as nursery:
                        for _ in range(args.conn_identities):
                            nursery.start_soon(_hold_connection, info, stats, stop, extra)
                    return
                stream = await host.new_stream(ID.from_base58(info.peer_id.to_base58()), [GOSSIP_PROTOCOL])
                pool = _frames(args.mode, key, run_id, topics, rnd) if args.mode != "useless" else None
                i = 0
                next_t = time.monotonic()
                while time.monotonic() < stop:
                    if pool is None:  # valid, signed, useless: fresh each time (not duplicates)
                        batch = []
                        for _ in range(per_tick):
                            f = pack([topics["rollout"], seal(key, run_id, RolloutAnnounce(
                                batch_id=rnd.randbytes(32), policy_version=0, batch_counter=i, num_samples=1,
                                size_bytes=1), now_ms(), time.time_ns())])
                            batch.append(len(f).to_bytes(4, "big") + f)
                            i += 1
                    else:
                        batch = [pool[(i + j) % len(pool)] for j in range(per_tick)]
                        i += per_tick
                    with trio.fail_after(5):
                        await stream.write(b"".join(batch))
                    stats["sent"] += len(batch)
                    next_t += 0.02
                    await trio.sleep(max(0.0, next_t - time.monotonic()))
        except Exception as exc:  # banned / reset: a fresh identity takes over
            stats["resets"] += 1
            stats["last_error"] = f"{type(exc).__name__}: {exc}"[:120]
            await trio.sleep(0.05)


async def _hold_connection(info, stats, stop, keep) -> None:
    from node.p2p.host import closing_host, make_host

    host = make_host(NodeKey.generate())
    stats["identities"] += 1
    try:
        async with closing_host(host, ["/ip4/127.0.0.1/tcp/0"]):
            with trio.fail_after(10):
                await host.connect(info)
            stats["sent"] += 1  # one connection opened
            await trio.sleep(max(0.0, stop - time.monotonic()))
    except Exception as exc:
        stats["resets"] += 1
        stats["last_error"] = f"{type(exc).__name__}: {exc}"[:120]


async def attacker_main(args) -> None:
    run_id = bytes.fromhex(args.run_id)
    from protocol.topics import topic

    topics = {k: topic(run_id, k) for k in ("rollout", "vote", "heartbeat")}
    targets = args.targets.split(",")
    stop = time.monotonic() + args.duration
    stats = {"sent": 0, "identities": 0, "resets": 0, "last_error": ""}
    t0 = time.monotonic()
    async with trio.open_nursery() as nursery:
        for i in range(args.attackers):
            nursery.start_soon(_one_attacker, i, args, run_id, topics, targets[i % len(targets)], stats, stop)
    stats["seconds"] = time.monotonic() - t0
    print(json.dumps(stats), flush=True)


# ===================================================================== honest process


class Probe:
    """Publishes tagged announcements from one node and records arrivals at the others."""

    def __init__(self, nodes) -> None:
        self.nodes = nodes
        self.src = nodes[0]
        self.sent: dict[int, float] = {}
        self.arrivals: dict[int, dict[str, float]] = {}
        for n in nodes[1:]:
            n.gossip.on("rollout", lambda env, pid=n.peer_id: self._arrive(env, pid))
        self.tag = 1 << 200  # honest tags live far from anything an attacker sends

    def _arrive(self, env, pid: str) -> None:
        if env.sender != self.src.peer_id:
            return
        tag = int.from_bytes(env.body.batch_id, "big")
        if tag in self.sent:
            self.arrivals.setdefault(tag, {}).setdefault(pid, time.monotonic())

    async def publish_for(self, seconds: float, rate: float) -> list[int]:
        tags = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.tag += 1
            tags.append(self.tag)
            self.sent[self.tag] = time.monotonic()
            await self.src.gossip.publish(RolloutAnnounce(batch_id=self.tag.to_bytes(32, "big"), policy_version=0,
                                                          batch_counter=0, num_samples=1, size_bytes=1))
            await trio.sleep(1.0 / rate)
        return tags

    def summary(self, tags: list[int]) -> dict:
        receivers = [n.peer_id for n in self.nodes[1:]]
        lat = []
        got = 0
        for t in tags:
            arr = self.arrivals.get(t, {})
            for pid in receivers:
                if pid in arr:
                    got += 1
                    lat.append((arr[pid] - self.sent[t]) * 1000)
        lat.sort()
        pct = lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 1) if lat else None
        expected = len(tags) * len(receivers)
        return {"honest_sent": len(tags), "expected": expected, "delivered": got,
                "delivery": round(got / expected, 4) if expected else None, "lost": expected - got,
                "p50_ms": pct(0.50), "p99_ms": pct(0.99), "max_ms": round(lat[-1], 1) if lat else None}


def _counters(nodes) -> dict:
    dropped = sum(sum(n.metrics.dropped.values()) for n in nodes)
    internal = sum(n.metrics.dropped["internal"] + sum(c["internal"] for c in n.metrics.req.values()) for n in nodes)
    bans = sum(len(n.policy.banned()) for n in nodes)
    tables = {k: max(n.policy.sizes()[k] for n in nodes) for k in ("scores", "bans", "buckets")}
    tables["swarm_view"] = max(len(n.swarm._peers) for n in nodes)
    tables["book"] = max(len(n.conns.book) for n in nodes)
    tables["seen_cache"] = max(len(n.gossip._seen) for n in nodes)
    tables["connections"] = max(len(n.conns.connected()) for n in nodes)
    return {"dropped": dropped, "internal": internal, "bans": bans, "tables": tables,
            "trimmed": sum(n.conns.trimmed for n in nodes)}


async def honest_main(args) -> dict:
    from node.p2p.testing import NodeFactory

    results = []
    async with trio.open_nursery() as nursery:
        net = NodeFactory(nursery, target_peers=args.target_peers, heartbeat_interval_s=1.0)
        nodes = [await net.start() for _ in range(args.honest)]
        await net.wait_connected(min_peers=2, timeout=120)
        probe = Probe(nodes)
        await probe.publish_for(2.0, args.honest_rate)  # warm-up, not counted
        await trio.sleep(2.0)
        run_id = nodes[0].run_id
        # attackers target every honest node except the publisher
        targets = ",".join(n.full_addrs()[0] for n in nodes[1:])
        for scen in args.scenarios:
            before = _counters(nodes)
            rss_before = rss_mib()
            child_stats = None
            proc = None
            budgets = [n.policy.budget for n in nodes]
            if scen == "invalid_noban":
                for n in nodes:
                    n.policy.budget = float("inf")
            if scen != "quiet":
                mode = "invalid" if scen == "invalid_noban" else scen
                proc = await trio.lowlevel.open_process(
                    [sys.executable, __file__, "--attacker-child", "--mode", mode, "--run-id", run_id.hex(),
                     "--targets", targets, "--attackers", str(args.attackers), "--rate", str(args.rate),
                     "--duration", str(args.phase_s + 3), "--conn-identities", str(args.conn_identities)],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                await trio.sleep(3.0)  # attackers connect and ramp up first
            peak = rss_mib()
            tags: list[int] = []

            async def sample_rss():
                nonlocal peak
                while True:
                    peak = max(peak, rss_mib())
                    await trio.sleep(0.5)

            async with trio.open_nursery() as inner:
                inner.start_soon(sample_rss)
                tags = await probe.publish_for(args.phase_s, args.honest_rate)
                await trio.sleep(args.grace_s)
                inner.cancel_scope.cancel()
            if proc is not None:
                with trio.move_on_after(30):
                    out = b""
                    while True:
                        chunk = await proc.stdout.receive_some(65536)
                        if not chunk:
                            break
                        out += chunk
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                try:
                    child_stats = json.loads(out.decode().strip().splitlines()[-1])
                except Exception:
                    child_stats = {"error": out.decode()[-300:]}
            for n, b in zip(nodes, budgets):
                n.policy.budget = b
            after = _counters(nodes)
            res = {"scenario": scen, **probe.summary(tags), "rss_mib": round(rss_before, 1), "peak_rss_mib": round(peak, 1),
                   "bad_inputs_dropped": after["dropped"] - before["dropped"], "bans": after["bans"],
                   "internal_failures": after["internal"], "crashes": 0, "tables": after["tables"],
                   "connections_trimmed": after["trimmed"] - before["trimmed"]}
            if child_stats is not None:
                secs = child_stats.get("seconds") or 1
                res.update({"attack_sent": child_stats.get("sent"),
                            "attack_rate_per_s": round(child_stats.get("sent", 0) / secs, 1),
                            "attack_identities": child_stats.get("identities"),
                            "attacker_resets": child_stats.get("resets")})
            results.append(res)
            print(json.dumps(res), flush=True)
            await trio.sleep(2.0)
        alive = all(n.ready.is_set() for n in nodes)
        nursery.cancel_scope.cancel()
    return {"results": results, "alive": alive}


def render(out: dict, args) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return
    t = Table(title=f"hostile.py: {args.honest} honest nodes (one process), {args.attackers} attackers x {args.rate}/s")
    for col in ("scenario", "attack/s sent", "identities", "delivery", "lost", "p50 ms", "p99 ms", "p99 / quiet",
                "bad inputs", "bans", "peak RSS MiB", "internal"):
        t.add_column(col)
    quiet = next((r["p99_ms"] for r in out["results"] if r["scenario"] == "quiet"), None)
    for r in out["results"]:
        ratio = f"{r['p99_ms'] / quiet:.2f}" if quiet and r["p99_ms"] else "-"
        t.add_row(r["scenario"], str(r.get("attack_rate_per_s", "-")), str(r.get("attack_identities", "-")),
                  f"{r['delivery']:.2%}" if r["delivery"] is not None else "-", str(r["lost"]), str(r["p50_ms"]),
                  str(r["p99_ms"]), ratio, str(r["bad_inputs_dropped"]), str(r["bans"]), str(r["peak_rss_mib"]),
                  str(r["internal_failures"]))
    Console(stderr=True).print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--honest", type=int, default=6)
    ap.add_argument("--target-peers", type=int, default=4)
    ap.add_argument("--attackers", type=int, default=5)
    ap.add_argument("--rate", type=float, default=2000.0, help="frames per second per attacker")
    ap.add_argument("--honest-rate", type=float, default=20.0)
    ap.add_argument("--phase-s", type=float, default=15.0)
    ap.add_argument("--grace-s", type=float, default=5.0)
    ap.add_argument("--conn-identities", type=int, default=20)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    # attacker child
    ap.add_argument("--attacker-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="invalid")
    ap.add_argument("--run-id", default="")
    ap.add_argument("--targets", default="")
    ap.add_argument("--duration", type=float, default=10.0)
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.ERROR)
    for name in ("libp2p", "primenode", "multiaddr", "trio"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if args.attacker_child:
        trio.run(attacker_main, args)
        return
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    t0 = time.monotonic()
    out = trio.run(honest_main, args)
    render(out, args)
    quiet = next((r for r in out["results"] if r["scenario"] == "quiet"), None)
    final = {"honest_nodes": args.honest, "attackers": args.attackers, "rate_per_attacker": args.rate,
             "phase_s": args.phase_s, "rss_note": "process RSS of the one process running every honest node",
             "alive": out["alive"], "crashes": 0 if out["alive"] else 1, "seconds": round(time.monotonic() - t0, 1),
             "scenarios": {r["scenario"]: r for r in out["results"]}}
    if quiet and quiet["p99_ms"]:
        final["p99_over_quiet"] = {r["scenario"]: round(r["p99_ms"] / quiet["p99_ms"], 2)
                                   for r in out["results"] if r["p99_ms"]}
    goal = final["scenarios"].get("invalid")
    if goal and quiet:
        final["goal_met"] = bool(goal["delivery"] == 1.0 and goal["p99_ms"] <= 2 * quiet["p99_ms"])
    print(json.dumps(final))


if __name__ == "__main__":
    main()
