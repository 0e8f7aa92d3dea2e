"""Resource-hygiene soak: a devnet runs for tens of minutes; is memory and fd use flat?

    python bench/soak.py [--minutes 30] [--interval-s 15] [--warmup-min 5]
                         [--workers 2] [--validators 2] [--out DIR]

Starts the same network ``primenode devnet`` starts (node/ops/devnet.py: bootstrap,
trainer, workers, validators as separate OS processes on 127.0.0.1, tiny model,
target-length task) with a step budget it never reaches, and samples every
process's RSS and open file descriptors every ``--interval-s`` seconds (psutil
when installed, else /proc). Samples go to ``OUT/samples.jsonl`` as they are
taken; at the end a table per node and one JSON line.

"Flat" is decided on the samples after ``--warmup-min`` (model load, first
checkpoints, caches filling): a least-squares slope per node, and

* memory is flat when the slope, projected over the measured window, grows the
  node by less than max(``--rss-tolerance-mib``, ``--rss-tolerance-pct`` of its RSS);
* fds are flat when the slope projected over the window is under
  ``--fd-tolerance`` and the floor (the fewest fds in the last five samples) is
  within ``--fd-tolerance`` of the floor of the window's first five samples: a
  leak raises the floor, while data-plane connections that are open for a
  moment when a checkpoint moves only raise single samples.

A node that died during the soak fails the run. The trainer's step count and
the ledger's admitted batches are reported too (the run must keep training).
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from node.ops.churn import trainer_step  # noqa: E402
from node.ops.devnet import Devnet, DevnetOptions  # noqa: E402

MIB = 1024 * 1024


def proc_sample(pid: int) -> dict | None:
    """RSS (bytes), open fds and threads of one process (None if gone)."""
    try:
        import psutil

        p = psutil.Process(pid)
        with p.oneshot():
            return {"rss": p.memory_info().rss, "fds": p.num_fds(), "threads": p.num_threads()}
    except ImportError:
        pass
    except Exception:
        return None
    try:
        rss = threads = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
        return {"rss": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": threads}
    except OSError:
        return None


def slope_per_s(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over ts (units per second); 0 with fewer than 2 points."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    den = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / den if den else 0.0


def admitted_count(devnet: Devnet) -> int:
    db = devnet.node("trainer").home.ledger_path
    if not db.exists():
        return 0
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return con.execute("SELECT COUNT(*) FROM batches WHERE status = 'admitted'").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return -1


def summarise(samples: list[dict], names: list[str], warmup_s: float, args) -> dict:
    nodes = {}
    for name in names:
        rows = [(s["t"], s["procs"][name]) for s in samples if s["procs"].get(name)]
        if not rows:
            nodes[name] = {"alive": False}
            continue
        after = [(t, r) for t, r in rows if t >= warmup_s] or rows
        ts = [t for t, _ in after]
        window = max(ts) - min(ts) if len(ts) > 1 else 0.0
        rss = [r["rss"] / MIB for _, r in after]
        fds = [r["fds"] for _, r in after]
        rss_slope = slope_per_s(ts, rss)  # MiB/s
        fd_slope = slope_per_s(ts, fds)
        rss_med = sorted(rss)[len(rss) // 2]
        rss_growth = rss_slope * window
        fd_growth = fd_slope * window
        rss_flat = rss_growth < max(args.rss_tolerance_mib, args.rss_tolerance_pct / 100 * rss_med)
        # a leak raises the floor; data-plane connections open while chunks move raise peaks only
        fd_floor_growth = min(fds[-5:]) - min(fds[:5])
        fd_flat = fd_growth < args.fd_tolerance and fd_floor_growth <= args.fd_tolerance
        nodes[name] = {
            "alive": samples[-1]["procs"].get(name) is not None,
            "rss_start_mib": round(rows[0][1]["rss"] / MIB, 1),
            "rss_warm_mib": round(rss[0], 1),
            "rss_end_mib": round(rss[-1], 1),
            "rss_max_mib": round(max(r["rss"] for _, r in rows) / MIB, 1),
            "rss_slope_mib_per_h": round(rss_slope * 3600, 2),
            "rss_growth_in_window_mib": round(rss_growth, 2),
            "fds_start": rows[0][1]["fds"],
            "fds_warm": fds[0],
            "fds_end": fds[-1],
            "fds_max": max(r["fds"] for _, r in rows),
            "fds_slope_per_h": round(fd_slope * 3600, 2),
            "fds_floor_growth": fd_floor_growth,
            "threads_end": after[-1][1]["threads"],
            "window_s": round(window, 1),
            "rss_flat": rss_flat,
            "fds_flat": fd_flat,
        }
    return nodes


def print_table(nodes: dict) -> None:
    cols = (
        "node",
        "RSS start",
        "RSS warm",
        "RSS end",
        "RSS max",
        "MiB/h",
        "fds start",
        "fds warm",
        "fds end",
        "fds max",
        "fds/h",
        "flat",
    )
    print(" | ".join(cols))
    for name, n in nodes.items():
        if not n.get("rss_end_mib"):
            print(f"{name} | (no samples)")
            continue
        flat = "yes" if n["rss_flat"] and n["fds_flat"] else ("rss NO" if not n["rss_flat"] else "fds NO")
        print(
            " | ".join(
                str(x)
                for x in (
                    name,
                    n["rss_start_mib"],
                    n["rss_warm_mib"],
                    n["rss_end_mib"],
                    n["rss_max_mib"],
                    n["rss_slope_mib_per_h"],
                    n["fds_start"],
                    n["fds_warm"],
                    n["fds_end"],
                    n["fds_max"],
                    n["fds_slope_per_h"],
                    flat + ("" if n["alive"] else " (DIED)"),
                )
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--interval-s", type=float, default=15.0)
    ap.add_argument("--warmup-min", type=float, default=5.0, help="samples before this are not used for the slope")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--validators", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="devnet folder (default: a fresh temporary one)")
    ap.add_argument("--rss-tolerance-mib", type=float, default=8.0)
    ap.add_argument("--rss-tolerance-pct", type=float, default=5.0)
    ap.add_argument("--fd-tolerance", type=float, default=3.0)
    ap.add_argument(
        "--from-samples", type=Path, default=None, help="only summarise an earlier run's samples.jsonl (no devnet)"
    )
    args = ap.parse_args()
    if args.from_samples is not None:
        samples = [json.loads(line) for line in args.from_samples.read_text().splitlines() if line.strip()]
        nodes = summarise(samples, list(samples[0]["procs"]), args.warmup_min * 60, args)
        print_table(nodes)
        print(
            json.dumps(
                {
                    "minutes": round(samples[-1]["t"] / 60, 1),
                    "samples": len(samples),
                    "steps": samples[-1]["step"],
                    "admitted": samples[-1]["admitted"],
                    "flat": all(n.get("rss_flat") and n.get("fds_flat") for n in nodes.values()),
                    "nodes": nodes,
                }
            )
        )
        return

    out = args.out or Path(tempfile.mkdtemp(prefix="primenode-soak-"))
    opts = DevnetOptions(
        out=out, workers=args.workers, validators=args.validators, steps=10**9, timeout_s=args.minutes * 60 + 600
    )
    devnet = Devnet(opts)
    devnet.prepare()
    names = [n.name for n in devnet.nodes]
    samples: list[dict] = []
    log = open(out / "samples.jsonl", "w")
    print(f"soak: devnet in {out}, {args.minutes:g} min, sample every {args.interval_s:g} s", flush=True)
    t0 = time.monotonic()
    devnet.start_all()
    died: dict[str, int] = {}
    try:
        next_t = 0.0
        while True:
            t = time.monotonic() - t0
            procs = {}
            for n in devnet.nodes:
                if n.proc is not None and n.proc.poll() is None:
                    procs[n.name] = proc_sample(n.proc.pid)
                else:
                    procs[n.name] = None
                    if n.proc is not None and n.name not in died:
                        died[n.name] = n.proc.returncode
            s = {"t": round(t, 1), "procs": procs, "step": trainer_step(devnet), "admitted": admitted_count(devnet)}
            samples.append(s)
            log.write(json.dumps(s) + "\n")
            log.flush()
            brief = " ".join(f"{k}={v['rss'] / MIB:.0f}M/{v['fds']}fd" if v else f"{k}=DEAD" for k, v in procs.items())
            print(f"[{t / 60:5.1f} min] step {s['step']} admitted {s['admitted']} | {brief}", flush=True)
            if t >= args.minutes * 60:
                break
            next_t += args.interval_s
            time.sleep(max(0.0, next_t - (time.monotonic() - t0)))
    finally:
        status_end = devnet.snapshot()
        codes = devnet.stop_all()
        log.close()
        (out / "status_end.json").write_text(json.dumps(status_end, indent=1, default=str))

    nodes = summarise(samples, names, args.warmup_min * 60, args)
    print()
    print_table(nodes)
    flat = all(n.get("rss_flat") and n.get("fds_flat") for n in nodes.values())
    final = {
        "minutes": round(samples[-1]["t"] / 60, 1),
        "samples": len(samples),
        "interval_s": args.interval_s,
        "warmup_min": args.warmup_min,
        "steps": samples[-1]["step"],
        "admitted": samples[-1]["admitted"],
        "died": died,
        "exit_codes": codes,
        "flat": flat and not died,
        "nodes": nodes,
        "out": str(out),
    }
    print(json.dumps(final), flush=True)


if __name__ == "__main__":
    main()
