"""A stop does not wait out a trainer step. On a real model a step takes minutes (SmolLM2 on
2 cores: up to 296 s), longer than any grace an operator or ``primenode devnet --duration``
gives before SIGKILL. SIGTERM during a step abandons it: the process exits 0 at once, nothing
of the step is committed, and a restart resumes at the last committed version.

``PRIMENODE_STOP_DURING=trainer.step`` (node/util.py ``stop_point``) makes the step send its
process SIGTERM and then never finish: before the fix the trainer waited for its step thread
and this test's wait ran out."""

from __future__ import annotations

import pytest

from harness.processes import small_options
from harness.processes import wait_for_devnet as wait_for
from node.ops.churn import trainer_step
from node.ops.devnet import Devnet
from node.roles.ledger import Ledger
from node.util import STOP_ENV


def committed(devnet: Devnet) -> int | None:
    lg = Ledger(devnet.node("trainer").home.ledger_path, [], 1, 2)
    try:
        return lg.committed_version()
    finally:
        lg.close()


@pytest.mark.slow  # a small devnet and two trainer starts: ~1 min quiet
def test_sigterm_mid_step_exits_at_once_and_the_restart_resumes(tmp_path, monkeypatch):
    devnet = Devnet(small_options(tmp_path, workers=1, validators=1, quorum=1))
    devnet.prepare()
    trainer = devnet.node("trainer")
    log = devnet.out / "logs" / "trainer.log"
    try:
        for n in devnet.nodes:
            if n is not trainer:
                devnet.start(n)
        monkeypatch.setenv(STOP_ENV, "trainer.step")
        devnet.start(trainer)
        monkeypatch.delenv(STOP_ENV)
        assert trainer.proc is not None
        code = trainer.proc.wait(timeout=600)  # the step never ends: only abandoning it exits
        text = log.read_text()
        assert code == 0, f"trainer exited {code}\n{text[-3000:]}"
        assert "stopping mid-step 1: the step is abandoned, the run resumes at version 0" in text
        assert "exiting without waiting for: trainer step 1" in text
        assert (committed(devnet) or 0) == 0  # nothing of the abandoned step was committed

        devnet.start(trainer)  # the control: the same trainer, no stop, trains on
        wait_for(lambda: trainer_step(devnet) >= 1, 600, "the restarted trainer to take a step", devnet)
        assert (committed(devnet) or 0) >= 1
        assert "resumed at version 0" in log.read_text()
    finally:
        devnet.stop_all()
