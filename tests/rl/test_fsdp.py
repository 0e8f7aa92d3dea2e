"""The FSDP2 trainer (node.rl.distributed) gives one process's numbers, and its DCP
checkpoints move between group sizes.

Real process groups: torchrun (``torch.distributed.run``) launches ranks of
``harness/fsdp_child.py`` over gloo on this CPU; rank 0 writes each step's metrics and
full weights, and the test replays the same steps in one process with :class:`GRPOTrainer`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from harness.fsdp_child import config, step_groups, tiny
from node.ops.launch import torchrun_argv
from node.rl.grpo import GRPOTrainer

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]

# fp32 on both sides; the sums differ in order (per-rank slices, padding to each slice's
# longest row, the gradient reduction), so agreement is to rounding, not bits.
RTOL, ATOL = 1e-4, 1e-5


def torchrun(tmp: Path, nproc: int, **spec) -> tuple[list[str], dict[str, str], Path]:
    """The command, environment and output folder that run the child as ``nproc`` ranks."""
    out = tmp / f"out_{len(list(tmp.glob('out_*')))}"
    out.mkdir()
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps({**spec, "out": str(out), "published": str(tmp / "published")}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*cmd, "-m", "harness.fsdp_child", str(spec_file)], env, out


def launch(tmp: Path, nproc: int, **spec) -> Path:
    """Run the child as ``nproc`` ranks and wait for the group to finish; its output folder."""
    cmd, env, out = torchrun(tmp, nproc, **spec)
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def reference(seed: int, tied: bool, steps: int, device: str = "cpu") -> list[tuple[dict, dict[str, torch.Tensor]]]:
    """The same steps in one process: (metrics, weights) after each."""
    tr = GRPOTrainer(tiny(seed, tied), config(), keep_versions=2, device=device)
    out = []
    for _ in range(steps):
        m = tr.step(step_groups(tr.version + 1, tr.version))
        out.append((m.__dict__, {k: v.detach().cpu().clone() for k, v in tr.model.state_dict().items()}))
    return out


def assert_same(
    out: Path, version: int, ref: tuple[dict, dict[str, torch.Tensor]], rtol: float = RTOL, atol: float = ATOL
) -> None:
    metrics = json.loads((out / f"metrics_{version}.json").read_text())
    weights = torch.load(out / f"weights_{version}.pt")
    ref_m, ref_w = ref
    for key in ("num_rollouts", "stale_groups", "filtered_groups", "missing_policy_groups", "trained_tokens"):
        assert metrics[key] == ref_m[key], key
    for key in ("loss", "grad_norm", "entropy", "clip_fraction"):
        assert metrics[key] == pytest.approx(ref_m[key], rel=rtol, abs=atol), key
    assert set(weights) == set(ref_w)
    for k, w in ref_w.items():
        torch.testing.assert_close(weights[k], w, rtol=rtol, atol=atol, msg=k)


@pytest.mark.slow  # ~20 s on two quiet cores: the slow tier (README)
def test_two_ranks_take_the_single_process_steps_and_one_rank_resumes(tmp_path: Path) -> None:
    """2 ranks: two GRPO steps (the second with a stale group, whose old log-probs come from
    the published weights of the version before, broadcast by rank 0), a DCP checkpoint;
    then 1 rank resumes it (DCP reshards 2 -> 1) and takes the third step. Tied embeddings:
    the root unit holds the shared weight."""
    ref = reference(3, True, 3)
    ckpt = tmp_path / "checkpoint"
    out = launch(tmp_path, 2, seed=3, tied=True, steps=2, save=str(ckpt))
    for v in (1, 2):
        assert_same(out, v, ref[v - 1])
    assert json.loads((ckpt / "trainer_state.json").read_text())["world"] == 2
    out = launch(tmp_path, 1, resume=str(ckpt), steps=1)
    assert_same(out, 3, ref[2])
    # not vacuous: every version's weights differ from the last, and the stale group trained
    assert not torch.allclose(ref[0][1]["model.norm.weight"], ref[1][1]["model.norm.weight"])
    assert not torch.allclose(ref[1][1]["model.norm.weight"], ref[2][1]["model.norm.weight"])
    assert ref[1][0]["num_groups"] == 4 and ref[1][0]["missing_policy_groups"] == 0


@pytest.mark.slow  # ~20 s on two quiet cores: the slow tier (README)
def test_rank_group_drives_followers_as_the_trainer_role_does(tmp_path: Path) -> None:
    """RankGroup (rank 0, the network node's trainer) orders steps, exports and checkpoints;
    rank 1 runs ``follow``; the published weights equal one process's. Untied head."""
    ref = reference(4, False, 2)
    ckpt = tmp_path / "checkpoint"
    out = launch(tmp_path, 2, group=True, seed=4, tied=False, steps=2, save=str(ckpt))
    for v in (1, 2):
        assert_same(out, v, ref[v - 1])
    assert json.loads((ckpt / "trainer_state.json").read_text())["version"] == 2


def test_nproc_relaunches_join_under_torchrun_without_itself() -> None:
    argv = ["join", "--role", "trainer", "--nproc", "2", "--home", "h", "--nproc=3", "--device", "cuda"]
    cmd = torchrun_argv(argv, 2)
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in cmd and "--max-restarts=0" in cmd
    assert cmd[-8:] == ["-m", "node.ops.cli", "join", "--role", "trainer", "--home", "h", "--device", "cuda"][-8:]
    assert not any(a.startswith("--nproc=") or a == "--nproc" for a in cmd)


@pytest.mark.slow
def test_one_rank_checkpoint_resumes_on_two_untied(tmp_path: Path) -> None:
    """1 -> 2 ranks, untied head (its own weight in the root unit)."""
    ref = reference(4, False, 3)
    ckpt = tmp_path / "checkpoint"
    out = launch(tmp_path, 1, seed=4, tied=False, steps=2, save=str(ckpt))
    for v in (1, 2):
        assert_same(out, v, ref[v - 1])
    out = launch(tmp_path, 2, resume=str(ckpt), steps=1)
    assert_same(out, 3, ref[2])


@pytest.mark.slow  # ~25 s on two quiet cores: the slow tier (README)
def test_kill_9_of_one_rank_stops_the_group_and_it_resumes_from_the_last_checkpoint(tmp_path: Path) -> None:
    """A rank killed by SIGKILL mid-run: torchrun stops the other (no rank trains on alone),
    the checkpoint folder holds a whole committed version, and a new group resumes from it
    with the numbers one uninterrupted process has at that version."""
    ckpt = tmp_path / "checkpoint"
    cmd, env, out = torchrun(tmp_path, 2, seed=5, tied=True, steps=1000, save=str(ckpt))
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids: dict[int, int] = {}
    committed = 0
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # blocks on the group's own output: no polling
            lines.append(line)
            words = line.split()
            if words[:1] == ["committed"]:
                committed = int(words[1])
            if committed >= 2:
                break
        assert committed >= 2, "".join(lines[-40:])
        # every rank wrote its pid file before its first collective, so before rank 0 committed
        pids = {r: int((out / f"pid_{r}").read_text()) for r in (0, 1)}
        os.kill(pids[1], signal.SIGKILL)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, rest[-2000:]
    assert not alive(pids[0])
    version = json.loads((ckpt / "trainer_state.json").read_text())["version"]
    assert version >= 2  # at least what rank 0 had reported committed before the kill
    ref = reference(5, True, version + 1)
    out = launch(tmp_path, 2, resume=str(ckpt), steps=1)
    assert_same(out, version + 1, ref[version])


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
def test_nccl_on_gpus_takes_the_single_process_steps(tmp_path: Path) -> None:
    """``--device cuda``: the group runs on NCCL, one rank per GPU (two where there are two),
    and takes the single-process GPU steps (looser tolerance: GPU kernels reorder sums)."""
    ranks = min(2, torch.cuda.device_count())
    ref = reference(3, True, 2, device="cuda")
    out = launch(tmp_path, ranks, seed=3, tied=True, steps=2, device="cuda")
    assert (out / "backend.txt").read_text() == "nccl"
    for v in (1, 2):
        assert_same(out, v, ref[v - 1], rtol=1e-3, atol=1e-4)
