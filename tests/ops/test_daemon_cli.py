"""Daemons as a user runs them: real OS processes started through the CLI.

bootstrap + join see each other in ``primenode status --json`` (with a measured
latency); SIGTERM stops both with exit 0, removes ``runtime.json`` and frees the
bootstrap's port at once; an unreachable bootstrap, a
missing genesis and a home with no running node are one clear line each.
Time limits here are hang guards, not performance thresholds.
"""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path

import pytest

from harness.processes import (
    HANG_GUARD_S,
    cli,
    init_run,
    outgoing_ip,
    start,
    status_json,
    stop,
    wait_for,
)


@pytest.fixture
def run_setup(tmp_path):
    return init_run(tmp_path, "cli-test")


def test_bootstrap_and_join_see_each_other_and_stop_cleanly(tmp_path, run_setup):
    boot_home, join_home, genesis = run_setup
    boot_log, join_log = tmp_path / "boot.log", tmp_path / "join.log"
    procs = []
    try:
        boot = start(
            "bootstrap",
            "--home",
            str(boot_home),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--genesis",
            str(genesis),
            log=boot_log,
        )
        procs.append(boot)
        first = boot.stdout.readline().decode().strip()  # blocks until the bootstrap listens (or exits)
        assert first.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/12D3KooW" in first, (first, boot_log.read_text())
        boot_id = first.rsplit("/p2p/", 1)[1]

        joiner = start(
            "join",
            "--home",
            str(join_home),
            "--role",
            "worker",
            "--bootstrap",
            first,
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            log=join_log,
        )
        procs.append(joiner)
        join_id = cli("id", "--home", str(join_home)).stdout.strip()

        def sees(home: Path, other: str):
            st = status_json(home)
            return st if st and other in {p["peer_id"] for p in st["peers"]} else None

        logs = [boot_log, join_log]
        st_boot = wait_for(
            lambda: sees(boot_home, join_id), HANG_GUARD_S, "the bootstrap to list the joiner", logs, procs
        )
        st_join = wait_for(
            lambda: sees(join_home, boot_id), HANG_GUARD_S, "the joiner to list the bootstrap", logs, procs
        )
        assert st_boot["peer_id"] == boot_id and st_boot["role"] == "bootstrap"
        assert st_join["peer_id"] == join_id and st_join["role"] == "worker"
        for st in (st_boot, st_join):
            assert {"peer_id", "role", "peers", "swarm", "gossip", "run_id"} <= set(st)
        assert st_boot["run_id"] == st_join["run_id"]  # the joiner got the genesis from the bootstrap

        # every connected peer gets a round-trip latency, without any request of ours
        def measured(home: Path, other: str):
            st = sees(home, other)
            return st if st and all(p["latency_ms"] is not None for p in st["peers"]) else None

        wait_for(lambda: measured(join_home, boot_id), HANG_GUARD_S, "a latency for the bootstrap", logs, procs)
        wait_for(lambda: measured(boot_home, join_id), HANG_GUARD_S, "a latency for the joiner", logs, procs)
        # the swarm view fills from heartbeats
        wait_for(
            lambda: (status_json(join_home) or {}).get("swarm", {}).get("by_role", {}).get("bootstrap"),
            HANG_GUARD_S,
            "a bootstrap heartbeat in the joiner's swarm view",
            logs,
            procs,
        )

        runtime = json.loads((join_home / "runtime.json").read_text())
        assert runtime["pid"] == joiner.pid and runtime["peer_id"] == join_id and runtime["role"] == "worker"
        assert all("/p2p/" + join_id in a for a in runtime["addrs"])
        # the status port answers on loopback only
        ip = outgoing_ip()
        if ip is not None:
            with pytest.raises(OSError):
                socket.create_connection((ip, runtime["status_port"]), timeout=5).close()

        # the human-readable view works too
        res = cli("status", "--home", str(boot_home))
        assert res.returncode == 0, res.stderr
        assert boot_id in res.stdout and "connected peers" in res.stdout and "gossip" in res.stdout

        # SIGTERM: both exit 0 and clean up
        assert stop(joiner) == 0, join_log.read_text()[-3000:]
        assert stop(boot) == 0, boot_log.read_text()[-3000:]
        # nothing holds the bootstrap's port any more: a new listener binds it at once
        # (SO_REUSEADDR, as every server sets: only TIME_WAIT leftovers are tolerated)
        boot_port = int(first.split("/tcp/")[1].split("/")[0])
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", boot_port))
            s.listen()
        assert not (join_home / "runtime.json").exists()
        assert not (boot_home / "runtime.json").exists()
        for log in logs:
            assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
        res = cli("status", "--home", str(boot_home))
        assert res.returncode == 1 and "no running node" in res.stderr
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdout.close()


def test_sigint_stops_a_bootstrap_with_exit_0(tmp_path, run_setup):
    boot_home, _, genesis = run_setup
    log = tmp_path / "boot.log"
    boot = start(
        "bootstrap", "--home", str(boot_home), "--listen", "/ip4/127.0.0.1/tcp/0", "--genesis", str(genesis), log=log
    )
    try:
        lines = [boot.stdout.readline().decode().strip()]
        assert lines[0].startswith("/ip4/"), log.read_text()
        assert stop(boot, signal.SIGINT) == 0, log.read_text()
        rest = boot.stdout.read().decode().splitlines()
        assert all(ln.startswith("/ip4/") for ln in lines + [ln for ln in rest if ln.strip()])  # stdout: addrs only
        assert not (boot_home / "runtime.json").exists()
    finally:
        if boot.poll() is None:
            boot.kill()
            boot.wait()
        boot.stdout.close()


def test_a_bootstrap_never_loads_torch(tmp_path, run_setup):
    """A bootstrap only answers joins and relays: torch in it is ~190 MiB of memory an operator
    pays on a small VPS for nothing (the progress bar's import of the roles once pulled it in:
    105 -> 295 MiB). Once the bootstrap answered its status, everything it runs at start has
    run (the status is served by the same event loop, after the start-up tasks' first steps)."""
    boot_home, _, genesis = run_setup
    log = tmp_path / "boot.log"
    boot = start(
        "bootstrap", "--home", str(boot_home), "--listen", "/ip4/127.0.0.1/tcp/0", "--genesis", str(genesis), log=log
    )
    try:
        assert boot.stdout.readline().decode().startswith("/ip4/"), log.read_text()
        wait_for(lambda: "listening on" in log.read_text(), HANG_GUARD_S, "the bootstrap's start-up", [log], [boot])
        wait_for(lambda: status_json(boot_home), HANG_GUARD_S, "the bootstrap's status", [log], [boot])
        libraries = {ln.split()[-1] for ln in Path(f"/proc/{boot.pid}/maps").read_text().splitlines() if "/" in ln}
        assert not [lib for lib in libraries if "/torch/" in lib], "a bootstrap loaded torch"
        assert stop(boot, signal.SIGTERM) == 0, log.read_text()
    finally:
        if boot.poll() is None:
            boot.kill()
            boot.wait()
        boot.stdout.close()


def test_unreachable_bootstrap_is_a_clear_error_not_a_hang(tmp_path, run_setup):
    _, join_home, _ = run_setup
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fake_id = cli("id", "--home", str(tmp_path / "boot")).stdout.strip()
    res = cli(
        "join",
        "--home",
        str(join_home),
        "--role",
        "worker",
        "--bootstrap",
        f"/ip4/127.0.0.1/tcp/{port}/p2p/{fake_id}",
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
    )
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "genesis" in lines[0] and "Traceback" not in res.stderr, res.stderr
    assert not (join_home / "runtime.json").exists()


def test_unreachable_bootstrap_with_local_genesis_is_a_clear_error(tmp_path, run_setup):
    boot_home, join_home, genesis = run_setup
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    boot_id = cli("id", "--home", str(boot_home)).stdout.strip()
    res = cli(
        "join",
        "--home",
        str(join_home),
        "--role",
        "worker",
        "--genesis",
        str(genesis),
        "--bootstrap",
        f"/ip4/127.0.0.1/tcp/{port}/p2p/{boot_id}",
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
    )
    assert res.returncode != 0
    assert "cannot reach any bootstrap" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (join_home / "runtime.json").exists()


def test_clear_errors_before_starting(tmp_path, run_setup):
    boot_home, join_home, genesis = run_setup
    # status with no node running
    res = cli("status", "--home", str(join_home))
    assert res.returncode == 1
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "no running node" in err[0] and "primenode join/bootstrap" in err[0]
    assert cli("status", "--json", "--home", str(join_home)).returncode == 1
    # a stale runtime.json (a node that died) reads the same
    (join_home / "runtime.json").write_text(json.dumps({"pid": 1, "status_port": 9}))
    res = cli("status", "--home", str(join_home))
    assert res.returncode == 1 and "no running node" in res.stderr
    (join_home / "runtime.json").unlink()
    # bootstrap without a genesis, join without a bootstrap, a bad bootstrap address, a missing home
    res = cli("bootstrap", "--home", str(boot_home))
    assert res.returncode == 1 and "--genesis" in res.stderr
    res = cli("join", "--home", str(join_home), "--role", "worker")
    assert res.returncode == 1 and "--bootstrap" in res.stderr
    res = cli("join", "--home", str(join_home), "--role", "worker", "--bootstrap", "/ip4/127.0.0.1/tcp/1")
    assert res.returncode == 1 and "/p2p/" in res.stderr
    res = cli("join", "--home", str(tmp_path / "nohome"), "--role", "worker", "--genesis", str(genesis))
    assert res.returncode == 1 and "primenode init" in res.stderr
    # a validator the genesis does not name is refused (the trainer/validator here is the joiner)
    res = cli("join", "--home", str(boot_home), "--role", "validator", "--genesis", str(genesis))
    assert res.returncode == 1 and "validators" in res.stderr
    for r in (res,):
        assert "Traceback" not in r.stderr
