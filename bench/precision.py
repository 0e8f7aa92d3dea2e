"""Precision: seconds per GRPO step with fp32 compute (the baseline), bf16 autocast
(``param_dtype = "float32"``: fp32 parameters, gradients and AdamW state) and bf16 with fp32
master weights (the default for a bf16 run, node/rl/precision.py: bf16 parameters and
gradients), on the tiny random Llama (hidden 256, 4 layers, ~5M parameters), in the same run,
interleaved so machine load hits them alike; plus how far bf16 log-probs are from fp32's.

What bf16 gradients cost in learning, two ways:

- gradient error: one batch's gradient accumulated over micro-batches of 1, 4 and all
  rollouts, against the fp32 gradient at the same weights (relative L2 error): bf16
  gradients are rounded after every micro-batch, autocast's accumulate in fp32;
- learning: the target-length task (node/rl/demo.py, the loop test's task) for
  ``--learn-steps`` steps per mode, the same seeds, ``--learn-micro`` rollouts per
  micro-batch (64 rollouts a step: 8 micro-batches accumulated); mean reward of the first and
  last five steps.

Then the engines a worker and a validator run (issue 16 point 2: a bf16 policy's engines
compute in bf16): seconds per seeded generation and per validator prefill of the same
completions, fp32 weights against the same weights cast to bf16, interleaved.

    python bench/precision.py [--steps 4] [--rollouts 16] [--tokens 128] [--engine-model tiny|smollm2]
                              [--learn-steps 40] [--learn-micro 8]

Prints a table, the load average, and one JSON line last.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    ap.add_argument("--learn-steps", type=int, default=40, help="target-length steps per mode (0: skip)")
    ap.add_argument("--learn-micro", type=int, default=8, help="rollouts per micro-batch in the learning runs")
    args = ap.parse_args()

    import torch

    from node.models import tiny_llama
    from node.rl.grpo import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    cfg = dict(lr=1e-4, warmup_steps=0, max_tokens=args.tokens, temperature=1.0, micro_batch_size=8)
    trainers = {d: GRPOTrainer(tiny_llama(seed=0), GRPOConfig(**cfg, **kw)) for d, kw in MODES.items()}
    probe = [r for g in groups(99, args.rollouts, args.tokens, 512, 0) for r in g]
    lp = {d: tr.old_logprobs(probe) for d, tr in trainers.items()}
    diff = max(float((a - b).abs().max()) for a, b in zip(lp["float32"], lp["bfloat16"]))
    diff_master = max(float((a - b).abs().max()) for a, b in zip(lp["float32"], lp["bf16-master"]))
    times: dict[str, list[float]] = {d: [] for d in trainers}
    for s in range(args.steps):
        for d, tr in trainers.items():
            t0 = time.perf_counter()
            tr.step(groups(s, args.rollouts, args.tokens, 512, tr.version))
            times[d].append(time.perf_counter() - t0)
    med = {d: statistics.median(t) for d, t in times.items()}
    print(f"{'compute':<12} {'s/step (median)':>16} {'all steps':>30}")
    for d in trainers:
        print(f"{d:<12} {med[d]:>16.3f} {' '.join(f'{t:.2f}' for t in times[d]):>30}")
    print(
        f"bf16 autocast / fp32 step time: {med['bfloat16'] / med['float32']:.2f}x, bf16 master / fp32: "
        f"{med['bf16-master'] / med['float32']:.2f}x; max |log-prob diff| vs fp32: autocast {diff:.4f}, "
        f"bf16 parameters {diff_master:.4f}"
    )
    grad = gradient_errors(args)
    learn = learning(args) if args.learn_steps > 0 else {}
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
                "s_per_step_bf16_master": round(med["bf16-master"], 4),
                "ratio": round(med["bfloat16"] / med["float32"], 3),
                "ratio_master": round(med["bf16-master"] / med["float32"], 3),
                "max_abs_logprob_diff": round(diff, 5),
                "max_abs_logprob_diff_master": round(diff_master, 5),
                "grad_rel_error": grad,
                **learn,
                **engine,
                "loadavg": round(load, 1),
            }
        )
    )


# the three trainers compared: "bfloat16" is autocast (its key since before the master mode)
MODES: dict[str, dict[str, object]] = {
    "float32": {"compute_dtype": "float32"},
    "bfloat16": {"compute_dtype": "bfloat16", "param_dtype": "float32"},
    "bf16-master": {"compute_dtype": "bfloat16"},
}


def gradient_errors(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Relative L2 error of one batch's accumulated gradient against fp32's at the same
    weights, per mode and micro-batch size (the loss and its normaliser as a step's)."""
    import torch

    from node.models import tiny_llama
    from node.rl.grpo import GRPOConfig, GRPOTrainer

    batch = groups(7, args.rollouts, args.tokens, 512, 0)
    sizes = [1, 4, args.rollouts]

    def grads(mode: str, micro: int) -> torch.Tensor:
        cfg = GRPOConfig(  # no clip: the fp32 trainer clips before the hook below sees the gradients
            lr=0.0, warmup_steps=0, max_grad_norm=1e9, max_tokens=args.tokens, temperature=1.0, micro_batch_size=micro
        )
        tr = GRPOTrainer(tiny_llama(seed=0), dataclasses.replace(cfg, **MODES[mode]))  # type: ignore[arg-type]
        seen: list[torch.Tensor] = []
        step = tr.optimizer.step

        def hooked(*a: object) -> object:  # read the accumulated gradients, then update as usual
            seen.append(torch.cat([p.grad.detach().float().flatten() for p in tr.model.parameters()]))
            return step(*a)

        tr.optimizer.step = hooked
        tr.step(batch)
        return seen[0]

    ref = grads("float32", args.rollouts)
    out: dict[str, dict[str, float]] = {}
    print(f"gradient error vs fp32 (relative L2), {args.rollouts} rollouts x {args.tokens} tokens:")
    print(f"{'mode':<12} " + " ".join(f"{'micro ' + str(m):>10}" for m in sizes))
    for mode in ("bfloat16", "bf16-master"):
        out[mode] = {str(m): float((grads(mode, m) - ref).norm() / ref.norm()) for m in sizes}
        print(f"{mode:<12} " + " ".join(f"{out[mode][str(m)]:>10.4f}" for m in sizes))
    return out


def learning(args: argparse.Namespace) -> dict[str, object]:
    """The target-length task per mode, same seeds: mean reward of the first and last 5 steps."""
    from node.rl.demo import demo_config, run_target_length_demo

    out: dict[str, object] = {}
    print(f"learning: target-length task, {args.learn_steps} steps, micro-batches of {args.learn_micro}:")
    print(f"{'mode':<12} {'first 5':>8} {'last 5':>8} {'s':>6}")
    for mode, kw in MODES.items():
        t0 = time.perf_counter()
        res = run_target_length_demo(
            steps=args.learn_steps, seed=0, config=demo_config(micro_batch_size=args.learn_micro, **kw)
        )
        r = res.rewards
        first, last = sum(r[:5]) / 5, sum(r[-5:]) / 5
        secs = time.perf_counter() - t0
        print(f"{mode:<12} {first:>+8.3f} {last:>+8.3f} {secs:>6.0f}")
        out[f"learn_{mode}"] = {"first5": round(first, 4), "last5": round(last, 4), "rewards": [round(x, 3) for x in r]}
    return out


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
