"""The CLI as a user runs it: a real subprocess of the installed console script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

PRIMENODE = shutil.which("primenode")


def run(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    cmd = [PRIMENODE, *args] if PRIMENODE else [sys.executable, "-m", "node.ops.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=check)


def test_init_then_id_is_stable(tmp_path):
    home = str(tmp_path / "home")
    out = run("init", "--home", home, check=True).stdout
    pid = run("id", "--home", home, check=True).stdout.strip()
    assert pid.startswith("12D3KooW") and pid in out
    assert run("id", "--home", home, check=True).stdout.strip() == pid


def test_loose_key_gives_one_clear_line(tmp_path):
    home = tmp_path / "home"
    run("init", "--home", str(home), check=True)
    os.chmod(home / "key", 0o644)
    res = run("id", "--home", str(home))
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "chmod 600" in lines[0]


def test_debug_shows_traceback(tmp_path):
    res = run("--debug", "id", "--home", str(tmp_path / "missing"))
    assert res.returncode != 0 and "Traceback" in res.stderr


def test_missing_home_is_a_clear_error(tmp_path):
    res = run("id", "--home", str(tmp_path / "missing"))
    assert res.returncode == 1
    assert "primenode init" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize(
    "cmd,options",
    [
        (["bootstrap"], ["--listen", "--genesis"]),
        (["join"], ["--role", "--bootstrap", "--max-upload-mbps", "--target-peers"]),
        (["status"], ["--json"]),
        (["eval"], ["--genesis", "--home", "--version", "--model", "--split", "--samples", "--baseline"]),
    ],
)
def test_help_documents_options(cmd, options):
    res = run(*cmd, "--help", check=True)
    for opt in options:
        assert opt in res.stdout


def test_run_init_defaults_to_a_majority_quorum_of_the_validators_or_of_a_committee(tmp_path):
    from node.genesis_file import read_genesis
    from protocol import NodeKey

    owner = str(tmp_path / "owner")
    run("init", "--home", owner, check=True)
    trainer = NodeKey(b"\x01" * 32).peer_id
    validators = [NodeKey(bytes([i + 2]) * 32).peer_id for i in range(4)]

    def run_init(out: str, names: list[str], *extra: str) -> tuple[int, str]:
        flags = [arg for v in names for arg in ("--validator", v)]
        args = ["run", "init", "--home", owner, "--out", str(tmp_path / out), "--trainer", trainer, *flags, *extra]
        res = run(*args, check=True)
        return read_genesis(tmp_path / out).genesis.quorum, res.stdout

    # no --quorum: a majority (len // 2 + 1), printed in the summary
    for n, majority in ((1, 1), (2, 2), (3, 2)):
        quorum, stdout = run_init(f"run{n}.toml", validators[:n])
        assert quorum == majority and f"quorum {majority} of {n} validators" in stdout
    # four or more validators: committees of three per batch (protocol/committee.py), a
    # majority of the committee; --committee-size 0 keeps every validator on every batch
    quorum, stdout = run_init("run4.toml", validators[:4])
    assert quorum == 2 and "committees of 3 of 4 validators per batch, quorum 2" in stdout
    assert "committee_size = 3" in read_genesis(tmp_path / "run4.toml").genesis.config_toml
    quorum, stdout = run_init("all4.toml", validators[:4], "--committee-size", "0")
    assert quorum == 3 and "quorum 3 of 4 validators" in stdout
    assert "committee_size" not in read_genesis(tmp_path / "all4.toml").genesis.config_toml
    # a committee smaller than the quorum could never admit a batch: refused, naming the fix
    flags = [arg for v in validators for arg in ("--validator", v)]
    res = run(
        "run", "init", "--home", owner, "--out", str(tmp_path / "bad.toml"), "--trainer", trainer, *flags,
        "--committee-size", "2", "--quorum", "3",
    )  # fmt: skip
    assert res.returncode != 0 and "committee_size 2 is smaller than the quorum 3" in res.stdout + res.stderr
    assert not (tmp_path / "bad.toml").exists()
    # --quorum still overrides it, either way
    quorum, stdout = run_init("low.toml", validators[:3], "--quorum", "1")
    assert quorum == 1 and "quorum 1 of 3 validators" in stdout
    assert run_init("all.toml", validators[:3], "--quorum", "3")[0] == 3
