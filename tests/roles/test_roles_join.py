"""`primenode join --bootstrap ... --run-id HEX` as a user runs it: a joiner pinned to one run
refuses a bootstrap serving another, with one clear line and exit 1, before starting a node.
(tests/protocol/test_genesis.py covers the fetch itself, including tampered genesis files, in-process.)"""

from __future__ import annotations

from harness.processes import cli, init_run, start, stop


def test_join_with_another_run_id_is_refused_with_one_clear_line(tmp_path):
    boot, joiner, genesis = init_run(tmp_path, "served-run")
    served_id = cli("run", "show", str(genesis)).stdout
    other = "ab" * 32
    assert other not in served_id
    log = tmp_path / "boot.log"
    proc = start(
        "bootstrap", "--home", str(boot), "--listen", "/ip4/127.0.0.1/tcp/0", "--genesis", str(genesis), log=log
    )
    try:
        addr = proc.stdout.readline().decode().strip()  # blocks until the bootstrap listens (or exits)
        assert addr.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in addr, log.read_text()
        res = cli(
            "join",
            "--home",
            str(joiner),
            "--role",
            "worker",
            "--bootstrap",
            addr,
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--run-id",
            other,
        )
        assert res.returncode == 1, res.stderr
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
        assert "could not get the run genesis" in errors[0] and "expected run id" in errors[0], errors[0]
        assert not (joiner / "runtime.json").exists()  # refused before a node started
        assert proc.poll() is None  # the bootstrap is unharmed
    finally:
        if proc.poll() is None:
            stop(proc)
        proc.stdout.close()
