"""Checkpoints: safetensors loadable by from_pretrained; save, kill -9, resume == uninterrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from node.rl.grpo import GRPOConfig, GRPOTrainer
from tests.rl_support import fake_groups, tiny_llama

ROOT = Path(__file__).resolve().parent.parent
CFG = dict(lr=1e-2, warmup_steps=3, weight_decay=0.01, max_grad_norm=0.5, max_tokens=8, temperature=0.8,
           entropy_coef=0.01, mini_batches=2, micro_batch_size=5)
TOTAL, SAVED_AT = 5, 2


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_save_kill_resume_equals_uninterrupted(tmp_path):
    torch.set_num_threads(1)
    ckpt = tmp_path / "ckpt"
    # a separate process trains SAVED_AT steps, checkpoints, then is SIGKILLed in the middle of the next step
    script = textwrap.dedent(f"""
        import os, signal, torch
        torch.set_num_threads(1)
        from node.rl.grpo import GRPOConfig, GRPOTrainer
        from tests.rl_support import fake_groups, tiny_llama
        tr = GRPOTrainer(tiny_llama(seed=7), GRPOConfig(**{CFG!r}))
        for s in range({SAVED_AT}):
            tr.step(fake_groups(s))
        tr.save_checkpoint({str(ckpt)!r})
        opt_step = tr.optimizer.step
        def die(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        tr.optimizer.step = die
        tr.step(fake_groups({SAVED_AT}))
        print("not killed")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (ckpt / "model.safetensors").exists() and not (ckpt.parent / "ckpt.tmp").exists()

    resumed = GRPOTrainer.from_checkpoint(ckpt)
    assert resumed.version == SAVED_AT and resumed.config == GRPOConfig(**CFG)
    for s in range(SAVED_AT, TOTAL):
        resumed.step(fake_groups(s))

    straight = GRPOTrainer(tiny_llama(seed=7), GRPOConfig(**CFG))
    for s in range(TOTAL):
        straight.step(fake_groups(s))

    a, b = params(resumed.model), params(straight.model)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa, sb = resumed.optimizer.state_dict()["state"], straight.optimizer.state_dict()["state"]
    for k in sa:
        assert torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"])
    assert resumed.version == straight.version == TOTAL


def test_checkpoint_loads_with_transformers_and_overwrites_atomically(tmp_path):
    from transformers import AutoModelForCausalLM

    tr = GRPOTrainer(tiny_llama(seed=8), GRPOConfig(lr=1e-2, warmup_steps=0, max_tokens=8, kl_coef=0.1))
    tr.step(fake_groups(0))
    tr.save_checkpoint(tmp_path / "c")
    tr.step(fake_groups(1))
    tr.save_checkpoint(tmp_path / "c")  # replaces the older version
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    for k, v in model.state_dict().items():
        assert torch.equal(v, tr.model.state_dict()[k])
    back = GRPOTrainer.from_checkpoint(tmp_path / "c")
    assert back.version == 2 and back.reference_model is not None
    for k, v in back.reference_model.state_dict().items():
        assert torch.equal(v, tr.reference_model.state_dict()[k])
