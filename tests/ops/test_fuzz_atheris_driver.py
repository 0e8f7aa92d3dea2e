"""The coverage-guided fuzz driver (bench/fuzz_atheris.py) stays runnable: every target's seed
inputs (valid encodings of each decoder's input) go through the target once, without atheris
(not a CI dependency), and none of them is reported as a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGETS = {
    "envelope",
    "message",
    "signed_body",
    "manifest",
    "proof",
    "genesis",
    "reqresp_server",
    "reqresp_client",
    "gossip_frame",
    "dataplane_server",
    "dataplane_client",
}


def test_every_atheris_target_runs_its_seeds(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "fuzz_atheris.py"), "--seeds-only"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["seeds"]) == TARGETS and all(n >= 1 for n in result["seeds"].values()), result
