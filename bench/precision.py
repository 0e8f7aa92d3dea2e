"""Precision: seconds per GRPO step with fp32 compute (the baseline) and with bf16
autocast (``GRPOConfig.compute_dtype = "bfloat16"``: fp32 master weights and AdamW state),
on the tiny random Llama (hidden 256, 4 layers, ~5M parameters), in the same run,
interleaved so machine load hits both alike; plus how far bf16 log-probs are from fp32's.
Then the engines a worker and a validator run (issue 16 point 2: a bf16 policy's engines
compute in bf16): seconds per seeded generation and per validator prefill of the same
completions, fp32 weights against the same weights cast to bf16, interleaved.

    python bench/precision.py [--steps 4] [--rollouts 16] [--tokens 128] [--engine-model tiny|smollm2]

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
    ap.add_argument("--engine-model", default="tiny", help="tiny, smollm2, or none (skip the engine timing)")
    ap.add_argument("--engine-prompts", type=int, default=4)
    ap.add_argument("--engine-n", type=int, default=4, help="completions per prompt")
    ap.add_argument("--engine-tokens", type=int, default=32)
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
    print(f"{'compute':<10} {'s/step (median)':>16} {'all steps':>30}")
    for d in trainers:
        print(f"{d:<10} {med[d]:>16.3f} {' '.join(f'{t:.2f}' for t in times[d]):>30}")
    print(f"bf16/fp32 step time: {med['bfloat16'] / med['float32']:.2f}x; max |log-prob diff| {diff:.4f}")
    engine = engine_times(args) if args.engine_model != "none" else {}
    load = os.getloadavg()[0]
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
                **engine,
                "loadavg": round(load, 1),
            }
        )
    )


def engine_times(args: argparse.Namespace) -> dict[str, object]:
    """Median seconds of a worker's seeded generation and a validator's prefill of the same
    completions, fp32 against bf16 weights (``--steps`` rounds, interleaved, one thread)."""
    import torch

    from node.engines.base import group_seeds
    from node.engines.transformers_engine import TransformersEngine
    from protocol.messages import SamplingParams

    if args.engine_model == "smollm2":
        from node.models import load_smollm2

        model, tok = load_smollm2(Path.home() / ".cache" / "primenode")
        eos = tok.eos_token_id
    else:
        from node.models import tiny_llama

        model, eos = tiny_llama(seed=0, eos_token_id=2), 2
    state = model.state_dict()
    engines = {}
    for d in ("float32", "bfloat16"):
        m = type(model)(model.config).to(getattr(torch, d))
        m.load_state_dict(state)  # cast from the fp32 weights, as a published version is
        engines[d] = TransformersEngine(m.eval(), eos_token_id=eos)
    vocab = engines["float32"].vocab_size
    rng = random.Random(5)
    prompts = [[rng.randrange(3, vocab) for _ in range(24)] for _ in range(args.engine_prompts)]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.engine_tokens)
    seeds = group_seeds(list(range(len(prompts))), args.engine_n)
    gen: dict[str, list[float]] = {d: [] for d in engines}
    pre: dict[str, list[float]] = {d: [] for d in engines}
    for _ in range(args.steps):
        for d, eng in engines.items():
            t0 = time.perf_counter()
            out = eng.generate(prompts, args.engine_n, params, seeds)
            gen[d].append(time.perf_counter() - t0)
            pairs = [(c.prompt_tokens, c.tokens) for g in out for c in g]
            t0 = time.perf_counter()
            eng.prefill_hidden_batch(pairs)
            pre[d].append(time.perf_counter() - t0)
    g = {d: statistics.median(t) for d, t in gen.items()}
    p = {d: statistics.median(t) for d, t in pre.items()}
    rows = args.engine_prompts * args.engine_n
    print(f"engines ({args.engine_model}, {rows} completions x {args.engine_tokens} tokens, one thread):")
    print(f"{'weights':<10} {'generate s':>12} {'prefill s':>12}")
    for d in engines:
        print(f"{d:<10} {g[d]:>12.3f} {p[d]:>12.3f}")
    print(f"bf16/fp32: generate {g['bfloat16'] / g['float32']:.2f}x, prefill {p['bfloat16'] / p['float32']:.2f}x")
    return {
        "engine_model": args.engine_model,
        "engine_generate_s_fp32": round(g["float32"], 4),
        "engine_generate_s_bf16": round(g["bfloat16"], 4),
        "engine_prefill_s_fp32": round(p["float32"], 4),
        "engine_prefill_s_bf16": round(p["bfloat16"], 4),
    }


if __name__ == "__main__":
    main()
