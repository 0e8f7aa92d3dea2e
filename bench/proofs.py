"""TOPLOC cost benchmark: generation (with hidden-state capture) vs proof building vs
verification (one batched prefill + checking), and proof bytes per generated token.

    python3 bench/proofs.py --model smollm2|tiny [--prompts 8 --n 2 --max-tokens 128]

The final line is one JSON object (build_overhead_pct, verify_speedup, proof_bytes_per_token, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.engines.base import SamplingConfig  # noqa: E402
from node.engines.transformers_engine import TransformersEngine  # noqa: E402
from node.models import load_smollm2, tiny_llama  # noqa: E402
from proofs import ProofConfig, build_many, chunk_activations, check_chunks  # noqa: E402
from proofs.toploc import split_hidden  # noqa: E402

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
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    if args.model == "smollm2":
        model, tok = load_smollm2(args.cache)
        prompts = []
        for i in range(args.prompts):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], tokenize=True, add_generation_prompt=True
            )
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        engine = TransformersEngine(model, device=args.device)
    else:
        engine = TransformersEngine(tiny_llama(vocab_size=512, eos_token_id=None), device=args.device)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(4, 512, (24,), generator=g).tolist() for _ in range(args.prompts)]

    params = SamplingConfig(temperature=args.temperature, max_tokens=args.max_tokens)
    seeds = list(range(len(prompts)))
    engine.generate(prompts[:1], 1, SamplingConfig(max_tokens=2), [0])  # warm-up

    t0 = time.perf_counter()
    groups = engine.generate(prompts, args.n, params, seeds, capture_hidden=True)
    gen_s = time.perf_counter() - t0
    completions = [c for g in groups for c in g]
    gen_tokens = sum(len(c.tokens) for c in completions)

    cfg = ProofConfig()
    t0 = time.perf_counter()
    proofs = build_many([(c.hidden, len(c.prompt_tokens)) for c in completions], cfg)
    build_s = time.perf_counter() - t0
    n_chunks = sum(len(p) for p in proofs)
    proof_bytes = sum(len(b) for p in proofs for b in p)
    decode_bytes = sum(len(b) for p in proofs for b in p[1:])  # the prompt chunk excluded

    t0 = time.perf_counter()
    hidden = engine.prefill_hidden_batch([(c.prompt_tokens, c.tokens) for c in completions])
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    chunks = [ch for c, h in zip(completions, hidden) for ch in chunk_activations(*split_hidden(h, len(c.prompt_tokens)), cfg)]
    results = check_chunks(chunks, [b for p in proofs for b in p], cfg.topk)
    check_s = time.perf_counter() - t0
    passed = all(r.passes(cfg) for r in results)

    report = {
        "model": args.model,
        "device": args.device,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "completions": len(completions),
        "generated_tokens": gen_tokens,
        "chunks": n_chunks,
        "generation_s": round(gen_s, 3),
        "tokens_per_s": round(gen_tokens / gen_s, 1),
        "build_s": round(build_s, 4),
        "build_ms_per_chunk": round(build_s * 1e3 / n_chunks, 3),
        "build_overhead_pct": round(100 * build_s / gen_s, 3),
        "verify_prefill_s": round(prefill_s, 3),
        "verify_check_s": round(check_s, 4),
        "check_ms_per_chunk": round(check_s * 1e3 / n_chunks, 3),
        "verify_speedup": round(gen_s / (prefill_s + check_s), 2),
        "proof_bytes_per_token": round(proof_bytes / gen_tokens, 3),
        "decode_proof_bytes_per_token": round(decode_bytes / gen_tokens, 3),
        "honest_passed": passed,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
