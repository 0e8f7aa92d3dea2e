"""WAN benchmark: a whole network across namespace hosts, some behind NAT, with mixed link caps.

    python bench/wan.py [--steps 6] [--workers 5] [--nat-workers 2] [--validators 2]
                        [--no-baseline] [--timeout 1500] [--out DIR]
                        [--gossip-nodes 20] [--gossip-seconds 90] [--skip-network] [--skip-gossip]

Needs root (network namespaces, iptables; see harness/netns.py). Every node is a
real ``primenode`` process in its own host: bootstrap, trainer, validators and workers;
the last ``--nat-workers`` workers sit behind their own NAT router (iptables MASQUERADE,
outbound only). Each host has its own up/down caps (tc tbf), from 20 to 1000 Mbit/s.
The network trains the tiny devnet model for ``--steps`` steps.

Reported per run:
* batches admitted per worker (from the trainer's ledger), NAT'd ones marked;
* reachability each node found (AutoNAT) and the relays NAT'd nodes use;
* bytes that crossed relays (circuit relay v2: control traffic only; bulk never goes
  through a relay) and checkpoint bytes served by each NAT'd worker (goal > 0: a NAT'd
  node serves public fetchers over TCP connections it opens to their data ports, the
  "reverse" connections of protocol/chunk_frames.py), with how many of those it opened;
* checkpoint distribution time per version (trainer holds it -> every worker and
  validator holds all its chunks; polled every second, so +-1 s) next to the bound set by the
  seeder's uplink and each fetcher's downlink (size / cap);
* gossip delivery of heartbeats (arrival time minus the signed send time, one kernel
  clock for all namespaces): p50 and p99 per node.

Baseline in the same run (unless ``--no-baseline``): the same network with every node
public and uncapped.

Latency and loss (the kernel here has no netem): ``--gossip-nodes`` overlay nodes
(harness/nat_child.py, heartbeats every second) on a userspace switch
(harness/lossy_switch.py) that delays each frame by the two hosts' one-way delays
(round trips spread over 50-200 ms) and drops 1% of frames; the same nodes with no delay
and no loss on the same switch are the baseline, and delay without loss separates the
two. The bootstrap starts first, the rest once it listens; measuring starts once every node
has heard every other (start-up is not delivery) and lasts ``--gossip-seconds``; nodes use the
deployed connection, peer-exchange and AutoNAT intervals. Reported: heartbeat delivery
(arrival minus signed send time) p50 / p99 per node, how many peers each node heard from,
and the share of the heartbeats sent in the window that each node accepted.

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.netns import Testbed, skip_reason  # noqa: E402
from harness.wan import Placement, WanDevnet  # noqa: E402
from node.ops.devnet import DevnetOptions  # noqa: E402

CAPS = [20, 50, 100, 200, 1000]  # Mbit/s, cycled over workers (up = down)


def placements(workers: int, nat_workers: int, validators: int, capped: bool) -> dict[str, Placement]:
    def cap(mbit: float | None) -> dict:
        return {"up_mbit": mbit, "down_mbit": mbit} if capped else {}

    out = {"bootstrap": Placement(**cap(1000)), "trainer": Placement(**cap(1000))}
    for i in range(validators):
        out[f"validator-{i}"] = Placement(**cap(200))
    for i in range(workers):
        out[f"worker-{i}"] = Placement(nat=capped and i >= workers - nat_workers, **cap(CAPS[i % len(CAPS)]))
    return out


def run_once(args, out: Path, nat_workers: int, capped: bool) -> dict:
    opts = DevnetOptions(
        out=out,
        workers=args.workers,
        validators=args.validators,
        quorum=args.validators,
        steps=args.steps + 1000,  # the bench stops it
        prompts_per_batch=2,
        group_size=4,
        max_tokens=16,
        extra_config={
            "tiny_hidden_size": 64,
            "tiny_layers": 2,
            "batches_per_step": 1,
            "worker_batches_per_version": 1,
            "worker_idle_s": 5.0,
        },
    )
    place = placements(args.workers, nat_workers, args.validators, capped)
    learners = [n for n in place if n.startswith(("worker", "validator"))]
    first_held: dict[int, dict[str, float]] = {}  # version -> node -> first poll that had it loaded
    sizes: dict[int, int] = {}
    t_start = time.time()
    with Testbed() as tb, WanDevnet(opts, place, tb) as wan:
        step = 0
        while time.time() - t_start < args.timeout:
            time.sleep(1.0)
            snap = {n: wan.status(n) or {} for n in place}
            for name, st in snap.items():
                rs = st.get("role_state") or {}
                v = rs.get("policy_version")
                at = st.get("polled_at", time.time())
                # held: every chunk of the version verified on disk (or a newer one loaded)
                for ver in (rs.get("distribution") or {}).get("versions") or []:
                    if ver.get("complete"):
                        first_held.setdefault(ver["version"], {}).setdefault(name, at)
                if isinstance(v, int):
                    for u in range(0, v + 1):
                        first_held.setdefault(u, {}).setdefault(name, at)
                if name == "trainer":
                    for ver in (rs.get("distribution") or {}).get("versions") or []:
                        sizes[ver["version"]] = ver["bytes_total"]
            step = (snap["trainer"].get("role_state") or {}).get("step") or 0
            dead = [n.name for n in wan.nodes if n.proc is not None and n.proc.poll() is not None]
            if dead:
                raise SystemExit(f"{dead} exited{wan.logs()}")
            print(f"  [{time.time() - t_start:5.0f}s] step {step}/{args.steps}", file=sys.stderr, flush=True)
            if step >= args.steps:
                break
        snap = {n: wan.status(n) or {} for n in place}
        ids = {n.name: n.home.load_key().peer_id for n in wan.nodes}
        genesis_validators = [ids[n] for n in place if n.startswith("validator")]
        ledger_path = wan.node("trainer").home.ledger_path
    # after stop: read the trainer's ledger through its read seam
    from node.roles.ledger import Ledger

    ledger = Ledger(ledger_path, genesis_validators, len(genesis_validators), 2)
    admitted = {n: len(ledger.records(worker=ids[n], ever_admitted=True)) for n in place if n.startswith("worker")}
    ledger.close()

    nat = {n: (snap[n].get("nat") or {}) for n in place}
    relayed = sum((nat[n].get("relay_service") or {}).get("bytes_relayed", 0) for n in place)
    dist_of = {n: ((snap[n].get("role_state") or {}).get("distribution") or {}) for n in place}
    served_by_nat = {n: dist_of[n].get("bytes_served", 0) for n in place if place[n].nat}
    reverse_by_nat = {
        n: {
            "bytes_served_reverse": dist_of[n].get("bytes_served_reverse", 0),
            "connections_opened": (dist_of[n].get("reverse") or {}).get("served_connections", 0),
            "asked": (dist_of[n].get("reverse") or {}).get("granted", 0),
            # what the fetchers did over those connections (ChunkServer.reverse counters)
            "counters": dist_of[n].get("reverse") or {},
            "versions": [
                {k: v.get(k) for k in ("version", "bytes_served", "fed_from")}
                for v in (dist_of[n].get("versions") or [])
            ],
        }
        for n in place
        if place[n].nat
    }
    reverse_taken = {n: (dist_of[n].get("reverse") or {}).get("accepted", 0) for n in place if not place[n].nat}
    dist = []
    seeder_up = place["trainer"].up_mbit
    for v in sorted(first_held):
        if v == 0 or "trainer" not in first_held[v] or not all(n in first_held[v] for n in learners):
            continue
        t = max(first_held[v][n] for n in learners) - first_held[v]["trainer"]
        size = sizes.get(v, 0)
        downs = [place[n].down_mbit for n in learners if place[n].down_mbit]
        bound = max([size * 8 / (c * 1e6) for c in [seeder_up, *downs] if c] or [0.0])
        dist.append({"version": v, "seconds": round(max(t, 0.0), 1), "bound_s": round(bound, 3), "bytes": size})
    delivery = {n: ((snap[n].get("swarm") or {}).get("heartbeat_delivery") or {}) for n in place}
    p99s = [d["p99_ms"] for d in delivery.values() if "p99_ms" in d]
    return {
        "capped": capped,
        "nat_workers": [n for n in place if place[n].nat],
        "caps_mbit": {n: place[n].up_mbit for n in place},
        "steps": step,
        "seconds": round(time.time() - t_start, 1),
        "admitted_per_worker": admitted,
        "reachability": {n: nat[n].get("reachability") for n in place},
        "relays_of_nat_nodes": {n: sorted(nat[n].get("relays") or {}) for n in place if place[n].nat},
        "hole_punched": {n: len(nat[n].get("hole_punched") or []) for n in place},
        "relay_bytes": relayed,
        "checkpoint_bytes_served_by_nat_nodes": served_by_nat,
        "nat_reverse_serving": reverse_by_nat,
        "reverse_connections_taken_by_public_nodes": reverse_taken,
        "distribution": dist,
        "gossip_delivery_ms": {n: delivery[n] for n in place},
        "gossip_p99_ms_max": max(p99s) if p99s else None,
        "gossip_p99_ms_median": statistics.median(p99s) if p99s else None,
    }


def gossip_once(
    n: int, seconds: float, rtt_ms: tuple[float, float], loss: float, out: Path, warmup_s: float = 120.0
) -> dict:
    """``n`` overlay nodes on the emulating switch; heartbeat delivery over ``seconds`` of steady state.

    The bootstrap (node 0) starts first; the others once it listens. Measuring starts when every
    node has heard every other (or after ``warmup_s``, noted as ``warm: false``): start-up
    (imports, handshakes, the first AutoNAT round) is not gossip delivery. Nodes use the
    deployed connection, peer-exchange and AutoNAT intervals."""
    import os
    import subprocess

    from protocol import NodeKey

    out.mkdir(parents=True, exist_ok=True)
    lo, hi = rtt_ms[0] / 4, rtt_ms[1] / 4  # one-way delay per host: rtt(i, j) = 2 (d_i + d_j)
    delays = [lo + (hi - lo) * i / max(1, n - 1) for i in range(n)]
    keys = [NodeKey(os.urandom(32)) for _ in range(n)]
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    measure_file = out / "measure"
    measure_file.unlink(missing_ok=True)

    def status(i: int) -> dict:
        try:
            return json.loads((out / f"g{i}.json").read_text())
        except (OSError, ValueError):
            return {}

    with Testbed(emulate=True) as tb:
        hosts = [tb.add_public(f"g{i}", delay_ms=d) for i, d in enumerate(delays)]
        tb.start_switch(loss=loss, seed=1)
        boot = f"/ip4/{hosts[0].ip}/tcp/4001/p2p/{keys[0].peer_id}"
        t0 = time.time()
        for i, (h, k) in enumerate(zip(hosts, keys, strict=True)):
            args = [sys.executable, "-m", "harness.nat_child", "--seed", k.seed.hex(), "--heartbeat-s", "1"]
            args += ["--listen", f"/ip4/{h.ip}/tcp/4001", "--status", str(out / f"g{i}.json")]
            args += ["--deployed-intervals", "--nat-interval-s", "60", "--measure-file", str(measure_file)]
            if i:
                args += ["--bootstrap", boot]
            (out / f"g{i}.json").unlink(missing_ok=True)
            with open(out / f"g{i}.log", "wb") as log:
                h.popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            while i == 0 and not status(0) and time.time() - t0 < warmup_s:
                time.sleep(0.2)  # the others dial it first thing
        warm = False
        while time.time() - t0 < warmup_s:
            sizes = [(status(i).get("swarm") or {}).get("size", 0) for i in range(n)]
            if min(sizes) >= n - 1:
                warm = True
                break
            time.sleep(0.5)
        warmup = time.time() - t0
        measure_file.write_text("")
        time.sleep(seconds)
        switch = tb.switch_stats()
        stats = []
        for i in range(n):
            st = status(i)
            sw = st.get("swarm") or {}
            m = st.get("measure") or {}
            accepted = (st.get("gossip") or {}).get("relayed", 0) - m.get("accepted_before", 0)
            window = max(1e-9, time.time() - m.get("since_wall", time.time()))
            expected = (n - 1) * window / 1.0  # one heartbeat per peer per second
            stats.append(
                {
                    "heard": sw.get("size", 0),
                    "delivered": round(accepted / expected, 3) if m else 0.0,
                    **(sw.get("heartbeat_delivery") or {}),
                }
            )
    p99 = [s["p99_ms"] for s in stats if "p99_ms" in s]
    p50 = [s["p50_ms"] for s in stats if "p50_ms" in s]
    return {
        "nodes": n,
        "rtt_ms": list(rtt_ms),
        "loss": loss,
        "switch": switch,
        "warm": warm,
        "warmup_s": round(warmup, 1),
        "window_s": seconds,
        "heard_min": min(s["heard"] for s in stats),
        "delivered_min": min(s["delivered"] for s in stats),
        "p50_ms_median": statistics.median(p50) if p50 else None,
        "p99_ms_median": statistics.median(p99) if p99 else None,
        "p99_ms_max": max(p99) if p99 else None,
        "per_node": stats,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--workers", type=int, default=5)
    ap.add_argument("--nat-workers", type=int, default=2)
    ap.add_argument("--validators", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1500.0)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--gossip-nodes", type=int, default=20)
    ap.add_argument("--gossip-seconds", type=float, default=90.0)
    ap.add_argument("--skip-network", action="store_true")
    ap.add_argument("--skip-gossip", action="store_true")
    args = ap.parse_args()
    why = skip_reason()
    if why:
        raise SystemExit(f"bench/wan.py: {why}")
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-wan-"))
    runs = []
    if not args.skip_network:
        runs.append(run_once(args, out / "wan", args.nat_workers, capped=True))
        if not args.no_baseline:
            runs.append(run_once(args, out / "baseline", 0, capped=False))
    gossip = []
    if not args.skip_gossip:
        n, secs = args.gossip_nodes, args.gossip_seconds
        for label, rtt, loss in (
            ("lan", (0, 0), 0.0),
            ("rtt 50-200 ms", (50, 200), 0.0),
            ("rtt + 1% loss", (50, 200), 0.01),
        ):
            g = gossip_once(n, secs, rtt, loss, out / "gossip" / label.replace(" ", "_").replace("%", ""))
            g["label"] = label
            gossip.append(g)
            print(
                f"gossip {label:>16}: warm-up {g['warmup_s']} s (all heard: {g['warm']}); over {secs:g} s: "
                f"heard >= {g['heard_min']}/{n - 1} peers, >= {g['delivered_min']:.0%} of heartbeats; delivery p50 "
                f"{g['p50_ms_median']} ms, p99 {g['p99_ms_median']} ms (median node), {g['p99_ms_max']} ms (worst); "
                f"switch {g['switch']}",
                flush=True,
            )
    for r in runs:
        label = "WAN (NAT + caps)" if r["capped"] else "baseline (public, uncapped)"
        print(f"\n{label}: {r['steps']} steps in {r['seconds']} s")
        print(f"{'node':<14}{'cap Mbit/s':>11}{'reach':>10}{'admitted':>10}{'hb p99 ms':>11}")
        for n, cap in r["caps_mbit"].items():
            adm = r["admitted_per_worker"].get(n, "-")
            p99 = r["gossip_delivery_ms"][n].get("p99_ms", "-")
            reach = r["reachability"][n] or "-"
            nat = " (NAT)" if n in r["nat_workers"] else ""
            print(f"{n + nat:<14}{cap or '-':>11}{reach:>10}{adm:>10}{p99:>11}")
        print(f"relay bytes {r['relay_bytes']} (control only; bulk never crosses a relay)")
        for n, served in r["checkpoint_bytes_served_by_nat_nodes"].items():
            rv = r["nat_reverse_serving"][n]
            print(
                f"  {n} (NAT) served {served} checkpoint bytes ({rv['bytes_served_reverse']} in whole chunks over "
                f"{rv['connections_opened']} connections it opened, of {rv['asked']} asked) (goal > 0)"
            )
        for d in r["distribution"]:
            print(
                f"  version {d['version']}: {d['seconds']} s to every learner (bound {d['bound_s']} s, {d['bytes']} B)"
            )
    for g in gossip:
        g.pop("per_node", None)
    print(json.dumps({"bench": "wan", "runs": runs, "gossip": gossip}), flush=True)


if __name__ == "__main__":
    main()
