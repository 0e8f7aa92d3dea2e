"""What a validator's replay costs against a worker's generation, on a GPU (issue 32: the
validator capacity a run needs). On this CPU a replay costs about 1/3.9 of the generation it
checks; on a GPU generation is bound by memory bandwidth, token by token, while the replay is
one prefill of every token at once, so the ratio is another number, and the capacity plan
(docs/scale.md) needs it.

    python bench/gpu_replay.py [--device cuda] [--sizes 135m,1.7b] [--prompts 8] [--group 8]
                               [--prompt-tokens 128] [--max-tokens 256] [--repeats 3]

For each model size (random weights of SmolLM2's shapes: the cost of a forward does not depend
on what the weights are), in bf16 on the device:

* **worker, our engine**: ``TransformersEngine.generate`` (node/engines/transformers_engine.py),
  the seeded sampling a transformers worker runs: ``prompts`` prompts x ``group`` completions
  of ``max-tokens`` tokens (EOS off, so every completion has its full length);
* **worker, HF generate**: transformers' own ``generate(do_sample=True)`` on the same shapes,
  a faster decoder (vLLM is faster still: the ratio for a vLLM worker lies below this one);
* **validator**: ``TransformersEngine.prefill_hidden_batch`` on those completions, what
  ``verify_batch`` runs (one prefill per group's prompt, its KV cache shared by the group).

Reported: seconds (median of ``repeats``), tokens per second, and the ratios generation /
replay. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    # SmolLM2's published configurations (hidden, intermediate, layers, heads, kv heads)
    "135m": (576, 1536, 30, 9, 3),
    "360m": (960, 2560, 32, 15, 5),
    "1.7b": (2048, 8192, 24, 32, 32),
    "tiny": (64, 128, 2, 4, 2),  # for a quick check on a CPU
}
VOCAB = 49152


def build(size: str, device: str, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv = SHAPES[size]
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.generation_config.eos_token_id = None
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Any, device: str, repeats: int) -> tuple[float, Any]:
    out = fn()  # warm-up (kernels, allocator)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run_size(a: argparse.Namespace, size: str) -> dict[str, Any]:
    try:  # protocol/ needs msgpack and cryptography: a bare GPU image may lack them
        from node.engines.transformers_engine import TransformersEngine
        from protocol.messages import SamplingParams
    except ImportError as exc:
        print(f"our engine is not importable here ({exc}): HF generate and a plain forward only", flush=True)
        TransformersEngine = None  # type: ignore[assignment,misc]

    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    model = build(size, a.device, dtype)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (a.prompt_tokens,), generator=g).tolist() for _ in range(a.prompts)]
    ids = torch.tensor(prompts, device=a.device)
    gen_s: float | None = None
    replay_s: float | None = None
    forward_s: float | None = None
    with torch.inference_mode():
        if TransformersEngine is not None:
            engine = TransformersEngine(
                model, device=a.device, eos_token_id=[], pad_token_id=0, max_batch=a.prompts * a.group
            )
            seeds = [[1000 * p + j for j in range(a.group)] for p in range(a.prompts)]
            params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=a.max_tokens)
            gen_s, groups = timed(lambda: engine.generate(prompts, a.group, params, seeds), a.device, a.repeats)
            pairs = [(c.prompt_tokens, c.tokens) for grp in groups for c in grp]
            replay_s, _ = timed(lambda: engine.prefill_hidden_batch(pairs), a.device, a.repeats)

        def hf() -> Any:
            return model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                num_return_sequences=a.group,
                max_new_tokens=a.max_tokens,
                min_new_tokens=a.max_tokens,
                pad_token_id=0,
            )

        hf_s, full = timed(hf, a.device, a.repeats)
        # a plain forward over every prompt + completion (no KV sharing within a group): the
        # replay without our engine's batching, and the fallback where the engine is missing
        forward_s, _ = timed(
            lambda: model(full, attention_mask=torch.ones_like(full)).logits[:, -1], a.device, a.repeats
        )
    new_tokens = a.prompts * a.group * a.max_tokens
    tokens = a.prompts * a.group * (a.prompt_tokens + a.max_tokens)

    def rnd(x: float | None, d: int = 3) -> float | None:
        return None if x is None else round(x, d)

    return {
        "size": size,
        "dtype": a.dtype,
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
        "sequences": a.prompts * a.group,
        "new_tokens": new_tokens,
        "engine_generate_s": rnd(gen_s),
        "hf_generate_s": rnd(hf_s),
        "replay_s": rnd(replay_s),
        "forward_s": rnd(forward_s),
        "engine_tokens_per_s": rnd(new_tokens / gen_s, 1) if gen_s else None,
        "hf_tokens_per_s": rnd(new_tokens / hf_s, 1),
        "replay_tokens_per_s": rnd(tokens / replay_s, 1) if replay_s else None,
        "ratio_engine": rnd(gen_s / replay_s, 2) if gen_s and replay_s else None,
        "ratio_hf": rnd(hf_s / replay_s, 2) if replay_s else None,
        "ratio_hf_forward": rnd(hf_s / forward_s, 2) if forward_s else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--sizes", default="135m,1.7b")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    rows = []
    for size in a.sizes.split(","):
        row = run_size(a, size)
        rows.append(row)
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the model went with run_size's frame
        print(
            f"{size} {a.dtype} on {row['device']}: {row['sequences']} x {a.max_tokens} tokens; generate "
            f"{row['engine_generate_s']} s (our engine), {row['hf_generate_s']} s (HF); replay {row['replay_s']} s, "
            f"plain forward {row['forward_s']} s; ratio {row['ratio_engine']} (engine) / {row['ratio_hf']} (HF) / "
            f"{row['ratio_hf_forward']} (HF over a plain forward)",
            flush=True,
        )
    out = {"bench": "gpu_replay", "torch": torch.__version__, "rows": rows}
    line = json.dumps(out)
    if a.out is not None:
        a.out.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
