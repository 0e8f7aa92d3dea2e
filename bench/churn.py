"""Churn benchmark: a devnet whose nodes are killed (SIGKILL) and restarted for minutes.

    python bench/churn.py [--minutes 10] [--period 10,30] [--down 1,8] [--victims all]
                          [--workers 2] [--validators 3] [--quorum 2] [--out DIR] [--seed 0]

Starts the network ``primenode devnet`` starts (node/ops/devnet.py: separate OS
processes on 127.0.0.1, tiny model; here 3 validators with a quorum of 2 by
default, so one validator down does not stop admission), lets it reach its
second step, then for ``--minutes`` kills a random node with SIGKILL every
``--period`` seconds (uniform in the range), keeps it down ``--down`` seconds
and restarts it with the same home (node/ops/churn.py; one node down at a time;
``--victims`` is a comma list of node names or ``all``, bootstrap included).
Afterwards the network runs until the trainer has made two more steps.

Reported: kills per node, admitted batches, **lost** admitted batches (must be
0: a batch once admitted that later is gone or changed status, other than the
ledger's "stale before training" rule, reported as aged_out), duplicate
admitted slots (must be 0), steps trained twice (must be 0), trainer steps
(versions) reached before/after the churn, and how long the trainer was down.
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from node.ops.churn import LedgerAudit, churn, trained_steps, trainer_step  # noqa: E402
from node.ops.devnet import Devnet, DevnetOptions  # noqa: E402


def wait_for(pred, timeout: float, what: str, audit: LedgerAudit) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        audit.sample()
        if pred():
            return time.monotonic() - t0
        time.sleep(1.0)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


def pair(text: str) -> tuple[float, float]:
    a, b = (float(x) for x in text.split(","))
    return a, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--period", type=pair, default=(10.0, 30.0), help="seconds between kills: min,max")
    ap.add_argument("--down", type=pair, default=(1.0, 8.0), help="seconds a killed node stays down: min,max")
    ap.add_argument("--victims", default="all")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--validators", type=int, default=3)
    ap.add_argument("--quorum", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    out = args.out or Path(tempfile.mkdtemp(prefix="primenode-churn-"))
    opts = DevnetOptions(
        out=out,
        workers=args.workers,
        validators=args.validators,
        quorum=args.quorum,
        steps=10**9,
        timeout_s=args.minutes * 60 + 900,
    )
    devnet = Devnet(opts)
    devnet.prepare()
    audit = LedgerAudit(devnet.node("trainer").home.ledger_path)
    victims = None if args.victims == "all" else args.victims.split(",")
    print(
        f"churn: devnet in {out}, {args.minutes:g} min of kills every {args.period} s, down {args.down} s", flush=True
    )
    devnet.start_all()
    t0 = time.monotonic()
    try:
        startup_s = wait_for(lambda: trainer_step(devnet) >= 2, 600, "two steps before the churn", audit)
        step_before = trainer_step(devnet)
        admitted_before = len(audit.seen_admitted)

        def show(ev) -> None:
            print(
                f"[{(time.monotonic() - t0) / 60:5.1f} min] killed {ev.node:12s} down {ev.down_s:4.1f} s  "
                f"step {trainer_step(devnet)}  admitted {len(audit.seen_admitted)}  lost {len(audit.lost)}",
                flush=True,
            )

        t_churn = time.monotonic()
        events = churn(
            devnet,
            audit,
            duration_s=args.minutes * 60,
            period_s=args.period,
            down_s=args.down,
            victims=victims,
            seed=args.seed,
            on_event=show,
        )
        churn_s = time.monotonic() - t_churn
        step_after_churn = trainer_step(devnet)
        recover_s = wait_for(
            lambda: trainer_step(devnet) >= step_after_churn + 2, 600, "two more steps after the churn", audit
        )
    finally:
        codes = devnet.stop_all()
    audit.sample()
    steps = trained_steps(devnet)
    kills: dict[str, int] = {}
    for ev in events:
        kills[ev.node] = kills.get(ev.node, 0) + 1
    result = {
        "minutes_of_churn": round(churn_s / 60, 1),
        "kills": len(events),
        "kills_per_node": kills,
        "admitted": len(audit.seen_admitted),
        "admitted_before_churn": admitted_before,
        "trained": audit.trained(),
        "aged_out": len(audit.aged_out),
        "lost": len(audit.lost),
        "lost_detail": {k.hex()[:16]: v for k, v in list(audit.lost.items())[:10]},
        "duplicate_slots": audit.duplicate_slots,
        "steps_trained_twice": len(steps) - len(set(steps)),
        "steps_in_order": steps == sorted(steps),
        "version_before_churn": step_before,
        "version_after_churn": step_after_churn,
        "version_final": trainer_step(devnet),
        "startup_s": round(startup_s, 1),
        "recover_s": round(recover_s, 1),
        "ledger_samples": audit.samples,
        "exit_codes": codes,
        "out": str(out),
        "ok": not audit.lost and audit.duplicate_slots == 0 and len(steps) == len(set(steps)),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
