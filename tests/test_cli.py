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
    ],
)
def test_help_documents_options(cmd, options):
    res = run(*cmd, "--help", check=True)
    for opt in options:
        assert opt in res.stdout
