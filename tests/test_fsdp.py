"""The FSDP2 trainer (node.rl.distributed) gives one process's numbers, and its DCP
checkpoints move between group sizes.

Real process groups: torchrun (``torch.distributed.run``) launches ranks of
``tests/support/fsdp_child.py`` over gloo on this CPU; rank 0 writes each step's metrics and
full weights, and the test replays the same steps in one process with :class:`GRPOTrainer`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from node.rl.grpo import GRPOTrainer
from tests.support.fsdp_child import config, step_groups, tiny

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent

# fp32 on both sides; the sums differ in order (per-rank slices, padding to each slice's
# longest row, the gradient reduction), so agreement is to rounding, not bits.
RTOL, ATOL = 1e-4, 1e-5


def launch(tmp: Path, nproc: int, **spec) -> subprocess.CompletedProcess[str]:
    """Run the child as ``nproc`` ranks under torchrun and wait for the group to finish."""
    out = tmp / f"out_{nproc}_{len(list(tmp.iterdir()))}"
    out.mkdir()
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps({**spec, "out": str(out)}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    proc = subprocess.run(
        [*cmd, "-m", "tests.support.fsdp_child", str(spec_file)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc.out = out  # type: ignore[attr-defined]
    return proc


def reference(seed: int, tied: bool, steps: int) -> list[tuple[dict, dict[str, torch.Tensor]]]:
    """The same steps in one process: (metrics, weights) after each."""
    tr = GRPOTrainer(tiny(seed, tied), config(), keep_versions=2)
    out = []
    for _ in range(steps):
        m = tr.step(step_groups(tr.version + 1, tr.version))
        out.append((m.__dict__, {k: v.detach().clone() for k, v in tr.model.state_dict().items()}))
    return out


def assert_same(out: Path, version: int, ref: tuple[dict, dict[str, torch.Tensor]]) -> None:
    metrics = json.loads((out / f"metrics_{version}.json").read_text())
    weights = torch.load(out / f"weights_{version}.pt")
    ref_m, ref_w = ref
    for key in ("num_rollouts", "stale_groups", "filtered_groups", "missing_policy_groups", "trained_tokens"):
        assert metrics[key] == ref_m[key], key
    for key in ("loss", "grad_norm", "entropy", "clip_fraction"):
        assert metrics[key] == pytest.approx(ref_m[key], rel=RTOL, abs=ATOL), key
    assert set(weights) >= {k for k in ref_w if k != "lm_head.weight"}
    start = reference_start(ref_w)
    for k, w in ref_w.items():
        if k in weights:
            torch.testing.assert_close(weights[k], w, rtol=RTOL, atol=ATOL, msg=k)
    assert start  # the step moved the weights: equality above is not vacuous


def reference_start(ref_w: dict[str, torch.Tensor]) -> bool:
    return any(v.abs().sum() > 0 for v in ref_w.values())


@pytest.mark.parametrize("tied", [True, False])
def test_two_ranks_take_the_single_process_step(tmp_path: Path, tied: bool) -> None:
    """Two GRPO steps (the second with a stale group: old log-probs under other weights)."""
    ref = reference(3, tied, 2)
    run = launch(tmp_path, 2, seed=3, tied=tied, steps=2)
    for v in (1, 2):
        assert_same(run.out, v, ref[v - 1])  # type: ignore[attr-defined]
    # the weights moved between versions, so matching each is not matching the start
    assert not torch.allclose(ref[0][1]["model.norm.weight"], ref[1][1]["model.norm.weight"])
