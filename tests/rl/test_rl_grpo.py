"""GRPO loss, clipping, advantages, accumulation, staleness and metrics."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from harness.rl import char_llama, fake_groups
from node.rl.filters import filter_zero_advantage, group_advantages
from node.rl.grpo import GRPOConfig, GRPOTrainer, Rollout, grpo_token_loss
from node.rl.metrics import StepMetrics

torch.set_num_threads(1)


def test_advantages_hand_computed():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    # mean 0.5, population std 0.5
    assert adv == pytest.approx(
        [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)] * 1 + [-0.5 / (0.5 + 1e-6), 0.5 / (0.5 + 1e-6)]
    )
    adv = group_advantages([3.0, 1.0, 2.0])
    std = math.sqrt(2 / 3)
    assert adv == pytest.approx([1 / (std + 1e-6), -1 / (std + 1e-6), 0.0])


def test_all_equal_group_has_zero_advantages_and_is_filtered():
    adv = group_advantages([0.7] * 8)
    assert adv == [0.0] * 8
    kept, kept_adv, dropped = filter_zero_advantage(["a", "b", "c"], [[0.0, 0.0], [1.0, -1.0], [0.0] * 3])
    assert kept == ["b"] and kept_adv == [[1.0, -1.0]] and dropped == 2


def test_token_loss_hand_computed_and_two_sided_clipping():
    # (ratio, advantage) -> expected loss, clipped?
    cases = [
        (1.0, 1.0, -1.0, False),  # on-policy
        (1.5, 1.0, -1.2, True),  # A>0, ratio above 1+eps: clipped at 1.2
        (0.5, 1.0, -0.5, False),  # A>0, ratio below 1-eps: unclipped (pessimistic branch)
        (1.5, -1.0, 1.5, False),  # A<0, ratio above 1+eps: unclipped ...
        (10.0, -1.0, 4.0, True),  # ... but capped at delta = 4 (the second side)
        (0.5, -1.0, 0.8, True),  # A<0, ratio below 1-eps: clipped at 0.8
        (2.0, 0.5, -0.6, True),  # A>0 scaled
    ]
    ratios = torch.tensor([c[0] for c in cases], dtype=torch.float64)
    adv = torch.tensor([c[1] for c in cases], dtype=torch.float64)
    old = torch.zeros_like(ratios)
    new = torch.log(ratios).requires_grad_(True)
    loss, clipped = grpo_token_loss(new, old, adv, clip_eps=0.2, delta=4.0)
    assert loss.tolist() == pytest.approx([c[2] for c in cases])
    assert clipped.tolist() == [c[3] for c in cases]
    loss.sum().backward()
    # d/dlogp of -r*A is -r*A where the unclipped branch is active; 0 where clipped
    expected_grad = [(-r * a if not cl else 0.0) for r, a, _, cl in cases]
    assert new.grad.tolist() == pytest.approx(expected_grad)


def test_step_loss_equals_hand_computed_value():
    model = char_llama(seed=1)
    cfg = GRPOConfig(lr=1e-3, warmup_steps=0, entropy_coef=0.0, max_tokens=10, temperature=1.0, micro_batch_size=1)
    tr = GRPOTrainer(model, cfg)
    group = [Rollout([1, 5, 6], [7, 8, 9], 1.0), Rollout([1, 5, 6], [7, 8, 9, 10, 11], 0.0)]
    m = tr.step([group])
    a = 0.5 / (0.5 + 1e-6)
    # ratio is exactly 1 on the first (only) mini-batch: loss = sum(-A) over tokens / (2 rollouts * 10)
    assert m.loss == pytest.approx((-a * 3 + a * 5) / 20, rel=1e-5)
    assert m.trained_tokens == 8 and m.clip_fraction == 0.0
    assert m.num_rollouts == 2 and m.filtered_groups == 0 and not m.skipped
    assert tr.version == 1


def test_entropy_bonus_and_kl_terms_are_reported():
    model = char_llama(seed=2)
    cfg = GRPOConfig(lr=1e-3, warmup_steps=0, entropy_coef=0.01, kl_coef=0.1, max_tokens=8, temperature=1.0)
    tr = GRPOTrainer(model, cfg)
    m1 = tr.step(fake_groups(0, version=0))
    assert m1.entropy > 0 and m1.kl == pytest.approx(0.0, abs=1e-6)  # reference == policy at step 0
    m2 = tr.step(fake_groups(1, version=1))
    assert m2.kl > 0


def test_micro_batching_does_not_change_the_update():
    params = []
    for mbs in (1, 3, 64):
        model = char_llama(seed=3)
        cfg = GRPOConfig(lr=1.0, warmup_steps=0, max_grad_norm=1e9, max_tokens=8, temperature=0.7, micro_batch_size=mbs)
        tr = GRPOTrainer(model, cfg)
        # plain SGD makes the update proportional to the accumulated gradient (Adam's first
        # step is ~lr * sign(g) and would amplify float noise on near-zero gradients)
        tr.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        tr.step(fake_groups(0, version=0))
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(params[0], params[1], atol=1e-6)
    assert torch.allclose(params[0], params[2], atol=1e-6)


def test_mini_batches_clip_and_metrics():
    model = char_llama(seed=4)
    cfg = GRPOConfig(lr=5e-2, warmup_steps=0, max_grad_norm=100.0, max_tokens=8, temperature=1.0, mini_batches=4)
    tr = GRPOTrainer(model, cfg)
    m = tr.step(fake_groups(0, n_groups=4, version=0))
    assert m.clip_fraction > 0  # later mini-batches see ratios away from 1 after a large step
    assert m.grad_norm > 0 and m.tokens_per_s > 0 and sum(m.reward_hist) == m.num_rollouts
    assert tr._opt_steps == 4 and tr.version == 1


def test_warmup_schedule():
    tr = GRPOTrainer(char_llama(), GRPOConfig(lr=1.0, warmup_steps=4))
    assert [tr.lr_at(k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert tr.optimizer.param_groups[0]["lr"] == 0.25


def test_staleness_bound_and_zero_advantage_filter_are_counted():
    tr = GRPOTrainer(char_llama(), GRPOConfig(lr=1e-3, warmup_steps=0, max_async=2, max_tokens=8))
    tr.version = 5
    v3 = {k: v.clone() for k, v in tr.model.state_dict().items()}  # the weights that "generated" version 3
    groups = fake_groups(0, n_groups=3, version=3)  # 2 behind: admitted
    groups += fake_groups(1, n_groups=2, version=2)  # 3 behind: stale
    groups += [[Rollout([1, 4], [5, 6], 0.5, policy_version=5)] * 4]  # all-equal rewards
    groups += fake_groups(2, n_groups=1, version=4)  # admitted, but nobody has version 4's weights
    m = tr.step(groups, behaviour=lambda v: v3 if v == 3 else None)
    assert m.stale_groups == 2 and m.filtered_groups == 1 and m.num_rollouts == 3 * 4 + 4 + 4
    assert m.missing_policy_groups == 1 and m.by_staleness["2"]["rollouts"] == 3 * 4 and "1" not in m.by_staleness
    # reward per generating version counts the admitted rollouts (stale groups left out) under their own version
    assert {v: b["rollouts"] for v, b in m.by_version.items()} == {"3": 12, "4": 4, "5": 4}
    assert m.by_version["5"]["reward_mean"] == 0.5
    assert tr.version == 6
    only_flat = tr.step([[Rollout([1, 4], [5, 6], 1.0, policy_version=6)] * 4])
    assert only_flat.skipped and only_flat.filtered_groups == 1 and tr.version == 6


def test_config_documents_intellect2_defaults():
    c = GRPOConfig()
    assert (c.lr, c.weight_decay, c.betas, c.warmup_steps, c.max_grad_norm) == (3e-7, 0.01, (0.9, 0.99), 25, 0.1)
    assert (c.clip_eps, c.delta, c.entropy_coef, c.kl_coef, c.temperature, c.max_async) == (
        0.2,
        4.0,
        0.001,
        0.0,
        0.6,
        2,
    )
    assert GRPOConfig.from_dict(c.to_dict()) == c


def doc_table(section: str) -> dict[str, list[str]]:
    """Rows of the first table under ``## section`` in docs/rl.md whose first cell is a `name`: name -> cells."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "rl.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_every_knob_is_documented_with_its_default_and_intellect2_value():
    rows = doc_table("GRPO")
    fields = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    assert rows.keys() == fields.keys()
    for name, default in fields.items():
        doc_default, intellect2 = rows[name][0], rows[name][1]
        assert ast.literal_eval(doc_default) == default, name
        assert intellect2, name


def test_every_step_metric_is_documented():
    rows = doc_table("Metrics")
    assert rows.keys() == {f.name for f in dataclasses.fields(StepMetrics)}
    assert all(cells and cells[0] for cells in rows.values())


class _LoopAdamWTrainer(GRPOTrainer):
    """The trainer with torch's per-parameter AdamW loop (the CPU default before fused)."""

    def _fused_adamw(self) -> bool:
        return False


def test_fused_adamw_makes_the_loops_update_and_resumes_from_a_loop_checkpoint(tmp_path):
    cfg = GRPOConfig(lr=1e-2, warmup_steps=0, max_grad_norm=0.5, max_tokens=8, temperature=1.0, micro_batch_size=4)
    params, trainers = {}, {}
    for name, cls in (("fused", GRPOTrainer), ("loop", _LoopAdamWTrainer)):
        tr = cls(char_llama(seed=6), cfg)
        start = torch.cat([p.detach().flatten() for p in tr.model.parameters()])
        for step in range(3):
            tr.step(fake_groups(step, version=tr.version))
        params[name] = torch.cat([p.detach().flatten() for p in tr.model.parameters()])
        assert (params[name] - start).abs().max() > 1e-2  # the steps moved the weights
        trainers[name] = tr
    assert trainers["fused"].optimizer.defaults["fused"] is True
    assert not trainers["loop"].optimizer.defaults["fused"]
    torch.testing.assert_close(params["fused"], params["loop"], rtol=1e-5, atol=1e-6)

    # a checkpoint written by the loop resumes fused, and the next update is still the loop's
    trainers["loop"].save_checkpoint(tmp_path / "ck")
    resumed = GRPOTrainer.from_checkpoint(tmp_path / "ck")
    assert all(g["fused"] for g in resumed.optimizer.param_groups)
    for tr in (resumed, trainers["loop"]):
        tr.step(fake_groups(3, version=tr.version))
    torch.testing.assert_close(
        torch.cat([p.detach().flatten() for p in resumed.model.parameters()]),
        torch.cat([p.detach().flatten() for p in trainers["loop"].model.parameters()]),
        rtol=1e-5,
        atol=1e-6,
    )
