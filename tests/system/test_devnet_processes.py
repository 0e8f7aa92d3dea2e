"""A real network of OS processes started through the CLI (tiny model): crashes and restarts."""

from __future__ import annotations

import signal

import pytest

from harness.processes import small_options
from harness.processes import wait_for_devnet as wait_for
from node.ops.churn import LedgerAudit, trainer_step
from node.ops.devnet import Devnet


@pytest.mark.slow  # ~100-135 s on two quiet cores: the slow tier (README)
def test_kill9_worker_validator_and_trainer(tmp_path):
    devnet = Devnet(small_options(tmp_path))
    devnet.prepare()
    devnet.start_all()
    try:
        wait_for(lambda: trainer_step(devnet) >= 2, 300, "two steps", devnet)
        audit = LedgerAudit(devnet.node("trainer").home.ledger_path)
        worker0 = devnet.node("worker-0").home.load_key().peer_id
        devnet.kill("worker-0", signal.SIGKILL)
        devnet.kill("validator-0", signal.SIGKILL)
        reached = trainer_step(devnet)
        wait_for(lambda: trainer_step(devnet) >= reached + 2, 300, "training to continue without them", devnet)

        # The killed worker comes back on its home and resumes its batch chain after the last
        # counter it kept (a counter used twice is a duplicate slot; one skipped would strand
        # every later batch): a batch past the old chain is admitted, and nothing of the
        # worker's waits for a missing counter.
        before = audit.counters(worker0)
        last = max((c for c, _s, _r in before), default=-1)
        devnet.start(devnet.node("worker-0"))

        def chain_goes_on() -> bool:
            chain = audit.counters(worker0)
            counters = sorted({c for c, _s, _r in chain})
            return (
                any(c > last and s == "admitted" for c, s, _r in chain)
                and counters == list(range(counters[-1] + 1))  # (a fetch may land out of order: wait)
                and not any(s == "pending" and r.startswith("waiting for") for _c, s, r in chain)
            )

        wait_for(chain_goes_on, 300, "the restarted worker's chain to go on, without a gap", devnet)

        # Every batch admitted before the crash must still be admitted afterwards, except the
        # ledger's one sanctioned exit: "stale before training" (2 workers make more batches
        # than 1 batch per step consumes, so leftovers age out past max_async, crash or not).
        assert audit.sample()
        assert audit.seen_admitted
        step_before = trainer_step(devnet)
        devnet.kill("trainer", signal.SIGKILL)
        devnet.start(devnet.node("trainer"))
        wait_for(
            lambda: audit.sample() and trainer_step(devnet) >= step_before + 2,
            300,
            "the restarted trainer to train",
            devnet,
        )
        assert audit.lost == {}, f"an admitted rollout was lost across the trainer crash: {audit.lost}"
        assert audit.duplicate_slots == 0
        steps = [r["step"] for r in devnet.trainer_metrics() if not r.get("skipped")]
        # resumed from its checkpoint: step numbers keep increasing, none trained twice
        assert steps == sorted(set(steps))
    finally:
        codes = devnet.stop_all()
    assert codes["bootstrap"] == 0
