"""Churn (issue 8): real node processes killed with SIGKILL and restarted, one after
another, while the network trains; nothing admitted may be lost. The long version
is bench/churn.py."""

from __future__ import annotations

import pytest

from harness.processes import small_options
from harness.processes import wait_for_devnet as wait_for
from node.ops.churn import LedgerAudit, churn, trained_steps, trainer_step
from node.ops.devnet import Devnet


@pytest.mark.slow
def test_nodes_killed_and_restarted_in_turn_lose_nothing_admitted(tmp_path):
    devnet = Devnet(small_options(tmp_path))
    devnet.prepare()
    devnet.start_all()
    audit = LedgerAudit(devnet.node("trainer").home.ledger_path)
    try:
        wait_for(lambda: trainer_step(devnet) >= 2, 300, "two steps before the churn", devnet)
        # every kind of node, the trainer twice; one down at a time, 1-4 s down, 4-10 s apart
        schedule = ["worker-0", "trainer", "validator-1", "bootstrap", "worker-1", "validator-0", "trainer"]
        events = churn(devnet, audit, schedule=schedule, period_s=(4.0, 10.0), down_s=(1.0, 4.0), seed=8)
        assert [e.node for e in events] == schedule
        reached = trainer_step(devnet)
        wait_for(
            lambda: audit.sample() and trainer_step(devnet) >= reached + 2,
            300,
            "training to go on after the churn",
            devnet,
        )
        assert audit.seen_admitted, "nothing was admitted: the test proves nothing"
        assert audit.lost == {}, f"admitted batches lost: {audit.lost}"
        assert audit.duplicate_slots == 0
        steps = trained_steps(devnet)
        assert steps == sorted(set(steps)), "a step was trained twice across the trainer's restarts"
    finally:
        codes = devnet.stop_all()
    assert codes["bootstrap"] == 0
