"""`primenode join` pointed at a libp2p node that is not primenode, and a foreign peer
connecting to a primenode node (issue 30, point 6), as a user runs them: real processes
through the CLI, against a plain py-libp2p host (Noise only, none of our protocols).

Before: the join exited with "unreachable" (the real cause, "protocol not supported", only
in a traceback); with ``--genesis`` it never gave up, redialled every ~6 s and logged dozens
of 7-line ERROR entries from ``libp2p.host.basic_host``; a foreign connection left a dozen
of them. Time limits are hang guards, not performance thresholds.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.processes import HANG_GUARD_S, stop, terminal_signals, wait_for

REPO = Path(__file__).resolve().parents[2]
# this checkout's code, whatever `primenode` on PATH points at
ENV = dict(
    os.environ,
    PYTHONUNBUFFERED="1",
    OMP_NUM_THREADS="1",
    PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
)
CLI = [sys.executable, "-m", "node.ops.cli"]
MISSING = "is a libp2p node but does not speak primenode (/primenode/rr/1.0.0 not supported)"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=HANG_GUARD_S, env=ENV, cwd=REPO)


def spawn(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=f,
            env=ENV,
            cwd=REPO,
            start_new_session=True,
            preexec_fn=terminal_signals,
        )


def foreign(log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    proc = spawn([sys.executable, "-m", "harness.foreign_libp2p", *extra], log)
    addr = proc.stdout.readline().decode().strip()
    assert addr.startswith("/ip4/"), log.read_text()
    return proc, addr


@pytest.fixture
def homes(tmp_path):
    """A joiner's home and a genesis naming it (trainer and validator)."""
    home = tmp_path / "joiner"
    assert cli("init", "--home", str(home)).returncode == 0
    pid = cli("id", "--home", str(home)).stdout.strip()
    genesis = tmp_path / "run.toml"
    res = cli(
        "run", "init", "--home", str(home), "--out", str(genesis), "--trainer", pid, "--validator", pid,
        "--name", "foreign-test",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return home, genesis


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    proc.stdout.close()


def listening_bootstrap(home: Path, genesis: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """``primenode bootstrap`` on a free loopback port, listening: its process and address."""
    boot = spawn(
        [*CLI, "bootstrap", "--home", str(home), "--genesis", str(genesis), "--listen", "/ip4/127.0.0.1/tcp/0"], log
    )
    boot_addr = boot.stdout.readline().decode().strip()
    if not boot_addr.startswith("/ip4/"):
        kill(boot)
        raise AssertionError(log.read_text())
    wait_for(lambda: "listening on" in log.read_text(), HANG_GUARD_S, "the bootstrap to listen", [log], [boot])
    return boot, boot_addr


def libp2p_noise(text: str) -> list[str]:
    """ERROR lines, and any line from py-libp2p's own loggers."""
    return [ln for ln in text.splitlines() if re.search(r" (ERROR +\S|[A-Z]+ +libp2p\.)", ln)]


def test_join_against_a_foreign_libp2p_node_fails_with_one_line_naming_what_is_missing(tmp_path, homes):
    home, _ = homes
    host, addr = foreign(tmp_path / "foreign.log")
    try:
        res = cli("join", "--home", str(home), "--role", "worker", "--bootstrap", addr)
    finally:
        kill(host)
    assert res.returncode == 1
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and MISSING in errors[0], res.stderr
    assert "unreachable" not in res.stderr and "no answer within" not in res.stderr  # not a timeout
    assert "Traceback" not in res.stderr and not libp2p_noise(res.stderr), res.stderr


@pytest.mark.slow  # ~20 s on two quiet cores: the slow tier (README)
def test_join_with_a_genesis_says_so_and_backs_off_instead_of_looping(tmp_path, homes):
    home, genesis = homes
    host, addr = foreign(tmp_path / "foreign.log")
    log = tmp_path / "join.log"
    join = spawn(
        [*CLI, "join", "--home", str(home), "--role", "worker", "--genesis", str(genesis), "--bootstrap", addr,
         "--listen", "/ip4/127.0.0.1/tcp/0"],
        log,
    )  # fmt: skip
    try:
        said = wait_for(
            lambda: [ln for ln in log.read_text().splitlines() if MISSING in ln][3:] != [],
            HANG_GUARD_S,
            "four 'does not speak primenode' lines",
            logs=[log],
            procs=[join],
        )
        assert said
        assert stop(join, signal.SIGTERM) == 0, log.read_text()
    finally:
        kill(join)
        kill(host)
    text = log.read_text()
    lines = [ln for ln in text.splitlines() if MISSING in ln]
    delays = [float(m.group(1)) for ln in lines if (m := re.search(r"next try in (\d+) s", ln))]
    assert len(delays) == len(lines) >= 4, text
    assert all(b == min(2 * a, 60) for a, b in itertools.pairwise(delays)), delays  # exponential, capped
    assert not libp2p_noise(text) and "Traceback" not in text, text


def test_a_foreign_connection_leaves_at_most_one_log_line(tmp_path, homes):
    home, genesis = homes
    log = tmp_path / "boot.log"
    boot, boot_addr = listening_bootstrap(home, genesis, log)
    try:
        before = len(log.read_text().splitlines())
        peer, _ = foreign(tmp_path / "foreign.log", "--dial", boot_addr)
        try:
            # the bootstrap drops a peer that never opens gossip (after its grace period)
            assert peer.stdout.readline().decode().strip() == "connected", (tmp_path / "foreign.log").read_text()
            assert peer.stdout.readline().decode().strip() == "closed", (tmp_path / "foreign.log").read_text()
        finally:
            kill(peer)
        after = log.read_text().splitlines()[before:]
        assert len(after) <= 1, "\n".join(after)
        assert stop(boot, signal.SIGTERM) == 0
    finally:
        kill(boot)


def test_an_autonat_dial_back_leaves_no_log_line(tmp_path, homes):
    """A dial-back (AutoNAT: a fresh connection, the Noise handshake, hang up) to a running
    bootstrap: the dialled side fails to negotiate a muxer, which py-libp2p logs at ERROR, once
    per probe and peer, at every node. Control: the dial-back succeeded (it authenticated)."""
    import trio

    from node.p2p.host import make_host, parse_peer_addr
    from node.p2p.nat import DialBackAutoNAT
    from protocol.identity import NodeKey

    home, genesis = homes
    log = tmp_path / "boot.log"
    boot, boot_addr = listening_bootstrap(home, genesis, log)
    try:
        before = len(log.read_text().splitlines())
        info = parse_peer_addr(boot_addr)

        async def dial_back() -> bytes | None:
            host = make_host(NodeKey.generate())
            return await DialBackAutoNAT(host, timeout=HANG_GUARD_S)._try_dial(info.peer_id, [info.addrs[0].to_bytes()])

        assert trio.run(dial_back) is not None  # control: the bootstrap was dialled and authenticated
        assert stop(boot, signal.SIGTERM) == 0
        after = [ln for ln in log.read_text().splitlines()[before:] if "stopping" not in ln and "stopped" not in ln]
        assert not libp2p_noise("\n".join(after)), "\n".join(after)
    finally:
        kill(boot)
