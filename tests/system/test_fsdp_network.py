"""The trainer as a 2-rank FSDP2 group on the network (``primenode join --role trainer --nproc 2``),
through the CLI as real processes: rank 0 is the network node, the group trains and publishes;
kill -9 of a follower rank stops the group, and the restarted group resumes at the ledger's
commit with nothing admitted lost."""

from __future__ import annotations

import signal
import sqlite3
from pathlib import Path

import psutil
import pytest

from harness.processes import small_options
from harness.processes import wait_for_devnet as wait_for
from node.ops.churn import LedgerAudit, trainer_step
from node.ops.devnet import Devnet
from node.rl.ranks import is_group_checkpoint


def _rank(proc: psutil.Process) -> str | None:
    try:
        return proc.environ().get("RANK")
    except (psutil.Error, OSError):
        return None


def _follower(devnet: Devnet) -> psutil.Process:
    """Rank 1 of the trainer's torchrun group: a child of the node process started by the CLI."""
    root = psutil.Process(devnet.node("trainer").proc.pid)
    ranks = {_rank(p): p for p in root.children(recursive=True)}
    assert set(ranks) >= {"0", "1"}, f"the trainer did not start two ranks: {sorted(map(str, ranks))}"
    return ranks["1"]


@pytest.mark.slow  # ~75 s on two quiet cores: the slow tier (README)
def test_a_two_rank_trainer_trains_on_the_network_and_a_killed_rank_stops_the_group(tmp_path):
    opts = small_options(tmp_path, workers=1, validators=1, quorum=1)
    opts.node_args = {"trainer": ["--nproc", "2"]}
    devnet = Devnet(opts)
    devnet.prepare()
    devnet.start_all()
    try:
        wait_for(lambda: trainer_step(devnet) >= 2, 300, "two steps of the 2-rank trainer", devnet)
        home = devnet.node("trainer").home
        audit = LedgerAudit(home.ledger_path)
        assert audit.sample() and audit.seen_admitted
        states = sorted(Path(home.trainer_states_dir).glob("v*"))
        assert states and all(is_group_checkpoint(p) for p in states)  # DCP folders written by the group

        _follower(devnet).send_signal(signal.SIGKILL)
        proc = devnet.node("trainer").proc
        proc.wait(timeout=120)  # the whole group stops: torchrun ends every rank, the node exits
        assert proc.returncode != 0
        with sqlite3.connect(home.ledger_path) as db:  # what the ledger committed before the group died
            committed = int(db.execute("SELECT value FROM state WHERE key = 'checkpoint_step'").fetchone()[0])

        devnet.start(devnet.node("trainer"))
        wait_for(
            lambda: audit.sample() and trainer_step(devnet) >= committed + 2,
            300,
            "the restarted group to train on",
            devnet,
        )
        assert audit.lost == {}, f"an admitted batch was lost across the rank's death: {audit.lost}"
        steps = [r["step"] for r in devnet.trainer_metrics() if not r.get("skipped")]
        assert steps == sorted(set(steps))  # resumed at the commit: no version trained twice
    finally:
        codes = devnet.stop_all()
    assert codes["trainer"] == 0  # a requested stop of the group exits cleanly
