"""Crash-safe trainer commits: a real trainer process (the trainer role's own resume and
commit code, real SQLite ledger, real files) SIGKILLs itself at each step of committing a
training step (``PRIMENODE_CRASH_AT``); a restarted trainer resumes at the version the
ledger committed, trains every batch into exactly one committed version, and refuses
(never silently version 0) when disk and ledger have no consistent resume point.

The swarm is not here (publishing is replaced by a marker file); the devnet test in
test_trainer_crash_devnet.py kills a whole trainer node at the same points, publishing included.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import trio

from harness.genesis import VALIDATORS
from harness.rl import fake_groups
from harness.roles import tiny_context
from node.errors import CheckpointError
from node.home import NodeHome
from node.roles.resume import TrainerStates
from node.roles.trainer import TrainerRole
from node.util import CRASH_ENV

ROOT = Path(__file__).resolve().parents[2]
BATCHES = [b"batch-a", b"batch-b"]

# The child: the trainer role's resume (_load_or_init) and commit (_commit_step) code on this
# home, one GRPO step on the admitted batches, then committed. Publishing is a marker file.
CHILD = textwrap.dedent("""
    import sys, trio, torch
    from pathlib import Path
    torch.set_num_threads(1)
    from node.home import NodeHome
    from node.roles.trainer import TrainerRole
    from harness.roles import tiny_context
    from harness.rl import fake_groups
    role = TrainerRole(NodeHome(sys.argv[1]), tiny_context(Path(sys.argv[2])))
    async def publish():
        (role.home.path / f"published-{role.version}").touch()
    role._publish_current = publish
    role._load_or_init()
    ids = [b.batch_id for b in role.ledger.untrained(oldest_first=True)]
    assert role.trainer.step(fake_groups(0, version=role.version)).skipped is False
    trio.run(role._commit_step, ids)
    print("committed", role.version)
""")


def role(tmp_path: Path) -> TrainerRole:
    r = TrainerRole(NodeHome(tmp_path / "home"), tiny_context(tmp_path / "ctx"))

    async def publish() -> None:  # the swarm is the devnet test's
        (r.home.path / f"published-{r.version}").touch()

    r._publish_current = publish  # type: ignore[method-assign]
    return r


def seed(tmp_path: Path) -> dict[str, torch.Tensor]:
    """A trainer home at version 0 (started once, committed) with two admitted, untrained
    batches in its ledger. Returns the version-0 weights."""
    (tmp_path / "home").mkdir()
    r = role(tmp_path)
    r._load_or_init()
    assert r.version == 0
    for i, b in enumerate(BATCHES):
        r.ledger.record_batch(b, "worker", 0, i, 1, b"signed batch bytes")
        for v in VALIDATORS:
            r.ledger.record_vote(b, v.peer_id, True, "", [1.0], worker="worker")
        assert r.ledger.try_admit(b) == "admitted"
    weights = {k: v.clone() for k, v in r.trainer.model.state_dict().items()}
    r.ledger.close()
    return weights


def run_child(tmp_path: Path, crash_at: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if crash_at is not None:
        env[CRASH_ENV] = crash_at
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "home"), str(tmp_path / "ctx")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def commit_one_step(tmp_path: Path) -> None:
    """Version 1 committed, in this process (for the tests about what a restart finds)."""
    r = role(tmp_path)
    r._load_or_init()
    assert not r.trainer.step(fake_groups(0, version=0)).skipped
    trio.run(r._commit_step, [b.batch_id for b in r.ledger.untrained()])
    assert r.ledger.committed_version() == 1
    r.ledger.close()


def trained_at(r: TrainerRole) -> dict[bytes, int | None]:
    out = {}
    for b in BATCHES:
        rec = r.ledger.batch(b)
        assert rec is not None
        out[b] = rec.trained_step
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# (crash point, committed when the process dies there)
# (each case starts a child process: the default run keeps one rollback, one roll-forward and
# the control; the slow run, and the devnet test, every point)
SLOW = pytest.mark.slow
POINTS = [
    pytest.param("state.partial", False, marks=SLOW),  # some files of version 1 under the temporary name
    pytest.param("state.written", False, marks=SLOW),  # version 1 complete and fsynced, not yet renamed
    pytest.param("state.renamed", False),  # folder v1 in place; the ledger still commits version 0
    pytest.param("ledger.committed", True),  # the ledger commits 1; folder v0 still there; not published
    pytest.param("state.pruned", True, marks=SLOW),  # v0 deleted; not published
    pytest.param(None, True, id="no-crash"),  # control: no crash
]


@pytest.mark.parametrize(("point", "lands"), POINTS)
def test_kill_at_each_step_of_the_commit_then_resume(tmp_path, point, lands):
    torch.set_num_threads(1)
    v0 = seed(tmp_path)
    proc = run_child(tmp_path, f"{point}@1" if point else None)
    if point is None:
        assert proc.returncode == 0 and "committed 1" in proc.stdout, proc.stderr[-3000:]
    else:
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]

    r = role(tmp_path)
    states = r.home.trainer_states_dir
    r._load_or_init()
    # resumed at exactly the ledger's commit, from that version's folder; nothing else on disk
    assert r.version == r.ledger.committed_version() == (1 if lands else 0)
    assert sorted(p.name for p in states.iterdir()) == [f"v{r.version:010d}"]
    assert same(r.trainer.model.state_dict(), v0) is not lands  # v1's weights, or exactly v0's
    # nothing was published beyond the commit (the marker of v1 only once committed, and
    # for the crash points before publishing, not at all)
    assert not (r.home.path / "published-1").exists() or (point is None)
    if lands:
        assert trained_at(r) == {b: 1 for b in BATCHES}
        assert r.ledger.untrained() == []
    else:
        # the step died uncommitted: its batches are untrained, and train once, into version 1
        assert trained_at(r) == {b: None for b in BATCHES}
        assert [b.batch_id for b in r.ledger.untrained(oldest_first=True)] == BATCHES
        assert r.trainer.step(fake_groups(0, version=0)).skipped is False
        trio.run(r._commit_step, BATCHES)
        assert trained_at(r) == {b: 1 for b in BATCHES}
        assert r.version == r.ledger.committed_version() == 1
        assert (r.home.path / "published-1").exists()
    assert sorted(p.name for p in states.iterdir()) == ["v0000000001"]
    r.ledger.close()


def test_refuses_when_the_ledger_commits_a_version_whose_folder_is_gone(tmp_path):
    seed(tmp_path)
    commit_one_step(tmp_path)
    states = TrainerStates(NodeHome(tmp_path / "home").trainer_states_dir)
    for v in states.versions():
        shutil.rmtree(states.folder(v))
    r = role(tmp_path)
    with pytest.raises(CheckpointError, match="committed version 1"):
        r._load_or_init()
    assert r.trainer is None  # no model was made: never a silent version 0
    assert r.ledger.committed_version() == 1  # and the ledger is untouched
    r.ledger.close()


def test_refuses_when_state_folders_exist_but_the_ledger_was_lost(tmp_path):
    seed(tmp_path)
    commit_one_step(tmp_path)
    home = NodeHome(tmp_path / "home")
    home.ledger_path.unlink()
    for extra in ("-wal", "-shm"):
        Path(str(home.ledger_path) + extra).unlink(missing_ok=True)
    r = role(tmp_path)
    with pytest.raises(CheckpointError, match="no committed training state"):
        r._load_or_init()
    assert TrainerStates(home.trainer_states_dir).versions() == [1]  # nothing deleted
    r.ledger.close()


def test_a_first_start_that_died_before_committing_version_0_starts_again(tmp_path):
    """Control for the refusals: an initial state whose commit never landed is no progress.
    (What the kill leaves, made directly: the folder of version 0, no commit in the ledger.)"""
    from node.rl.grpo import GRPOTrainer

    (tmp_path / "home").mkdir()
    r = role(tmp_path)
    r.states.write(GRPOTrainer(r.ctx.initial_model(), r.ctx.grpo_config()))
    assert r.states.versions() == [0] and r.ledger.committed_version() is None
    r.ledger.close()
    again = role(tmp_path)
    again._load_or_init()
    assert again.version == again.ledger.committed_version() == 0
    assert again.states.versions() == [0]
    again.ledger.close()


def test_pending_batches_are_decided_again_after_a_restart(tmp_path):
    """A crash between recording a batch's last vote and deciding it: the restarted trainer
    decides it (admits it) instead of leaving it pending forever."""
    seed(tmp_path)
    r = role(tmp_path)
    r.ledger.record_batch(b"late", "worker", 0, len(BATCHES), 1, b"signed batch bytes")  # the next counter
    for v in VALIDATORS:
        r.ledger.record_vote(b"late", v.peer_id, True, "", [0.5], worker="worker")  # try_admit never ran: "killed"
    r.ledger.close()
    again = role(tmp_path)
    again._load_or_init()
    assert again.ledger.batch(b"late").status == "pending"
    again._reevaluate_pending()
    assert again.ledger.batch(b"late").status == "admitted"
    again.ledger.close()


def test_refuses_when_the_chunk_store_holds_a_version_beyond_the_commit(tmp_path):
    """A version the run has seen is never trained again: if the store holds a signed version
    newer than the ledger's commit (the ledger restored from an older backup), the trainer
    stops before publishing anything, instead of announcing a second, different version 1."""
    from harness.genesis import TRAINER
    from node.roles.weights import export_weights

    seed(tmp_path)
    r = role(tmp_path)
    r._load_or_init()

    def announce(version: int) -> None:
        src = tmp_path / f"export-{version}"
        export_weights(r.trainer.model, src)
        _, raw = r.store.import_directory_blocking(TRAINER, version, src)
        r.store.add_announce(raw)

    announce(0)
    r._check_store()  # control: the store holds what the ledger committed
    announce(1)
    with pytest.raises(CheckpointError, match=r"published versions \[1\]"):
        r._check_store()
    r.ledger.close()
