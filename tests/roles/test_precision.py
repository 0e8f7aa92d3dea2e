"""Precision: the genesis names the policy dtype; published weights are in it; the trainer
computes in it. A bf16 run keeps bf16 parameters and fp32 master weights and AdamW moments in
the optimizer (node/rl/precision.py), or, with ``param_dtype = "float32"``, fp32 parameters
under autocast."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from harness.rl import char_llama, fake_groups
from harness.roles import tiny_context
from node.errors import ConfigError
from node.rl.grpo import GRPOConfig, GRPOTrainer
from node.roles.context import policy_dtype_for
from node.roles.weights import export_weights
from protocol import ProtocolError
from protocol.run_config import RunConfig

CFG = dict(lr=1e-2, warmup_steps=0, max_tokens=8, temperature=1.0, micro_batch_size=4)


def _policy_dtype(table) -> str:
    return policy_dtype_for(RunConfig.decode(table))


def test_the_genesis_names_the_policy_dtype(tmp_path):
    assert _policy_dtype({}) == "float32"  # geneses without the key keep their meaning
    assert _policy_dtype({"policy_dtype": "bfloat16", "numerics": "transformers-bf16-cpu"}) == "bfloat16"
    assert _policy_dtype({"numerics": "transformers-fp32-cpu"}) == "float32"
    with pytest.raises(ProtocolError, match="policy_dtype must be one of"):
        _policy_dtype({"policy_dtype": "float16"})
    # a numerics stack names the dtype its engines compute in (CPU workers may run bf16 weights in fp32)
    assert _policy_dtype({"policy_dtype": "bfloat16", "numerics": "transformers-fp32-cpu"}) == "bfloat16"
    with pytest.raises(ConfigError, match="must name its compute dtype"):
        _policy_dtype({"numerics": "transformers-cpu"})
    ctx = tiny_context(tmp_path / "bf16", policy_dtype="bfloat16")
    assert ctx.policy_dtype is torch.bfloat16 and ctx.grpo_config().compute_dtype == "bfloat16"
    assert tiny_context(tmp_path / "default").policy_dtype is torch.float32
    with pytest.raises(ConfigError):  # refused when the node joins, not at the first step
        tiny_context(tmp_path / "bad", policy_dtype="half")


def test_published_weights_are_in_the_policy_dtype(tmp_path):
    model = char_llama(seed=3)
    export_weights(model, tmp_path / "bf16", torch.bfloat16)
    export_weights(model, tmp_path / "fp32", torch.float32)
    own = model.state_dict()
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        state = load_file(tmp_path / name / "model.safetensors")
        assert {v.dtype for v in state.values()} == {dtype}, name
        for k, v in state.items():
            assert torch.equal(v, own[k].to(dtype)), (name, k)
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"  # the config names what the files hold
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the trainer's copy is untouched


def test_bf16_compute_under_autocast_keeps_fp32_parameters_and_optimizer_state():
    """``param_dtype = "float32"``: the trainer's way before node/rl/precision.py (autocast)."""
    torch.manual_seed(0)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        tr = GRPOTrainer(char_llama(seed=5), GRPOConfig(**CFG, compute_dtype=dtype, param_dtype="float32"))
        assert not tr.master_weights
        before = {k: v.clone() for k, v in tr.model.state_dict().items()}
        rollouts = [r for g in fake_groups(0) for r in g]
        lp = tr.old_logprobs(rollouts)
        for s in range(2):
            assert not tr.step(fake_groups(s, version=s)).skipped
        assert all(p.dtype == torch.float32 for p in tr.model.parameters())
        for st in tr.optimizer.state.values():
            assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
        assert any(not torch.equal(before[k], v) for k, v in tr.model.state_dict().items())  # it learned
        runs[dtype] = (lp, tr.model.state_dict())
    # autocast really computes in bf16: log-probs differ from fp32 by bf16 rounding, not more
    diffs = [float((a - b).abs().max()) for a, b in zip(runs["float32"][0], runs["bfloat16"][0])]
    assert max(diffs) > 0, "bf16 compute gave fp32's exact numbers: autocast did not act"
    assert max(diffs) < 0.2, diffs


def test_a_bf16_run_keeps_bf16_parameters_and_fp32_master_weights_in_the_optimizer():
    """The default for a bf16 run: the parameters (what is published) are bf16, each one its
    fp32 master rounded; the optimizer holds the masters and both moments in fp32. Control: an
    fp32 run is untouched (fp32 parameters, torch's AdamW)."""
    fp32 = GRPOTrainer(char_llama(seed=5), GRPOConfig(**CFG))
    assert not fp32.master_weights and isinstance(fp32.optimizer, torch.optim.AdamW)
    tr = GRPOTrainer(char_llama(seed=5), GRPOConfig(**CFG, compute_dtype="bfloat16"))
    assert tr.master_weights and tr.param_dtype is torch.bfloat16
    initial = [p.detach().clone() for p in fp32.model.parameters()]
    assert all(torch.equal(m, w) for m, w in zip(tr.optimizer.master, initial))  # the fp32 init is the master
    for s in range(2):
        assert not tr.step(fake_groups(s, version=s)).skipped
        assert not fp32.step(fake_groups(s, version=s)).skipped
    assert {p.dtype for p in tr.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}
    opt = tr.optimizer
    assert {t.dtype for t in [*opt.master, *opt.exp_avg, *opt.exp_avg_sq]} == {torch.float32}
    for p, m in zip(tr.model.parameters(), opt.master):
        assert torch.equal(p.detach(), m.to(torch.bfloat16))
    assert any(not torch.equal(m, w) for m, w in zip(opt.master, initial))  # it learned


def test_the_current_versions_old_log_probs_come_from_the_published_weights_unless_they_are_the_live_ones():
    """Autocast computes other numbers than a forward over the published bf16 weights: the
    training forward's own log-probs are then no stand-in for the behaviour policy's. With bf16
    parameters the live weights are the published ones, as in fp32 (control)."""
    for dtype, param_dtype, shortcut in (
        ("float32", None, True),
        ("bfloat16", "float32", False),
        ("bfloat16", None, True),
    ):
        trainer = GRPOTrainer(char_llama(seed=5), GRPOConfig(**CFG, compute_dtype=dtype, param_dtype=param_dtype))
        assert trainer.live_is_published is shortcut
        reads: list[int] = []

        def published(
            version: int, trainer: GRPOTrainer = trainer, reads: list[int] = reads
        ) -> dict[str, torch.Tensor]:
            reads.append(version)
            return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

        rollouts = [r for g in fake_groups(0, version=0) for r in g]
        if shortcut:  # the shortcut's numbers are the published weights' numbers, bit for bit
            from_files = trainer.old_logprobs(rollouts, behaviour=published)
            live = trainer.old_logprobs(rollouts)
            assert all(torch.equal(a, b) for a, b in zip(from_files, live))
            reads.clear()
        trainer.step(fake_groups(0, version=0), behaviour=published)
        assert reads == ([] if shortcut else [0]), (dtype, param_dtype)
