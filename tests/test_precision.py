"""Precision: the genesis names the policy dtype; published weights are in it; the trainer
computes in it (autocast) while its master weights and AdamW state stay fp32."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from node.errors import ConfigError
from node.rl.grpo import GRPOConfig, GRPOTrainer
from node.roles.common import export_weights
from node.roles.context import policy_dtype_for
from tests.support.rl import char_llama, fake_groups
from tests.support.roles import tiny_context

CFG = dict(lr=1e-2, warmup_steps=0, max_tokens=8, temperature=1.0, micro_batch_size=4)


def test_the_genesis_names_the_policy_dtype(tmp_path):
    assert policy_dtype_for({}) == "float32"  # geneses without the key keep their meaning
    assert policy_dtype_for({"policy_dtype": "bfloat16", "numerics": "transformers-bf16-cpu"}) == "bfloat16"
    assert policy_dtype_for({"numerics": "transformers-fp32-cpu"}) == "float32"
    with pytest.raises(ConfigError, match="policy_dtype must be one of"):
        policy_dtype_for({"policy_dtype": "float16"})
    # a numerics stack names the dtype its engines compute in (CPU workers may run bf16 weights in fp32)
    assert policy_dtype_for({"policy_dtype": "bfloat16", "numerics": "transformers-fp32-cpu"}) == "bfloat16"
    with pytest.raises(ConfigError, match="must name its compute dtype"):
        policy_dtype_for({"numerics": "transformers-cpu"})
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


def test_bf16_compute_keeps_fp32_master_weights_and_optimizer_state():
    torch.manual_seed(0)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        tr = GRPOTrainer(char_llama(seed=5), GRPOConfig(**CFG, compute_dtype=dtype))
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


def test_under_mixed_precision_the_current_versions_old_log_probs_come_from_the_published_weights():
    """Autocast computes other numbers than the workers' forward: the training forward's own
    log-probs are then no stand-in for the behaviour policy's (control: fp32 takes the shortcut)."""
    for dtype, shortcut in (("float32", True), ("bfloat16", False)):
        trainer = GRPOTrainer(char_llama(seed=5), GRPOConfig(**CFG, compute_dtype=dtype))
        assert trainer.live_is_published is shortcut
        reads: list[int] = []

        def published(
            version: int, trainer: GRPOTrainer = trainer, reads: list[int] = reads
        ) -> dict[str, torch.Tensor]:
            reads.append(version)
            return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

        trainer.step(fake_groups(0, version=0), behaviour=published)
        assert reads == ([] if shortcut else [0]), dtype
