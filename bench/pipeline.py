"""Where the asynchronous pipeline pays: lock-step and asynchronous devnets with each node on
cores of its own and 100 Mbit/s uploads (issue 35 point 5).

    python bench/pipeline.py [--steps 40] [--node-cores trainer=2,worker=0.25,validator=1] [--modes lock-step,continuous,paced]
                             [--upload-mbps 100] [--batch-split 1] [--lr 1e-4] [--out DIR]

On this machine all six devnet processes share its cores, where on the internet each node
has its own: a lock-step phase running alone takes every core, overlapping phases share
them, and neither is what a swarm sees (docs/benchmarks.md, "Asynchronous pipeline"). Here
every node process is capped at its role's ``--node-cores`` CPUs (a cgroup CPU quota) and
runs on a trio clock dilated by the quotas' sum / this machine's cores
(``node/ops/emulation.py``), so per emulated second each node has its quota's worth of CPU
whatever the others do, and checkpoint uploads pass ``--upload-mbps`` per emulated second.
The default swarm is sized as an operator would size one, its workers generating about what
the trainer learns from: a trainer of 2 CPUs (a step of two batches takes it about 1.3
emulated seconds), two workers of a quarter CPU (a batch takes one about 2 s), two
validators of one CPU. (With workers of half a CPU, continuous generation made twice what
the trainer took and the validators, verifying all of it, fell ever further behind.) Lock-step
(``--lockstep``: one batch per worker per version, then wait) against the asynchronous
pipeline as a real run has it by default (``--set worker_batches_per_version=0``: workers
generate without pause inside the window), both through the CLI (``primenode devnet
--node-cores ... --time-dilation D --max-upload-mbps M``), one after the other, nothing
else running.

Reported per mode: emulated seconds per trainer step (from the second step's metrics line
to the last: start-up excluded) and steps per emulated minute, the workers' utilization
(share of wall time generating), mean reward over steps 31-40, the reward of the policies
of versions 30-39 (the versions lock-step's steps 31-40 train; an asynchronous step trains
older policies' rollouts, so both are given), the staleness mix, clip fractions, wall seconds. Needs root (the quotas). The last line of output is one JSON
object.

``--batch-split N`` keeps what a step learns from (16 prompts, 8 per worker) but has each worker
make it as N smaller batches (8 / N prompts each; the trainer waits for and takes 2 N batches a
step; lock-step and paced workers make N batches per version). A continuous worker's batch then
spans a fraction of a trainer step, so it starts on a newer version more often: the question is
whether that lowers the staleness that costs the asynchronous run reward, and what the smaller
batches cost (issue 35 point 5). ``--lr`` sets the trainer's learning rate in every mode (the
devnet's 1e-4 by default): how far one version moves the policy, and so what a version of lag
costs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.learning import WINDOW, read_metrics, summarise  # noqa: E402
from node.ops.emulation import own_cores_dilation, parse_node_cores  # noqa: E402

BUSY = {"trainer": 1, "worker": 2, "validator": 2}  # the bootstrap only answers joins


# mode -> the devnet flags that make it. "paced" is the devnet's own default (one batch per worker
# per version, one version ahead); "continuous" is a real run's default (no pace at all).
MODES = {
    "lock-step": ["--lockstep"],
    "continuous": ["--set", "worker_batches_per_version=0"],
    "paced": [],
}


def run_mode(out: Path, mode: str, args: argparse.Namespace, dilation: float) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "node.ops.cli",
        "devnet",
        "--out",
        str(out),
        "--steps",
        str(args.steps),
        "--node-cores",
        args.node_cores,
        "--time-dilation",
        f"{dilation:g}",
        "--max-upload-mbps",
        f"{args.upload_mbps:g}",
        "--timeout",
        str(args.timeout),
        *MODES[mode],
        *split_args(mode, args.batch_split),
        *(["--lr", f"{args.lr:g}"] if args.lr else []),
    ]
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = read_metrics(out)
    timed = [r for r in rows if "time" in r and r.get("step", 0) >= 2]
    real_per_step = (timed[-1]["time"] - timed[0]["time"]) / max(1, timed[-1]["step"] - timed[0]["step"])
    busy = [u for u in summary.get("workers_busy", {}).values() if isinstance(u, (int, float))]
    return {
        "mode": mode,
        "wall_s": round(wall, 1),
        "step_s": round(real_per_step / dilation, 3),  # emulated seconds per trainer step
        "steps_per_min": round(60.0 * dilation / real_per_step, 2),
        "worker_utilization": round(sum(busy) / len(busy), 3) if busy else None,
        "workers_busy": summary.get("workers_busy"),
        "load_before": round(load, 2),
        **summarise(rows),
    }


PROMPTS_PER_WORKER_STEP = 8  # the devnet's 16 prompts a step over its 2 workers


def split_args(mode: str, n: int) -> list[str]:
    """Devnet flags that cut each worker's share of a step into ``n`` batches (none for 1)."""
    if n <= 1:
        return []
    if PROMPTS_PER_WORKER_STEP % n:
        raise SystemExit(f"--batch-split must divide {PROMPTS_PER_WORKER_STEP}, got {n}")
    flags = ["--prompts-per-batch", str(PROMPTS_PER_WORKER_STEP // n)]
    flags += ["--set", f"batches_per_step={2 * n}", "--set", f"max_batches_per_step={2 * n}"]
    if mode != "continuous":  # continuous workers have no per-version quota
        flags += ["--set", f"worker_batches_per_version={n}"]
    return flags


def policy_reward(runs: list[dict[str, Any]]) -> tuple[list[int], list[float | None]]:
    """The reward the policies of versions ``WINDOW - 1`` earned (lock-step's steps 31-40 train
    versions 30-39), over the versions every run trained rollouts of: rollout-weighted, each
    version's rollouts whichever step trained them. Steps 31-40 of an asynchronous run train
    rollouts of policies one or two versions older than lock-step's steps 31-40 do, so the
    per-step reward compares policies of different ages; this compares the same ones."""
    wanted = {str(v) for v in range(WINDOW[0] - 1, WINDOW[1])}
    common = set.intersection(wanted, *(set(r.get("reward_by_version") or {}) for r in runs))
    versions = sorted(int(v) for v in common)
    means: list[float | None] = []
    for r in runs:
        by = r.get("reward_by_version") or {}
        n = sum(by[str(v)]["rollouts"] for v in versions)
        means.append(
            round(sum(by[str(v)]["rollouts"] * by[str(v)]["reward_mean"] for v in versions) / n, 4) if n else None
        )
    return versions, means


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument(
        "--node-cores", default="trainer=2,worker=0.25,validator=1", help="CPUs of each node's own, per role"
    )
    ap.add_argument("--upload-mbps", type=float, default=100.0)
    ap.add_argument("--timeout", type=float, default=5400.0, help="per devnet, real seconds")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--batch-split", type=int, default=1, help="each worker's share of a step in N batches")
    ap.add_argument("--lr", type=float, default=0.0, help="trainer learning rate in every mode (0: the devnet's)")
    ap.add_argument(
        "--modes", default="lock-step,continuous", help=f"comma-separated, the baseline first: {', '.join(MODES)}"
    )
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    cores = parse_node_cores(args.node_cores)
    dilation = round(own_cores_dilation(sum(cores[role] * n for role, n in BUSY.items())), 3)
    print(
        f"nodes' CPUs {args.node_cores} on {os.cpu_count()} cores: time dilation x{dilation:g}, "
        f"uploads {args.upload_mbps:g} Mbit/s per emulated second; {args.steps} steps per mode; "
        f"batch split {args.batch_split}; out {out}",
        flush=True,
    )
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes takes {', '.join(MODES)}, got {args.modes!r}")
    results = []
    for mode in modes:
        r = run_mode(out / mode, mode, args, dilation)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "rewards"}), flush=True)
    print()
    print(
        "| mode | s per step (emulated) | steps per emulated min | worker utilization | reward 31-40 | staleness mix | clip by staleness | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        clip = ", ".join(f"{s}: {v['clip_fraction']:.1%}" for s, v in r["ratio_by_staleness"].items()) or "-"
        mix = " / ".join(f"{s}: {n}" for s, n in r["staleness_mix"].items())
        print(
            f"| {r['mode']} | {r['step_s']} | {r['steps_per_min']} | {r['worker_utilization']} | "
            f"{r['reward_31_40']} | {mix} | {clip} | {r['wall_s']} |"
        )
    base = results[0]
    compared = {}
    for r in results[1:]:
        speedup = round(r["steps_per_min"] / base["steps_per_min"], 3)
        gap = (
            round(abs(r["reward_31_40"] - base["reward_31_40"]), 4)
            if r["reward_31_40"] is not None and base["reward_31_40"] is not None
            else None
        )
        versions, (base_v, r_v) = policy_reward([base, r])
        version_gap = round(abs(r_v - base_v), 4) if base_v is not None and r_v is not None else None
        span = f"{versions[0]}-{versions[-1]}" if versions else "none in common"
        compared[r["mode"]] = {
            "speedup": speedup,
            "reward_gap": gap,
            "policy_versions": span,
            "policy_reward": [base_v, r_v],
            "policy_reward_gap": version_gap,
        }
        print(
            f"\n{r['mode']} / {base['mode']} steps per minute: {speedup}x (goal >= 1.5); worker utilization "
            f"{r['worker_utilization']} (goal >= 0.8); reward 31-40 gap {gap} (goal <= 0.05); "
            f"reward of the policies of versions {span}: {base_v} / {r_v}, gap {version_gap}"
        )
    print(
        json.dumps(
            {
                "bench": "pipeline",
                "dilation": dilation,
                "node_cores": args.node_cores,
                "upload_mbps": args.upload_mbps,
                "batch_split": args.batch_split,
                "lr": args.lr or None,
                "steps": args.steps,
                "baseline": base["mode"],
                "compared": compared,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
