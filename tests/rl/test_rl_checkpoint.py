"""Checkpoints: safetensors loadable by from_pretrained; save, kill -9, resume == uninterrupted."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch

from harness.rl import char_llama, fake_groups
from node.rl.grpo import GRPOConfig, GRPOTrainer

ROOT = Path(__file__).resolve().parents[2]
# warm-up of 6 optimizer steps with 2 mini-batches per step: the checkpoint (after 2 steps = 4 optimizer
# steps) is taken in the middle of the warm-up, so the resumed run must continue the schedule exactly
CFG = dict(
    lr=1e-2,
    warmup_steps=6,
    weight_decay=0.01,
    max_grad_norm=0.5,
    max_tokens=8,
    temperature=0.8,
    entropy_coef=0.01,
    mini_batches=2,
    micro_batch_size=5,
)
TOTAL, SAVED_AT = 5, 2
PY_SEED = 1234  # Python's RNG is seeded from the OS at start-up: seed it so both processes agree


def snapshot(tr: GRPOTrainer) -> dict[str, Any]:
    """Everything a resumed run must reproduce: parameters (and their grads), every AdamW state tensor keyed
    by parameter name, the param groups (lr of the warm-up schedule, betas, eps, weight decay), the trainer's
    counters and the global RNG states the checkpoint carries."""
    names = [n for n, _ in tr.model.named_parameters()]
    sd = tr.optimizer.state_dict()
    return {
        "params": {k: v.detach().clone() for k, v in tr.model.state_dict().items()},
        "grads": {n: p.grad for n, p in tr.model.named_parameters()},
        "opt_state": {names[i]: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()},
        "param_groups": sd["param_groups"],
        "version": tr.version,
        "opt_steps": tr._opt_steps,
        "next_lr": tr.lr_at(tr._opt_steps),
        "rng_torch": torch.get_rng_state(),
        "rng_python": random.getstate(),
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert a["params"][k].dtype == b["params"][k].dtype and torch.equal(a["params"][k], b["params"][k]), k
    assert all(g is None for g in a["grads"].values()) and a["grads"].keys() == b["grads"].keys()
    assert a["opt_state"].keys() == b["opt_state"].keys() == a["grads"].keys()  # every parameter has AdamW state
    for name, st in a["opt_state"].items():
        assert st.keys() == b["opt_state"][name].keys() == {"step", "exp_avg", "exp_avg_sq"}, name
        for k in st:
            assert torch.equal(st[k], b["opt_state"][name][k]), (name, k)
    assert a["param_groups"] == b["param_groups"]
    for k in ("version", "opt_steps", "next_lr", "rng_python"):
        assert a[k] == b[k], k
    assert torch.equal(a["rng_torch"], b["rng_torch"])


def test_save_kill_resume_equals_uninterrupted(tmp_path):
    torch.set_num_threads(1)
    ckpt = tmp_path / "ckpt"
    # a separate process trains SAVED_AT steps, checkpoints, then is SIGKILLed in the middle of the next step
    # (after its backward pass, at its first optimizer step)
    script = textwrap.dedent(f"""
        import os, random, signal, torch
        torch.set_num_threads(1)
        from node.rl.grpo import GRPOConfig, GRPOTrainer
        from harness.rl import fake_groups, char_llama
        tr = GRPOTrainer(char_llama(seed=7), GRPOConfig(**{CFG!r}))
        random.seed({PY_SEED})
        for s in range({SAVED_AT}):
            tr.step(fake_groups(s))
        tr.save_checkpoint({str(ckpt)!r})
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
    assert resumed.config == GRPOConfig(**CFG)
    resumed_at_save = snapshot(resumed)
    for s in range(SAVED_AT, TOTAL):
        resumed.step(fake_groups(s))
    resumed_end = snapshot(resumed)

    straight = GRPOTrainer(char_llama(seed=7), GRPOConfig(**CFG))
    random.seed(PY_SEED)
    for s in range(SAVED_AT):
        straight.step(fake_groups(s))
    straight_at_save = snapshot(straight)
    for s in range(SAVED_AT, TOTAL):
        straight.step(fake_groups(s))
    straight_end = snapshot(straight)

    # the checkpoint is mid-warm-up and the run ends past it: the schedule is part of what must resume
    assert straight_at_save["next_lr"] < CFG["lr"] == straight_end["next_lr"]
    assert straight_at_save["opt_steps"] == 2 * SAVED_AT and straight_end["opt_steps"] == 2 * TOTAL
    assert resumed_at_save["version"] == SAVED_AT and resumed_end["version"] == TOTAL
    assert_same(resumed_at_save, straight_at_save)  # the checkpoint holds the whole state
    assert_same(resumed_end, straight_end)  # and training from it continues bit for bit
    # the comparison is not vacuous: training moved the parameters and the moments after the checkpoint
    assert not torch.equal(straight_at_save["params"]["lm_head.weight"], straight_end["params"]["lm_head.weight"])
    assert not torch.equal(
        straight_at_save["opt_state"]["lm_head.weight"]["exp_avg"],
        straight_end["opt_state"]["lm_head.weight"]["exp_avg"],
    )


def test_checkpoint_loads_with_transformers_and_overwrites_atomically(tmp_path):
    from transformers import AutoModelForCausalLM

    tr = GRPOTrainer(char_llama(seed=8), GRPOConfig(lr=1e-2, warmup_steps=0, max_tokens=8, kl_coef=0.1))
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
