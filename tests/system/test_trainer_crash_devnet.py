"""A real trainer process, kill -9'd at each step of its commit (``PRIMENODE_CRASH_AT``) in a
running devnet, restarted each time: it resumes at the version its ledger committed, never
announces two different versions under one number, and the network keeps training."""

from __future__ import annotations

import signal

import pytest

from harness.processes import small_options
from harness.processes import wait_for_devnet as wait_for
from node.ops.churn import LedgerAudit, trainer_step
from node.ops.devnet import Devnet
from node.roles.ledger import Ledger
from node.util import CRASH_ENV

# (crash point, whether the step's version is committed when the process dies there)
POINTS = [
    ("state.partial", False),  # some files of v+1 written under the temporary name
    ("state.written", False),  # v+1 complete and fsynced, not renamed
    ("state.renamed", False),  # folder v+1 in place, the ledger still at v
    ("ledger.committed", True),  # committed, the old folder still there, nothing published
    ("state.pruned", True),  # old folder gone, v+1 not published
    ("published", True),  # v+1 announced to the run
]


def committed(devnet: Devnet) -> int | None:
    lg = Ledger(devnet.node("trainer").home.ledger_path, [], 1, 2)
    try:
        return lg.committed_version()
    finally:
        lg.close()


def store_roots(devnet: Devnet) -> dict[int, str]:
    """Version -> manifest root (hex prefix) of what the trainer's chunk store holds (published)."""
    d = devnet.node("trainer").home.chunks_dir / "versions"
    out = {}
    for p in d.iterdir() if d.exists() else ():
        v, root = p.name.split("-")
        out[int(v)] = root
    return out


@pytest.mark.slow  # one devnet, six trainer crashes and restarts: 3 min at load ~6, 16 min at load ~19
def test_trainer_killed_at_each_step_of_its_commit(tmp_path, monkeypatch):
    devnet = Devnet(small_options(tmp_path))
    devnet.prepare()
    trainer = devnet.node("trainer")
    log = devnet.out / "logs" / "trainer.log"
    audit = LedgerAudit(trainer.home.ledger_path)
    seen_roots: dict[int, str] = {}
    try:
        for n in devnet.nodes:
            if n is not trainer:
                devnet.start(n)
        for point, lands in POINTS:
            before = committed(devnet)
            target = 1 if before is None else before + 1
            monkeypatch.setenv(CRASH_ENV, f"{point}@{target}")
            devnet.start(trainer)
            monkeypatch.delenv(CRASH_ENV)
            assert trainer.proc is not None
            code = trainer.proc.wait(timeout=900)
            assert code == -signal.SIGKILL, f"{point}: trainer exited {code}\n{log.read_text()[-3000:]}"
            audit.sample()
            after = committed(devnet)
            assert after == (target if lands else target - 1), (point, before, after)
            roots = store_roots(devnet)
            # a version is announced only once committed: nothing in the store beyond the commit
            assert max(roots) <= after, (point, sorted(roots), after)
            for v, r in roots.items():  # and never two different versions under one number
                assert seen_roots.setdefault(v, r) == r, f"version {v} published with two roots"
            states = sorted(p.name for p in trainer.home.trainer_states_dir.iterdir())
            # the committed version's folder survives every crash point
            assert f"v{after:010d}" in states, (point, states)

        resumed_at = committed(devnet)
        assert resumed_at is not None
        devnet.start(trainer)
        wait_for(
            lambda: audit.sample() and trainer_step(devnet) >= resumed_at + 2,
            600,
            "the restarted trainer to train two more steps",
            devnet,
        )
        text = log.read_text()
        # every restart resumed exactly where the ledger stood (never silently at version 0)
        resumed = [
            int(line.split("resumed at version ")[1].split(",")[0])
            for line in text.splitlines()
            if "resumed at version" in line
        ]
        assert resumed == [0, 0, 0, 1, 2, 3], resumed
        assert text.count("dropping uncommitted training state") >= 1  # state.renamed rolled back
        for v, r in store_roots(devnet).items():
            assert seen_roots.setdefault(v, r) == r, f"version {v} published with two roots"
        for name in ("worker-0", "worker-1", "validator-0", "validator-1", "validator-2"):
            assert "conflict" not in (devnet.out / "logs" / f"{name}.log").read_text(), name
        assert audit.lost == {}, audit.lost
        assert audit.duplicate_slots == 0
    finally:
        devnet.stop_all()
