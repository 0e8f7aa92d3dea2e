"""Validator capacity with committees (issue 32 point 2): admitted batches per CPU-second of
validation, for V validators and committees of k, beside every validator checking every batch.

    python bench/committees.py [--validators 1,2,4] [--sizes 0,1,2] [--steps 40] [--workers 2] [--hidden 64 --layers 2]
        [--prompts-per-batch 2 --group 4 --max-tokens 16] [--out DIR]

Each configuration is a real devnet (``node/ops/devnet.py``: bootstrap, trainer, workers,
validators as OS processes, tiny model) with ``[config] committee_size`` k (0: every
validator, the rule before committees) and the genesis quorum a majority of the committee.
Validation CPU is read from ``/proc/<pid>/stat`` (user + system, all threads) of every
validator process, between the trainer's second step (start-up, model load and the first
checkpoint excluded) and ``--steps`` steps later; admitted batches are counted in the
trainer's ledger over the same interval. Reported per configuration: admitted batches,
validator CPU-seconds, CPU-seconds per admitted batch and batches per CPU-second, votes and
replays per admitted batch (k when committees work, V without them), and the part of the CPU
spent replaying (each validator's own count: loading the batch's version into its engine, the
prefill and the rules) per replay and per admitted batch. The rest of a validator's CPU follows
the checkpoints (fetching, hashing, serving, applying each version's delta), which every node
does whatever the committees; ``--hidden``/``--layers`` size the model so that a replay weighs
what it does in a real run. Configurations run one after the
other on this machine, nothing else running. The last line of output is one JSON object.
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
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.processes import small_options  # noqa: E402
from node.ops.devnet import Devnet  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def admitted(devnet: Devnet) -> int:
    db = sqlite3.connect(devnet.node("trainer").home.ledger_path)
    try:
        return int(db.execute("SELECT COUNT(*) FROM batches WHERE admitted_ms IS NOT NULL").fetchone()[0])
    finally:
        db.close()


def step(devnet: Devnet) -> int:
    return max((r.get("step", 0) for r in devnet.trainer_metrics()), default=0)


def wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting for {what}")


def replay_counts(devnet: Devnet, names: list[str]) -> tuple[int, int, float, int, int]:
    """Votes, replays, replay CPU seconds and policy loads (in place, full) of the validators
    ``names`` so far, from their status."""
    votes = replays = in_place = full = 0
    cpu = 0.0
    for name in names:
        st = (devnet.node(name).status(timeout=5.0) or {}).get("role_state") or {}
        v = st.get("verdicts") or {}
        votes += int(v.get("accept", 0)) + int(v.get("reject", 0))
        replays += int(st.get("replays", 0))
        cpu += float(st.get("replay_cpu_s", 0.0))
        loads = st.get("policy_loads") or {}
        in_place += int(loads.get("in_place", 0))
        full += int(loads.get("full", 0))
    return votes, replays, cpu, in_place, full


def run_one(root: Path, validators: int, size: int, a: argparse.Namespace) -> dict[str, Any]:
    steps, workers, hidden, layers = a.steps, a.workers, a.hidden, a.layers
    on_committee = size if 0 < size < validators else validators
    opts = small_options(
        root,
        out=root / f"v{validators}-k{size}",
        workers=workers,
        validators=validators,
        quorum=on_committee // 2 + 1,
        prompts_per_batch=a.prompts_per_batch,
        group_size=a.group,
        max_tokens=a.max_tokens,
        config={
            "tiny_hidden_size": hidden,
            "tiny_layers": layers,
            "committee_size": size,
            "committee_deadline_s": 30.0,
            "policy_dtype": a.policy_dtype,
        },
    )
    devnet = Devnet(opts)
    devnet.prepare()
    devnet.start_all()
    names = [f"validator-{i}" for i in range(validators)]
    try:
        wait(lambda: step(devnet) >= 2, 600, "the second step")
        pids = [devnet.node(n).proc.pid for n in names]  # type: ignore[union-attr]
        cpu0, adm0, counts0, t0 = (
            sum(map(cpu_seconds, pids)),
            admitted(devnet),
            replay_counts(devnet, names),
            time.monotonic(),
        )
        wait(lambda: step(devnet) >= 2 + steps, 3600, f"{steps} more steps")
        cpu1, adm1, counts1, t1 = (
            sum(map(cpu_seconds, pids)),
            admitted(devnet),
            replay_counts(devnet, names),
            time.monotonic(),
        )
    finally:
        devnet.stop_all()
    batches, cpu = adm1 - adm0, cpu1 - cpu0
    votes, replays, replay_cpu, in_place, full = (b - a for a, b in zip(counts0, counts1, strict=True))
    return {
        "validators": validators,
        "committee": size,
        "quorum": opts.quorum,
        "admitted": batches,
        "validator_cpu_s": round(cpu, 2),
        "cpu_s_per_batch": round(cpu / batches, 3) if batches else None,
        "batches_per_cpu_s": round(batches / cpu, 4) if cpu else None,
        "votes_per_batch": round(votes / batches, 2) if batches else None,
        "replays_per_batch": round(replays / batches, 2) if batches else None,
        "replay_cpu_s": round(replay_cpu, 2),
        "one_replay_cpu_s": round(replay_cpu / replays, 3) if replays else None,
        "replay_cpu_s_per_batch": round(replay_cpu / batches, 3) if batches else None,
        "loads_in_place": in_place,
        "loads_full": full,
        "wall_s": round(t1 - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--validators", default="1,2,4")
    ap.add_argument("--sizes", default="0,1,2", help="committee sizes (0: every validator)")
    ap.add_argument("--steps", type=int, default=40)  # 6 steps measure 1.5-5 s: too short to read
    ap.add_argument("--workers", type=int, default=2)
    # the tiny model's size: 64 x 2 makes a replay ~0.05 s, below what following the checkpoints
    # costs each validator per version; a bigger one makes the replay the larger part, as in a real run
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    # a batch's size: prompts x completions x tokens (the small devnet's 2 x 4 x 16 by default);
    # a replay's cost grows with it, a version's does not
    ap.add_argument("--prompts-per-batch", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--policy-dtype",
        default="float32",
        help="dtype of the published weights: bfloat16 publishes sparse deltas, which a validator "
        "applies in place (a chain of them when it skipped versions); float32 changes every element",
    )
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    root = a.out or Path(tempfile.mkdtemp(prefix="bench-committees-"))
    rows = []
    for v in (int(x) for x in a.validators.split(",")):
        for k in (int(x) for x in a.sizes.split(",")):
            if k >= v and k != 0:
                continue  # the same as every validator
            row = run_one(root, v, k, a)
            rows.append(row)
            print(
                f"V={row['validators']} k={row['committee'] or 'all'} quorum={row['quorum']}: "
                f"{row['admitted']} admitted, validator CPU {row['validator_cpu_s']} s "
                f"({row['cpu_s_per_batch']} s/batch), replays {row['replays_per_batch']}/batch "
                f"of {row['one_replay_cpu_s']} CPU s each",
                flush=True,
            )
    print()
    head = (
        "V",
        "k",
        "quorum",
        "admitted",
        "val CPU s",
        "CPU s/batch",
        "batches/CPU s",
        "replays/batch",
        "1 replay CPU s",
        "replay CPU s/batch",
        "loads in place",
        "loads full",
    )
    keys = (
        "validators",
        "committee",
        "quorum",
        "admitted",
        "validator_cpu_s",
        "cpu_s_per_batch",
        "batches_per_cpu_s",
        "replays_per_batch",
        "one_replay_cpu_s",
        "replay_cpu_s_per_batch",
        "loads_in_place",
        "loads_full",
    )
    print(" ".join(f"{h:>{max(len(h), 4)}}" for h in head))
    for r in rows:
        cells = [str(r[k] if k != "committee" or r[k] else "all") for k in keys]
        print(" ".join(f"{c:>{max(len(h), 4)}}" for c, h in zip(cells, head, strict=True)))
    print(
        json.dumps(
            {
                "bench": "committees",
                "steps": a.steps,
                "workers": a.workers,
                "hidden": a.hidden,
                "layers": a.layers,
                "batch": [a.prompts_per_batch, a.group, a.max_tokens],
                "policy_dtype": a.policy_dtype,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
