"""A single-process GRPO loop: generate -> reward -> filter -> step, with no network.

This is the learning machinery of a run with the swarm taken out: the reference
the distributed roles must match, the loop test's body, and a quick way to see
GRPO learn on a CPU (``python -m node.rl.demo``).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from node.engines.base import group_seeds
from node.rl.grpo import GRPOConfig, GRPOTrainer, Rollout
from node.rl.metrics import StepMetrics
from node.rl.rewards import compute_reward
from node.rl.tasks import CharTokenizer, Problem, length_problems


def demo_config(**overrides: Any) -> GRPOConfig:
    """The settings that taught the tiny Llama the target-length task here (see docs/rl.md)."""
    base: dict[str, Any] = dict(
        lr=1e-4,
        weight_decay=0.0,
        warmup_steps=0,
        max_grad_norm=1.0,
        temperature=1.0,
        max_tokens=48,
        entropy_coef=0.0,
        group_size=8,
        prompts_per_step=8,
        micro_batch_size=32,
    )
    base.update(overrides)
    return GRPOConfig(**base)


def collect_groups(
    engine: Any,
    problems: Sequence[Problem],
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    config: GRPOConfig,
    seeds: Sequence[int],
    policy_version: int,
) -> list[list[Rollout]]:
    """Sample ``config.group_size`` completions per problem with ``engine`` and score them by the rules."""
    from protocol.messages import SamplingParams

    prompts = [encode(p.prompt) for p in problems]
    params = SamplingParams(temperature=config.temperature, max_tokens=config.max_tokens)
    out = engine.generate(prompts, config.group_size, params, group_seeds(list(seeds), config.group_size))
    groups = []
    for prob, prompt, comps in zip(problems, prompts, out):
        group = []
        for c in comps:
            res = compute_reward(prob, decode(c.tokens), c.tokens, eos_token_id=engine.eos_token_id)
            group.append(Rollout(prompt, list(c.tokens), res.reward, policy_version=policy_version, passed=res.passed))
        groups.append(group)
    return groups


@dataclasses.dataclass
class DemoResult:
    metrics: list[StepMetrics]
    trainer: GRPOTrainer

    @property
    def rewards(self) -> list[float]:
        return [m.reward_mean for m in self.metrics]


def run_target_length_demo(
    steps: int = 40,
    seed: int = 0,
    config: GRPOConfig | None = None,
    hidden_size: int = 256,
    layers: int = 4,
    heads: int = 4,
    on_step: Callable[[StepMetrics], None] | None = None,
) -> DemoResult:
    """Train a from-scratch tiny Llama on the target-length task; returns every step's metrics.

    Seeded end to end: model init, prompts and sampling seeds derive from ``seed``.
    """
    from node.engines.transformers_engine import TransformersEngine
    from node.models import tiny_llama

    cfg = config or demo_config()
    tok = CharTokenizer()
    model = tiny_llama(
        vocab_size=tok.vocab_size, hidden_size=hidden_size, layers=layers, heads=heads, seed=seed, eos_token_id=tok.EOS
    )
    trainer = GRPOTrainer(model, cfg, pad_token_id=tok.PAD)
    engine = TransformersEngine(model, eos_token_id=tok.EOS, pad_token_id=tok.PAD)
    rng = random.Random(seed)
    metrics = []
    for step in range(steps):
        problems = length_problems(cfg.prompts_per_step, seed=seed * 100_003 + step)
        seeds = [rng.getrandbits(62) for _ in problems]
        t0 = time.perf_counter()
        groups = collect_groups(engine, problems, tok.encode, tok.decode, cfg, seeds, trainer.version)
        gen_s = time.perf_counter() - t0
        m = trainer.step(groups)
        m.step_time_s += gen_s  # whole loop iteration
        metrics.append(m)
        if on_step:
            on_step(m)
    return DemoResult(metrics, trainer)


if __name__ == "__main__":  # pragma: no cover - manual demo
    import sys

    torch.set_num_threads(2)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    s = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    t = time.perf_counter()
    run_target_length_demo(
        n,
        s,
        on_step=lambda m: print(
            f"step {m.step:3d} reward {m.reward_mean:+.3f} len {m.length_mean:5.1f} filtered {m.filtered_groups} "
            f"loss {m.loss:+.5f} gnorm {m.grad_norm:.3f} t {time.perf_counter() - t:6.1f}s",
            flush=True,
        ),
    )
