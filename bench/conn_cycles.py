"""Raw connection churn against one node: do memory, fds and tasks stay flat? (issue 30, point 2)

    python bench/conn_cycles.py [--cycles 100000] [--clients 8] [--fresh-id-every 50]
                                [--samples 20] [--baseline-cycles 400] [--no-baseline]

Starts a bootstrap node (the overlay ``primenode bootstrap`` runs: ``Node`` with
``BootstrapRole``) in a **separate process** and opens and closes ``--cycles`` real
TCP + Noise + yamux connections to it from this process (``--clients`` dialers at once,
each taking a new identity every ``--fresh-id-every`` connections, as a joiner or an
attacker would). The node prints one JSON line a second (its RSS, open fds, trio task
count, live inbound connections, inbound slots held, refusals); at each of ``--samples``
points the latest line is recorded. The node's accept-rate limit (10/s) is raised for the
bench (``--accept-rate``): at 10/s 100,000 cycles would take 2.8 h, and what is measured
is what a connection leaves behind, not the limiter.

Baseline, same run: the same node with py-libp2p's own inbound handler (our fix in
``node/p2p/connlimits.py`` switched off) for ``--baseline-cycles``: it refuses every
connection after 250 and holds a task per connection it ever accepted.

Prints a table per run and one final JSON line. "Flat" is judged after the first sample
(caches and the first identities): growth from the second sample to the last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MIB = 1024 * 1024


# ---------------------------------------------------------------- the node (child process)
def serve(accept_rate: float, unpatched: bool) -> None:
    """Run a bootstrap node; print its address, then a stats line every second."""
    import trio

    from node.p2p import connlimits
    from node.p2p import host as host_mod
    from node.p2p.connlimits import connection_stats, trio_task_count
    from node.p2p.testing import NodeFactory

    if unpatched:
        connlimits._installed = True  # py-libp2p's own inbound handler: the baseline
    host_mod.INBOUND_CONNECTIONS_PER_S = accept_rate
    host_mod.INBOUND_CONNECTIONS_BURST = accept_rate

    def proc_stats() -> dict:
        rss = 0
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
        return {"rss": rss, "fds": len(os.listdir("/proc/self/fd"))}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            net = NodeFactory(nursery)
            node = await net.start()
            print(json.dumps({"addr": node.full_addrs()[0]}), flush=True)
            while True:
                c = connection_stats(node.host)
                line = {
                    **proc_stats(),
                    "tasks": trio_task_count(),
                    "peerstore": len(node.host.get_peerstore().peer_ids()),
                }
                line.update({k: c[k] for k in ("inbound", "outbound", "inbound_slots_held")})
                line["refused"] = sum(c["refused"].values())
                print(json.dumps(line), flush=True)
                await trio.sleep(1.0)

    trio.run(main)


# ---------------------------------------------------------------- the dialers (this process)
class NodeProc:
    def __init__(self, accept_rate: float, unpatched: bool) -> None:
        cmd = [sys.executable, __file__, "--serve", "--accept-rate", str(accept_rate)]
        if unpatched:
            cmd.append("--unpatched")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        if not first:
            raise SystemExit("the node did not start")
        self.addr = json.loads(first)["addr"]
        self.latest: dict = {}
        self._lines = threading.Thread(target=self._read, daemon=True)
        self._lines.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.latest = json.loads(line)
            except ValueError:
                pass

    def fresh(self, timeout: float = 5.0) -> dict:
        """A stats line printed after now."""
        before = self.latest
        deadline = time.monotonic() + timeout
        while self.latest is before and time.monotonic() < deadline:
            time.sleep(0.05)
        return dict(self.latest)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def cycle(
    node: NodeProc, cycles: int, clients: int, fresh_every: int, samples: int, label: str, max_s: float = float("inf")
) -> dict:
    import trio

    from node.p2p.host import closing_host, make_host, parse_peer_addr
    from protocol import NodeKey

    info = parse_peer_addr(node.addr)
    state = {"done": 0, "failed": 0, "next": 0}
    marks = sorted({max(1, cycles * i // samples) for i in range(1, samples + 1)})
    rows: list[dict] = [{"cycles": 0, "t": 0.0, "failed": 0, **node.fresh()}]
    t0 = time.monotonic()

    async def dialer() -> None:
        while state["next"] < cycles and time.monotonic() - t0 < max_s:
            host = make_host(NodeKey.generate())
            async with closing_host(host, ["/ip4/127.0.0.1/tcp/0"]):
                net = host.get_network()
                for _ in range(fresh_every):
                    if state["next"] >= cycles or time.monotonic() - t0 >= max_s:
                        return
                    state["next"] += 1
                    try:
                        with trio.fail_after(10):
                            await host.connect(info)
                            await net.close_peer(info.peer_id)
                    except Exception:
                        state["failed"] += 1
                        with trio.move_on_after(5):
                            await net.close_peer(info.peer_id)
                    state["done"] += 1

    async def sampler() -> None:
        for m in marks:
            while state["done"] < m:
                if time.monotonic() - t0 >= max_s:
                    return
                await trio.sleep(0.05)
            stats = await trio.to_thread.run_sync(node.fresh)
            rows.append({"cycles": state["done"], "t": time.monotonic() - t0, "failed": state["failed"], **stats})

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampler)
            async with trio.open_nursery() as dialers:
                for _ in range(clients):
                    dialers.start_soon(dialer)

    trio.run(main)
    time.sleep(2.0)  # the last closes reach the node
    rows.append({"cycles": state["done"], "t": time.monotonic() - t0, "failed": state["failed"], **node.fresh()})
    print_table(label, rows)
    return summarise(rows)


def print_table(label: str, rows: list[dict]) -> None:
    print(f"\n{label}")
    head = ("cycles", "s", "cyc/s", "failed", "RSS MiB", "fds", "tasks", "inbound", "slots", "peerstore")
    print("  ".join(f"{h:>9}" for h in head))
    for r in rows:
        rate = r["cycles"] / r["t"] if r["t"] else 0.0
        vals = (
            r["cycles"],
            f"{r['t']:.0f}",
            f"{rate:.1f}",
            r["failed"],
            f"{r.get('rss', 0) / MIB:.1f}",
            r.get("fds"),
            r.get("tasks"),
            r.get("inbound"),
            r.get("inbound_slots_held"),
            r.get("peerstore"),
        )
        print("  ".join(f"{v!s:>9}" for v in vals), flush=True)


def summarise(rows: list[dict]) -> dict:
    warm, last = rows[1] if len(rows) > 2 else rows[0], rows[-1]
    span = max(1, last["cycles"] - warm["cycles"])
    per_10k = 10_000 / span
    return {
        "cycles": last["cycles"],
        "failed": last["failed"],
        "seconds": round(last["t"], 1),
        "cycles_per_s": round(last["cycles"] / last["t"], 1) if last["t"] else None,
        "rss_mib": [
            round(rows[0].get("rss", 0) / MIB, 1),
            round(warm.get("rss", 0) / MIB, 1),
            round(last.get("rss", 0) / MIB, 1),
        ],
        "fds": [rows[0].get("fds"), warm.get("fds"), last.get("fds")],
        "tasks": [rows[0].get("tasks"), warm.get("tasks"), last.get("tasks")],
        "peerstore": [rows[0].get("peerstore"), warm.get("peerstore"), last.get("peerstore")],
        "rss_growth_mib_per_10k_after_warmup": round((last.get("rss", 0) - warm.get("rss", 0)) / MIB * per_10k, 2),
        "fds_growth_after_warmup": (last.get("fds") or 0) - (warm.get("fds") or 0),
        "tasks_growth_after_warmup": (last.get("tasks") or 0) - (warm.get("tasks") or 0),
        "inbound_slots_held_at_end": last.get("inbound_slots_held"),
        "refused": last.get("refused"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=100_000)
    ap.add_argument("--clients", type=int, default=16, help="dialers at once")
    ap.add_argument("--fresh-id-every", type=int, default=50, help="connections per dialer identity")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--max-minutes", type=float, default=float("inf"), help="stop dialling then (report what was done)")
    ap.add_argument("--baseline-cycles", type=int, default=400)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--accept-rate", type=float, default=1e6, help="the node's accept rate (and burst) for the bench")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--unpatched", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.accept_rate, args.unpatched)
        return

    out: dict = {
        "bench": "conn_cycles",
        "cycles_asked": args.cycles,
        "clients": args.clients,
        "fresh_id_every": args.fresh_id_every,
    }
    if not args.no_baseline:
        node = NodeProc(args.accept_rate, unpatched=True)
        try:
            out["baseline_py_libp2p"] = cycle(
                node, args.baseline_cycles, args.clients, args.fresh_id_every, 4, "baseline: py-libp2p's own handler"
            )
        finally:
            node.stop()
    node = NodeProc(args.accept_rate, unpatched=False)
    try:
        out["primenode"] = cycle(
            node,
            args.cycles,
            args.clients,
            args.fresh_id_every,
            args.samples,
            "primenode (node/p2p/connlimits.py)",
            args.max_minutes * 60,
        )
    finally:
        node.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
