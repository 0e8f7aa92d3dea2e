"""Resource-hygiene soak with churn: a devnet trains while workers and validators join and
leave every few seconds. Does every join succeed, does the run keep training, and do the
bootstrap's memory, file descriptors and trio tasks stay flat? (issue 30, point 8)

    python bench/soak.py [--duration 60] [--joins 1000] [--interval-s 15] [--warmup-min 5]
                         [--workers 2] [--validators 3] [--pool 8] [--max-joining 6]
                         [--dwell-s 4] [--out DIR]

Starts the network ``primenode devnet`` starts (node/ops/devnet.py: bootstrap, trainer,
workers, validators as separate OS processes on 127.0.0.1, tiny model, target-length task)
with a step budget it never reaches, then churns for ``--duration`` minutes, starting
``--joins`` joins evenly spread over it (at most ``--max-joining`` joiners at once):

* a **worker join** is ``primenode join --role worker --bootstrap ADDR --run-id HEX`` from one of
  ``--pool`` extra worker homes (the normal join path: genesis fetched from the bootstrap). It
  succeeds when the joiner's status lists the bootstrap among its peers; ``--dwell-s`` later
  it leaves: SIGTERM, every third one SIGKILL (a crash: the bootstrap sees no goodbye).
  Pool home 0 says ``reachability = "private"`` in its config.toml: it joins **behind a
  relay** (reserves a slot on the bootstrap, advertises circuit addresses) and succeeds only
  once it holds that reservation.
* every fourth join is a **validator join**: one of the devnet's validators (round robin, one
  at a time, so quorum holds) is stopped and started again, and succeeds when it is
  connected to the bootstrap again.

Churn starts once the trainer made its first step (the devnet is up; ``--ready-timeout-min``),
and ``--duration`` counts from there. A joiner runs at the priority the devnet gives its own
workers and validators (node/ops/devnet.py ``background_priority``): at a normal priority the
joiners' process starts took every CPU cycle from the devnet's workers and validators, which
then did not even print their first log line for 4.5 minutes (2-core machine, 2026-11-28).
The CPU seconds each worker join used (its process, until it left) are reported.

A join that does not succeed within ``--join-timeout-s`` or whose process exits first fails
the run. Every ``--interval-s`` seconds it samples every devnet process's RSS and open fds
(psutil when installed, else /proc), the bootstrap's trio task count and connections (its
``/status``), the trainer's step and the ledger's admitted batches. Samples go to
``OUT/samples.jsonl`` as they are taken; at the end a table per node and one JSON line.

"Flat" is decided on the samples after ``--warmup-min`` (model load, first
checkpoints, caches filling): a least-squares slope per node, and

* memory is flat when the slope, projected over the measured window, grows the
  node by less than max(``--rss-tolerance-mib``, ``--rss-tolerance-pct`` of its RSS);
* fds are flat when the slope projected over the window is under
  ``--fd-tolerance`` and the floor (the fewest fds in the last five samples) is
  within ``--fd-tolerance`` of the floor of the window's first five samples: a
  leak raises the floor, while data-plane connections that are open for a
  moment when a checkpoint moves only raise single samples;
* the bootstrap's tasks are flat by the same floor rule (``--task-tolerance``).

A node that died during the soak fails the run, and so does a run whose trainer made no
step during the churn. ``--joins 0`` is the old soak (no churn).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from node.ops.churn import trainer_step  # noqa: E402
from node.ops.devnet import Devnet, DevnetOptions, NodeProc, background_priority, primenode_cmd  # noqa: E402

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


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` used so far (None if gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
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


def status_of(home) -> dict | None:
    try:
        port = json.loads(home.runtime_path.read_text())["status_port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2) as r:
            st: dict = json.loads(r.read())
            return st
    except Exception:
        return None


@dataclasses.dataclass
class Join:
    n: int
    kind: str  # "worker", "relayed-worker" or "validator"
    name: str
    proc: subprocess.Popen
    started: float
    joined_s: float | None = None
    leaving_since: float | None = None
    log: object = None
    cpu_s: float | None = None  # user + system CPU seconds of the joiner, read as it leaves


class Churn:
    """Starts joins at an even pace, checks each one succeeds, makes it leave after a dwell."""

    def __init__(self, devnet: Devnet, args, out: Path) -> None:
        from node.config import NodeConfig
        from node.genesis_file import read_genesis
        from node.home import NodeHome

        self.devnet, self.args, self.out = devnet, args, out
        self.boot_id = devnet.bootstrap_addr.rsplit("/p2p/", 1)[1]
        self.run_id = read_genesis(devnet.genesis_path).genesis.run_id.hex()
        self.pool = []
        for i in range(args.pool):
            h = NodeHome(out / "nodes" / f"churn-{i}")
            if not h.exists():
                h.init(NodeConfig(reachability="private" if i == 0 else "auto"))
            self.pool.append(h)
        self.free = list(range(args.pool))
        self.validators = [n for n in devnet.nodes if n.role == "validator"]
        self.next_validator = 0
        self.validator_busy = False
        self.active: list[Join] = []
        self.started = self.ok = self.failed = self.relayed_ok = 0
        self.kinds: dict[str, int] = {}
        self.join_s: list[float] = []
        self.failures: list[str] = []
        self.next_t = 0.0
        self.closing = False
        self.every_s = args.duration * 60 / args.joins if args.joins else float("inf")
        self.join_cpu_s: list[float] = []

    def _worker_cmd(self, home) -> list[str]:
        return primenode_cmd() + [
            "join", "--role", "worker", "--home", str(home.path), "--bootstrap", self.devnet.bootstrap_addr,
            "--run-id", self.run_id, "--listen", "/ip4/127.0.0.1/tcp/0",
        ]  # fmt: skip

    def _start_one(self, t: float) -> None:
        self.started += 1
        n = self.started
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        if n % 4 == 0 and not self.validator_busy and self.validators:
            v: NodeProc = self.validators[self.next_validator % len(self.validators)]
            self.next_validator += 1
            self.validator_busy = True
            self.devnet.kill(v.name, signal.SIGTERM)
            if v.log:
                v.log.close()  # type: ignore[attr-defined]
            self.devnet.start(v)
            assert v.proc is not None
            self.active.append(Join(n, "validator", v.name, v.proc, t))
        else:
            slot = self.free.pop(0)
            home = self.pool[slot]
            log = open(self.out / "logs" / f"churn-{slot}.log", "ab")
            idle = ["chrt", "--idle", "0"] if shutil.which("chrt") else []
            proc = subprocess.Popen(
                idle + self._worker_cmd(home), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            background_priority(proc.pid)  # as the devnet's own workers run
            kind = "relayed-worker" if slot == 0 else "worker"
            self.active.append(Join(n, kind, f"churn-{slot}", proc, t, log=log))
        self.kinds[self.active[-1].kind] = self.kinds.get(self.active[-1].kind, 0) + 1

    def _home(self, j: Join):
        if j.kind == "validator":
            return self.devnet.node(j.name).home
        return self.pool[int(j.name.split("-")[1])]

    def _joined(self, j: Join) -> bool:
        st = status_of(self._home(j))
        if not st or not any(p.get("peer_id") == self.boot_id for p in st.get("peers") or []):
            return False
        if j.kind == "relayed-worker":
            nat = st.get("nat") or {}
            return nat.get("reachability") == "private" and bool(nat.get("relays"))
        return True

    def _done(self, j: Join) -> None:
        self.active.remove(j)
        if j.kind == "validator":
            self.validator_busy = False
        else:
            if j.log:
                j.log.close()  # type: ignore[attr-defined]
            self.free.append(int(j.name.split("-")[1]))

    def tick(self, t: float) -> None:
        a = self.args
        for j in list(self.active):
            if j.joined_s is None:
                if self._joined(j):
                    j.joined_s = t - j.started
                    self.ok += 1
                    self.join_s.append(j.joined_s)
                    if j.kind == "relayed-worker":
                        self.relayed_ok += 1
                    if j.kind == "validator":
                        self._done(j)  # it stays: the run needs it (it leaves at its next turn)
                elif j.proc.poll() is not None or t - j.started > a.join_timeout_s:
                    why = "exited" if j.proc.poll() is not None else "timed out"
                    self.failed += 1
                    self.failures.append(f"join {j.n} ({j.kind} {j.name}) {why} after {t - j.started:.0f} s")
                    if j.proc.poll() is None:
                        j.proc.kill()
                        j.proc.wait()
                    if j.kind == "validator":
                        self._done(j)
                    else:
                        self._done(j)
            elif j.leaving_since is None:
                if t - j.started - j.joined_s >= a.dwell_s:
                    if j.kind != "validator":
                        j.cpu_s = proc_cpu_s(j.proc.pid)
                        if j.cpu_s is not None:
                            self.join_cpu_s.append(j.cpu_s)
                    j.proc.send_signal(signal.SIGKILL if j.n % 3 == 0 else signal.SIGTERM)
                    j.leaving_since = t
            elif j.proc.poll() is not None:
                self._done(j)
            elif t - j.leaving_since > 30:
                j.proc.kill()
        if self.started < a.joins and t >= self.next_t and self.free and not self.closing:
            joining = sum(1 for j in self.active if j.joined_s is None)
            if joining < a.max_joining:
                self._start_one(t)
                self.next_t += self.every_s

    def stop(self) -> None:
        for j in list(self.active):
            if j.proc.poll() is None and j.kind != "validator":
                j.proc.kill()
                j.proc.wait()
            if j.kind != "validator" and j.log:
                j.log.close()  # type: ignore[attr-defined]

    def summary(self) -> dict:
        js = sorted(self.join_s)
        return {
            "joins_asked": self.args.joins,
            "joins_started": self.started,
            "joins_ok": self.ok,
            "joins_failed": self.failed,
            "by_kind": self.kinds,
            "relayed_joins_ok": self.relayed_ok,
            "join_s_median": round(js[len(js) // 2], 1) if js else None,
            "join_s_max": round(js[-1], 1) if js else None,
            "join_cpu_s_median": round(sorted(self.join_cpu_s)[len(self.join_cpu_s) // 2], 1)
            if self.join_cpu_s
            else None,
            "failures": self.failures[:20],
        }


def floor_growth(values: list) -> int | None:
    vals = [v for v in values if isinstance(v, int)]
    if len(vals) < 2:
        return None
    k = min(5, len(vals))
    return min(vals[-k:]) - min(vals[:k])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", "--minutes", dest="duration", type=float, default=60.0, help="minutes")
    ap.add_argument("--joins", type=int, default=1000, help="joins spread over the duration (0: no churn)")
    ap.add_argument("--interval-s", type=float, default=15.0)
    ap.add_argument("--warmup-min", type=float, default=5.0, help="samples before this are not used for the slope")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--validators", type=int, default=3)
    ap.add_argument("--pool", type=int, default=8, help="extra worker homes that join and leave")
    ap.add_argument("--max-joining", type=int, default=6, help="joins in progress at once")
    ap.add_argument("--dwell-s", type=float, default=4.0, help="a joined worker leaves this long after joining")
    ap.add_argument("--join-timeout-s", type=float, default=180.0)
    ap.add_argument(
        "--ready-timeout-min", type=float, default=15.0, help="the devnet's first step must come within this"
    )
    ap.add_argument("--out", type=Path, default=None, help="devnet folder (default: a fresh temporary one)")
    ap.add_argument("--rss-tolerance-mib", type=float, default=8.0)
    ap.add_argument("--rss-tolerance-pct", type=float, default=5.0)
    ap.add_argument("--fd-tolerance", type=float, default=3.0)
    ap.add_argument("--task-tolerance", type=int, default=20)
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
        out=out,
        workers=args.workers,
        validators=args.validators,
        steps=10**9,
        timeout_s=(args.duration + args.ready_timeout_min) * 60 + 600,
    )
    devnet = Devnet(opts)
    devnet.prepare()
    names = [n.name for n in devnet.nodes]
    churn = Churn(devnet, args, out) if args.joins else None
    samples: list[dict] = []
    log = open(out / "samples.jsonl", "w")
    print(
        f"soak: devnet in {out}, {args.duration:g} min, {args.joins} joins, sample every {args.interval_s:g} s",
        flush=True,
    )
    t0 = time.monotonic()
    devnet.start_all()
    died: dict[str, int] = {}
    boot_home = devnet.node("bootstrap").home
    step_at_churn: int | None = None
    began = 0.0 if churn is None else None  # when the measured window (and the churn) began
    not_ready = False
    try:
        next_sample = 0.0
        while True:
            t = time.monotonic() - t0
            if churn is not None:
                if began is None:
                    step = trainer_step(devnet) or 0
                    if step >= 1:  # the devnet is up: churn from now on
                        began, step_at_churn = t, step
                        print(f"[{t / 60:5.1f} min] the trainer made its first step: churn begins", flush=True)
                    elif t > args.ready_timeout_min * 60:
                        not_ready = True
                        print(f"the trainer made no step in {args.ready_timeout_min:g} min: giving up", flush=True)
                        break
                else:
                    churn.tick(t - began)
            if t >= next_sample:
                procs = {}
                for n in devnet.nodes:
                    if n.proc is not None and n.proc.poll() is None:
                        procs[n.name] = proc_sample(n.proc.pid)
                    else:
                        procs[n.name] = None
                        churned = churn is not None and any(j.name == n.name for j in churn.active)
                        if n.proc is not None and n.name not in died and not churned:
                            died[n.name] = n.proc.returncode
                conns = (status_of(boot_home) or {}).get("connections") or {}
                s = {
                    "t": round(t, 1),
                    "procs": procs,
                    "step": trainer_step(devnet),
                    "admitted": admitted_count(devnet),
                    "boot_tasks": conns.get("tasks"),
                    "boot_inbound": conns.get("inbound"),
                    "boot_refused": sum((conns.get("refused") or {}).values()) if conns else None,
                    "joins_ok": churn.ok if churn else 0,
                    "joins_failed": churn.failed if churn else 0,
                }
                samples.append(s)
                log.write(json.dumps(s) + "\n")
                log.flush()
                b = procs.get("bootstrap")
                brief = f"boot {b['rss'] / MIB:.0f}M/{b['fds']}fd/{s['boot_tasks']}tasks" if b else "boot DEAD"
                print(
                    f"[{t / 60:5.1f} min] step {s['step']} admitted {s['admitted']} | {brief} | "
                    f"joins ok {s['joins_ok']} failed {s['joins_failed']}",
                    flush=True,
                )
                next_sample += args.interval_s
            if began is not None and t - began >= args.duration * 60:
                # joins in progress finish (or time out) before the end; none is started now
                if churn is None or not any(j.joined_s is None for j in churn.active):
                    break
                if churn is not None:
                    churn.closing = True
            time.sleep(0.5 if churn is not None else max(0.0, next_sample - t))
    finally:
        if churn is not None:
            churn.stop()
        status_end = devnet.snapshot()
        codes = devnet.stop_all()
        log.close()
        (out / "status_end.json").write_text(json.dumps(status_end, indent=1, default=str))

    warm_from = (began or 0.0) + args.warmup_min * 60
    nodes = summarise(samples, names, warm_from, args)
    print()
    print_table(nodes)
    warm = [s for s in samples if s["t"] >= warm_from] or samples
    tasks = [s.get("boot_tasks") for s in warm]
    task_growth = floor_growth(tasks)
    boot = nodes.get("bootstrap", {})
    boot["tasks_warm"], boot["tasks_end"] = tasks[0], tasks[-1]
    boot["tasks_floor_growth"] = task_growth
    boot["tasks_flat"] = task_growth is not None and task_growth <= args.task_tolerance
    flat = all(n.get("rss_flat") and n.get("fds_flat") for n in nodes.values()) and boot["tasks_flat"]
    steps_during = samples[-1]["step"] - (step_at_churn or 0)
    ch = churn.summary() if churn else {}
    joins_pass = not churn or (ch["joins_failed"] == 0 and ch["joins_ok"] >= args.joins and ch["relayed_joins_ok"] >= 1)
    boot_flat = bool(boot.get("rss_flat") and boot.get("fds_flat") and boot["tasks_flat"])
    print(
        f"\nbootstrap tasks: {tasks[0]} after warm-up, {tasks[-1]} at the end (floor growth {task_growth}); "
        f"joins ok {ch.get('joins_ok', 0)} of {args.joins} asked, failed {ch.get('joins_failed', 0)}, "
        f"behind a relay {ch.get('relayed_joins_ok', 0)}; trainer steps during the churn {steps_during}"
    )
    final = {
        "bench": "soak",
        "minutes": round(samples[-1]["t"] / 60, 1),
        "samples": len(samples),
        "interval_s": args.interval_s,
        "warmup_min": args.warmup_min,
        "churn_began_min": None if began is None else round(began / 60, 1),
        "churn_minutes": None if began is None else round((samples[-1]["t"] - began) / 60, 1),
        "steps": samples[-1]["step"],
        "steps_during_churn": steps_during,
        "admitted": samples[-1]["admitted"],
        "churn": ch,
        "died": died,
        "exit_codes": codes,
        "bootstrap_flat": boot_flat,
        "all_flat": flat and not died,
        # the churn's verdict: every join, training went on, the bootstrap flat, nobody died
        "pass": bool(boot_flat and not died and joins_pass and steps_during > 0 and not not_ready),
        "nodes": nodes,
        "out": str(out),
    }
    print(json.dumps(final), flush=True)


if __name__ == "__main__":
    main()
