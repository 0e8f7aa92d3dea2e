"""Megatron-style mixed precision (node/rl/precision.py): bf16 parameters and gradients, fp32
master weights and AdamW moments, the update clipped in fp32 and applied slice by slice."""

from __future__ import annotations

import itertools

import pytest
import torch

from harness.rl import char_llama, fake_groups
from node.errors import CheckpointError
from node.rl.grpo import GRPOConfig, GRPOTrainer, Rollout
from node.rl.precision import MasterAdamW

torch.set_num_threads(1)

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
SHAPES = [(37, 11), (5000,), (3, 4, 5), (1,)]  # with slices of 1,000 elements: 1, 5, 1 and 1 slices


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in SHAPES]


def _bf16_grads(seed: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    return [(torch.randn(s, generator=gen) * (1 + i)).to(torch.bfloat16) for i, s in enumerate(SHAPES)]


def _run(
    max_norm: float, steps: int = 3, slice_elems: int = 1000
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float], list[float]]:
    """MasterAdamW on bf16 parameters next to torch's fp32 AdamW on fp32 copies fed the same
    gradients upcast and clipped by ``clip_grad_norm_``: masters, references, both norms."""
    ref = [torch.nn.Parameter(p.detach().clone()) for p in _params(0)]
    ref_opt = torch.optim.AdamW(ref, **HYPER, fused=True)
    ours = _params(0)
    opt = MasterAdamW(ours, dtype=torch.bfloat16, slice_elems=slice_elems, **HYPER)
    norms, ref_norms = [], []
    for step in range(steps):
        grads = _bf16_grads(0, step)
        for p, r, g in zip(ours, ref, grads):
            p.grad, r.grad = g.clone(), g.float()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref, max_norm)))
        ref_opt.step()
        norms.append(float(opt.step(max_norm)))
        for p, m in zip(ours, opt.master):
            assert p.dtype is torch.bfloat16 and torch.equal(p.detach(), m.to(torch.bfloat16))
    return opt.master, [r.detach() for r in ref], norms, ref_norms


def test_the_sliced_update_is_fp32_adamw_on_the_upcast_gradients_clip_inactive():
    masters, ref, norms, ref_norms = _run(max_norm=1e9)
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    # the clip coefficient is exactly 1 both ways and AdamW is element-wise: bit for bit
    assert all(torch.equal(m, r) for m, r in zip(masters, ref))


def test_the_sliced_update_is_fp32_adamw_on_the_upcast_gradients_clip_active():
    masters, ref, norms, ref_norms = _run(max_norm=0.5)
    assert min(ref_norms) > 5  # the clip acts on every step
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    for m, r in zip(masters, ref):
        torch.testing.assert_close(m, r, rtol=1e-6, atol=1e-7)
    # control: the same comparison tells an unclipped update apart
    unclipped, _, _, _ = _run(max_norm=1e9)
    assert any(not torch.allclose(u, r, rtol=1e-6, atol=1e-7) for u, r in zip(unclipped, ref))


def test_the_slice_size_does_not_change_the_update():
    """AdamW is element-wise, so one slice per parameter and slices of 64 elements compute the
    same numbers, bit for bit; slices of 7 (the kernel's scalar tail on most elements, not its
    vector path) and a clip coefficient from norms summed in another order, to fp32 rounding."""
    whole, _, _, _ = _run(max_norm=1e9, slice_elems=1 << 22)
    sliced, _, _, _ = _run(max_norm=1e9, slice_elems=64)
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced))
    whole, _, _, _ = _run(max_norm=0.5, slice_elems=1 << 22)
    for size in (64, 7):
        sliced, _, _, _ = _run(max_norm=0.5, slice_elems=size)
        for a, b in zip(whole, sliced):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


CFG = dict(
    lr=1e-2,
    warmup_steps=3,
    weight_decay=0.01,
    max_grad_norm=0.5,
    max_tokens=8,
    temperature=0.8,
    micro_batch_size=5,
    compute_dtype="bfloat16",
)


def _state(tr: GRPOTrainer) -> list[torch.Tensor]:
    opt = tr.optimizer
    return [*(p.detach() for p in tr.model.parameters()), *opt.master, *opt.exp_avg, *opt.exp_avg_sq, *opt.steps]


def test_a_checkpoint_resumes_bit_identically_from_its_fp32_masters(tmp_path):
    straight = GRPOTrainer(char_llama(seed=7), GRPOConfig(**CFG))
    for s in range(2):
        straight.step(fake_groups(s, version=s))
    straight.save_checkpoint(tmp_path / "ck")
    resumed = GRPOTrainer.from_checkpoint(tmp_path / "ck")
    assert resumed.master_weights and resumed.version == 2
    assert all(torch.equal(a, b) for a, b in zip(_state(resumed), _state(straight)))
    for s in (2, 3):
        a, b = straight.step(fake_groups(s, version=s)), resumed.step(fake_groups(s, version=s))
        assert a.loss == b.loss and a.grad_norm == b.grad_norm
    assert all(torch.equal(a, b) for a, b in zip(_state(resumed), _state(straight)))

    # control: the model files alone (bf16, the published weights) are not the state: masters
    # rebuilt from them lose what rounding hid, and the next steps differ
    from transformers import AutoModelForCausalLM

    files_only = GRPOTrainer(
        AutoModelForCausalLM.from_pretrained(tmp_path / "ck", dtype=torch.float32), GRPOConfig(**CFG)
    )
    assert any(not torch.equal(a, b) for a, b in zip(files_only.optimizer.master, resumed.optimizer.master))


def test_an_autocast_checkpoint_resumes_with_fp32_masters_and_a_master_checkpoint_refuses_autocast(tmp_path):
    """A checkpoint of the trainer before (fp32 parameters under autocast) holds fp32 weights
    and torch's AdamW moments: exactly the masters and moments, so it resumes. The other way
    the model files hold only the rounded parameters: refused, saying why."""
    old = GRPOTrainer(char_llama(seed=8), GRPOConfig(**CFG, param_dtype="float32"))
    old.step(fake_groups(0, version=0))
    old.save_checkpoint(tmp_path / "autocast")
    new = GRPOTrainer.from_checkpoint(tmp_path / "autocast", config=GRPOConfig(**CFG))
    assert new.master_weights and new.version == 1
    for p, m in zip(old.model.parameters(), new.optimizer.master):
        assert torch.equal(p.detach(), m)
    for i, p in enumerate(old.model.parameters()):
        st = old.optimizer.state[p]
        assert torch.equal(st["exp_avg"], new.optimizer.exp_avg[i])
        assert torch.equal(st["exp_avg_sq"], new.optimizer.exp_avg_sq[i])
        assert float(st["step"]) == float(new.optimizer.steps[i])
    assert not new.step(fake_groups(1, version=1)).skipped

    new.save_checkpoint(tmp_path / "master")
    with pytest.raises(CheckpointError, match="fp32 master weights"):
        GRPOTrainer.from_checkpoint(tmp_path / "master", config=GRPOConfig(**CFG, param_dtype="float32"))
    # control: the same folder resumes in the mode that wrote it
    assert GRPOTrainer.from_checkpoint(tmp_path / "master").version == 2


def _margin(tr: GRPOTrainer, good: Rollout, bad: Rollout) -> float:
    now = [Rollout(r.prompt_tokens, r.completion_tokens, r.reward, policy_version=tr.version) for r in (good, bad)]
    lp = tr.old_logprobs(now)
    return float(lp[0].sum() - lp[1].sum())


def test_grpo_learns_in_bf16_with_fp32_masters_beside_fp32():
    """A rewarded completion gains log-probability over an unrewarded one, step after step, as
    in fp32 (control). (GRPO's loss is no measure here: on-policy its value is -sum(A) / norm
    whatever the weights.)"""
    prompt = [1, 5, 6, 7]
    good, bad = Rollout(prompt, [20, 21, 22, 23], 1.0), Rollout(prompt, [40, 41, 42, 43], 0.0)
    gains = {}
    for dtype in ("float32", "bfloat16"):
        cfg = GRPOConfig(lr=3e-3, warmup_steps=0, max_grad_norm=1.0, max_tokens=8, temperature=1.0, compute_dtype=dtype)
        tr = GRPOTrainer(char_llama(seed=9), cfg)
        margins = [_margin(tr, good, bad)]
        for v in range(8):
            group = [Rollout(r.prompt_tokens, r.completion_tokens, r.reward, policy_version=v) for r in (good, bad)]
            tr.step([group])
            margins.append(_margin(tr, good, bad))
        assert all(b > a for a, b in itertools.pairwise(margins)), (dtype, margins)
        gains[dtype] = margins[-1] - margins[0]
    assert gains["float32"] > 5
    assert gains["bfloat16"] > 0.8 * gains["float32"], gains


def test_updates_below_bf16_resolution_accumulate_in_the_masters():
    """Why the masters: an AdamW step of lr 1e-5 on weights of ~0.02 is below half a bf16 ulp
    (~6e-5). AdamW on the bf16 parameters themselves (control) rounds every step away; the fp32
    masters keep them, and after enough steps the bf16 parameters move."""
    params = [torch.nn.Parameter(torch.full((1000,), 0.02))]
    opt = MasterAdamW(params, dtype=torch.bfloat16, lr=1e-5, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    plain = [torch.nn.Parameter(torch.full((1000,), 0.02, dtype=torch.bfloat16))]
    plain_opt = torch.optim.AdamW(plain, lr=1e-5, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    start = params[0].detach().clone()
    for _ in range(20):
        params[0].grad = torch.ones(1000, dtype=torch.bfloat16)
        plain[0].grad = torch.ones(1000, dtype=torch.bfloat16)
        opt.step(None)
        plain_opt.step()
    assert torch.equal(plain[0].detach(), start)  # every update rounded away
    assert float(opt.master[0][0]) == pytest.approx(0.02 - 20e-5, rel=1e-3)
    assert bool((params[0].detach() < start).all())


def test_a_loaded_models_fp32_tensors_become_the_masters_and_no_other_fp32_copy_is_kept(tmp_path):
    # from_pretrained maps the safetensors file and the parameters are views of it; building the
    # bf16 trainer turns each into its master (no copy) and gives the model a bf16 copy: the
    # optimizer's masters and moments and the bf16 parameters are all the process holds (the
    # memory after building a SmolLM2 trainer is that state + ~15 MiB, docs/benchmarks.md)
    from transformers import AutoModelForCausalLM

    char_llama(seed=2).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    loaded = [(p.data_ptr(), p.numel()) for p in model.parameters()]
    cfg = GRPOConfig(lr=1e-3, warmup_steps=0, max_tokens=16, compute_dtype="bfloat16")
    trainer = GRPOTrainer(model, cfg)
    opt = trainer.optimizer
    assert isinstance(opt, MasterAdamW)
    assert [(m.data_ptr(), m.numel()) for m in opt.master] == loaded
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    fp32 = [t for t in trainer.model.state_dict().values() if t.dtype == torch.float32]
    assert sum(t.numel() for t in fp32) < 1000  # buffers (rotary frequencies) only
    # the honest control: a step runs and moves the masters, which stay the loaded storage
    before = [m.clone() for m in opt.master]
    assert not trainer.step(fake_groups(0, n_groups=2, group_size=4)).skipped
    assert [(m.data_ptr(), m.numel()) for m in opt.master] == loaded
    assert any(not torch.equal(a, b) for a, b in zip(before, opt.master))
