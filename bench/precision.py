"""Trainer precision: seconds per GRPO step with fp32 compute (the baseline) and with bf16
autocast (``GRPOConfig.compute_dtype = "bfloat16"``: fp32 master weights and AdamW state),
on the tiny random Llama (hidden 256, 4 layers, ~5M parameters), in the same run,
interleaved so machine load hits both alike; plus how far bf16 log-probs are from fp32's.

    python bench/precision.py [--steps 4] [--rollouts 16] [--tokens 128]

Prints a table, the load average, and one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def groups(seed: int, rollouts: int, tokens: int, vocab: int, version: int) -> list[list]:
    from node.rl.grpo import Rollout

    rng = random.Random(seed)
    out = []
    for _ in range(rollouts // 4):
        prompt = [rng.randrange(3, vocab) for _ in range(16)]
        out.append(
            [
                Rollout(prompt, [rng.randrange(3, vocab) for _ in range(tokens)], float(i % 2), policy_version=version)
                for i in range(4)
            ]
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()

    import torch

    from node.models import tiny_llama
    from node.rl.grpo import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    cfg = dict(lr=1e-4, warmup_steps=0, max_tokens=args.tokens, temperature=1.0, micro_batch_size=8)
    trainers = {d: GRPOTrainer(tiny_llama(seed=0), GRPOConfig(**cfg, compute_dtype=d)) for d in ("float32", "bfloat16")}
    probe = [r for g in groups(99, args.rollouts, args.tokens, 512, 0) for r in g]
    lp = {d: tr.old_logprobs(probe) for d, tr in trainers.items()}
    diff = max(float((a - b).abs().max()) for a, b in zip(lp["float32"], lp["bfloat16"]))
    times: dict[str, list[float]] = {d: [] for d in trainers}
    for s in range(args.steps):
        for d, tr in trainers.items():
            t0 = time.perf_counter()
            tr.step(groups(s, args.rollouts, args.tokens, 512, tr.version))
            times[d].append(time.perf_counter() - t0)
    med = {d: statistics.median(t) for d, t in times.items()}
    load = os.getloadavg()[0]
    print(f"{'compute':<10} {'s/step (median)':>16} {'all steps':>30}")
    for d in trainers:
        print(f"{d:<10} {med[d]:>16.3f} {' '.join(f'{t:.2f}' for t in times[d]):>30}")
    print(f"bf16/fp32 step time: {med['bfloat16'] / med['float32']:.2f}x; max |log-prob diff| {diff:.4f}")
    print(f"load average (1 min): {load:.1f}")
    print(
        json.dumps(
            {
                "bench": "precision",
                "rollouts": args.rollouts,
                "tokens": args.tokens,
                "s_per_step_fp32": round(med["float32"], 4),
                "s_per_step_bf16_autocast": round(med["bfloat16"], 4),
                "ratio": round(med["bfloat16"] / med["float32"], 3),
                "max_abs_logprob_diff": round(diff, 5),
                "loadavg": round(load, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
