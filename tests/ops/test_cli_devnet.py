"""`primenode devnet` through the real CLI: it trains, writes metrics.jsonl and the
reward-curve PNG, and a Ctrl+C (SIGINT) stops every node process cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from harness.processes import processes_naming, terminal_signals


@pytest.mark.slow  # ~50-60 s on two quiet cores: the slow tier (README)
def test_devnet_trains_writes_metrics_and_stops_on_ctrl_c(tmp_path):
    out = tmp_path / "devnet-out"
    log = tmp_path / "devnet.log"  # a file, not a pipe: the live table would fill a pipe nobody reads
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "node.ops.cli",
                "devnet",
                "--out",
                str(out),
                "--steps",
                "1000",
                "--workers",
                "1",
                "--validators",
                "1",
                "--timeout",
                "600",
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "200"},
            preexec_fn=terminal_signals,  # Ctrl+C as in a terminal, however the test run was started
        )
    trainer_metrics = out / "nodes" / "trainer" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            if trainer_metrics.exists() and len(trainer_metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(1.0)
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert trainer_metrics.exists() and len(trainer_metrics.read_text().splitlines()) >= 2, "no two steps"
        assert processes_naming(out), "the devnet's node processes were not found"
        proc.send_signal(signal.SIGINT)  # what Ctrl+C sends
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = log.read_text(errors="replace")
    assert rc == 130, output[-3000:]
    assert "Traceback" not in output
    assert not processes_naming(out), "node processes outlived the devnet"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) >= 2 and all("reward_mean" in r and "step" in r for r in rows)
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads(output.strip().splitlines()[-1])
    assert summary["interrupted"] is True and summary["steps"] >= 2
    assert all(code == 0 for code in summary["exit_codes"].values()), summary["exit_codes"]
