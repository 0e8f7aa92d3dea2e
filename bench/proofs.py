"""TOPLOC cost benchmark: generation (with hidden-state capture) vs proof building vs
verification (one batched prefill + checking), and proof bytes per generated token.

    python3 bench/proofs.py --model smollm2|tiny [--prompts 8 --n 2 --max-tokens 128 --repeats 3]

Generation is what a worker does: one KV-cached batch of all prompts x n completions,
temperature 0.6, the same max_tokens, with hidden-state capture. Verification is what
a validator does: ``prefill_hidden_batch`` (prompt + claimed tokens, base model, no LM
head, fp32 like the worker) plus the proof check. Each repeat runs generation and
verification back to back on the same machine; the report uses the fastest of each
(the machine is shared, so the minimum is the least disturbed measurement), and also
gives the medians. ``--bf16-verify`` also times a bf16 copy of the model as the
verifier and reports whether honest fp32 proofs pass it (information only: nodes
verify in the worker's precision).

The final line is one JSON object (build_overhead_pct, verify_speedup, proof_bytes_per_token, ...).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.engines.base import group_seeds
from node.engines.transformers_engine import TransformersEngine
from node.models import load_smollm2, tiny_llama
from proofs import ChunkResult, ProofConfig, build_many, check_chunks, chunk_activations
from proofs.toploc import split_hidden
from protocol.messages import SamplingParams

QUESTIONS = [
    "Explain why the sky is blue.",
    "Write a short story about a lighthouse keeper.",
    "What are the main causes of inflation?",
    "Describe how a bicycle works.",
    "Give three tips for learning a new language.",
    "Why do cats purr?",
    "Summarise the water cycle.",
    "What is a prime number? Give examples.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--cache", default=os.environ.get("PRIMENODE_MODEL_CACHE", str(Path.home() / ".cache/primenode")))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plain", action="store_true", help="also time generation without capture")
    ap.add_argument("--bf16-verify", action="store_true", help="also time a bf16 verifier (information)")
    ap.add_argument("--gen-max-batch", type=int, default=64, help="rows per generation forward (64: one batch)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="one numerics stack for worker and validator (bf16: both generate and verify in bf16)",
    )
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]

    if args.model == "smollm2":
        model, tok = load_smollm2(args.cache)
        prompts = []
        for i in range(args.prompts):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], tokenize=True, add_generation_prompt=True
            )
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        engine = TransformersEngine(model.to(dtype), device=args.device, max_batch=args.gen_max_batch)
    else:
        engine = TransformersEngine(
            tiny_llama(vocab_size=512, eos_token_id=None).to(dtype), device=args.device, max_batch=args.gen_max_batch
        )
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(4, 512, (24,), generator=g).tolist() for _ in range(args.prompts)]

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    seeds = list(range(len(prompts)))
    cfg = ProofConfig()
    engine.generate(
        prompts[:2], 1, SamplingParams(max_tokens=4), group_seeds([0, 1], 1), capture_hidden=True
    )  # warm-up
    engine.prefill_hidden_batch([(prompts[0], prompts[1])])

    def check(hidden: list[torch.Tensor], config: ProofConfig) -> tuple[float, list[ChunkResult]]:
        t0 = time.perf_counter()
        chunks = [
            ch
            for c, h in zip(completions, hidden)
            for ch in chunk_activations(*split_hidden(h, len(c.prompt_tokens)), config)
        ]
        results = check_chunks(chunks, [b for p in proofs for b in p], config.topk)
        return time.perf_counter() - t0, results

    gen_s, plain_s, build_s, prefill_s, check_s = [], [], [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        groups = engine.generate(prompts, args.n, params, group_seeds(seeds, args.n), capture_hidden=True)
        gen_s.append(time.perf_counter() - t0)
        completions = [c for g in groups for c in g]
        t0 = time.perf_counter()
        proofs = build_many([(c.hidden, len(c.prompt_tokens)) for c in completions], cfg)
        build_s.append(time.perf_counter() - t0)
        pairs = [(c.prompt_tokens, c.tokens) for c in completions]
        t0 = time.perf_counter()
        hidden = engine.prefill_hidden_batch(pairs)
        prefill_s.append(time.perf_counter() - t0)
        seconds, results = check(hidden, cfg)
        check_s.append(seconds)
        if args.plain:
            t0 = time.perf_counter()
            engine.generate(prompts, args.n, params, group_seeds(seeds, args.n), capture_hidden=False)
            plain_s.append(time.perf_counter() - t0)

    gen_tokens = sum(len(c.tokens) for c in completions)
    prefill_tokens = sum(len(p) + len(c) for p, c in pairs)
    computed_tokens = sum(len(p) for p in {tuple(p) for p, _ in pairs}) + sum(len(c) for _, c in pairs)
    n_chunks = sum(len(p) for p in proofs)
    proof_bytes = sum(len(b) for p in proofs for b in p)
    decode_bytes = sum(len(b) for p in proofs for b in p[1:])  # the prompt chunk excluded
    tight = ProofConfig.tight()
    worst = max(results, key=lambda r: (r.exp_mismatches, r.mant_err_mean))
    gen, verify = min(gen_s), min(p + c for p, c in zip(prefill_s, check_s))
    flop_per_token = 2 * sum(
        p.numel() for n, p in engine.model.named_parameters() if "embed" not in n and "lm_head" not in n
    )

    report = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "repeats": args.repeats,
        "completions": len(completions),
        "generated_tokens": gen_tokens,
        "prefill_tokens": prefill_tokens,
        "verify_tokens_computed": computed_tokens,  # a group's shared prompt runs once
        "chunks": n_chunks,
        "generation_s": round(gen, 3),
        "generation_s_median": round(statistics.median(gen_s), 3),
        "tokens_per_s": round(gen_tokens / gen, 1),
        "build_s": round(min(build_s), 4),
        "build_ms_per_chunk": round(min(build_s) * 1e3 / n_chunks, 3),
        "build_overhead_pct": round(100 * min(build_s) / gen, 3),
        "verify_prefill_s": round(min(prefill_s), 3),
        "verify_prefill_gflops": round(computed_tokens * flop_per_token / min(prefill_s) / 1e9, 1),
        "verify_check_s": round(min(check_s), 4),
        "check_ms_per_chunk": round(min(check_s) * 1e3 / n_chunks, 3),
        "verify_speedup": round(gen / verify, 2),
        "verify_speedup_median": round(
            statistics.median(gen_s) / statistics.median([p + c for p, c in zip(prefill_s, check_s)]), 2
        ),
        "proof_bytes_per_token": round(proof_bytes / gen_tokens, 3),
        "decode_proof_bytes_per_token": round(decode_bytes / gen_tokens, 3),
        "honest_passed": all(r.passes(cfg) for r in results),
        "honest_passed_tight": all(r.passes(tight) for r in results),
        "honest_worst_chunk": [worst.exp_mismatches, worst.mant_err_mean, worst.mant_err_median],
    }
    if args.plain:
        report["generation_no_capture_s"] = round(min(plain_s), 3)
        report["verify_speedup_vs_no_capture"] = round(min(plain_s) / verify, 2)
    report["fp32_matmul_gflops"] = round(_matmul_gflops(torch.float32, flop_per_token), 1)
    if args.bf16_verify:
        low = TransformersEngine(copy.deepcopy(engine.model).to(torch.bfloat16), device=args.device)
        low.prefill_hidden_batch(pairs[:1])
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            hidden = low.prefill_hidden_batch(pairs)
            times.append(time.perf_counter() - t0)
        seconds, results = check(hidden, cfg)
        worst = max(results, key=lambda r: (r.exp_mismatches, r.mant_err_mean))
        report["bf16_matmul_gflops"] = round(_matmul_gflops(torch.bfloat16, flop_per_token), 1)
        report["bf16_verify_prefill_s"] = round(min(times), 3)
        report["bf16_verify_speedup"] = round(gen / (min(times) + seconds), 2)
        report["bf16_verify_honest_passed"] = all(r.passes(cfg) for r in results)
        report["bf16_verify_honest_passed_tight"] = all(r.passes(tight) for r in results)
        report["bf16_verify_worst_chunk"] = [worst.exp_mismatches, worst.mant_err_mean, worst.mant_err_median]
    print(json.dumps(report))


def _matmul_gflops(dtype: torch.dtype, _flop_per_token: int) -> float:
    """This CPU's matmul throughput at a prefill-like shape (2048 x 576 @ 576 x 1536),
    the ceiling for a prefill that is all matmuls."""
    a, w = torch.randn(2048, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
    for _ in range(3):
        torch.nn.functional.linear(a, w)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(5):
            torch.nn.functional.linear(a, w)
        best = min(best, (time.perf_counter() - t0) / 5)
    return 2 * 2048 * 576 * 1536 / best / 1e9


if __name__ == "__main__":
    main()
