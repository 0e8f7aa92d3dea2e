"""``primenode dataset filter``: the offline pass-rate filter.

Samples ``k`` completions per problem with a given model, scores them by the
rules (rewards.py), and writes the problems whose pass rate lies in
``[lo, hi]`` (INTELLECT-2 kept [0.1, 0.8]) to a new dataset file, each with its
``pass_rate``. Problems the base model always or never solves give all-equal
rewards, hence zero advantages, hence no learning signal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.rl.evaluate import sample_problems
from node.rl.filters import INTELLECT2_PASS_WINDOW, in_pass_window
from node.rl.tasks import CharTokenizer, Problem, PromptStyle, load_dataset, prompt_token_ids, save_dataset

if TYPE_CHECKING:
    from node.engines.transformers_engine import TransformersEngine


@dataclasses.dataclass
class FilterSummary:
    total: int
    kept: int
    output: Path
    pass_rates: dict[str, float]


def load_model_for_sampling(
    model: str,
    device: str = "cpu",
    cache_dir: str | Path | None = None,
    style: PromptStyle | None = None,
) -> tuple[TransformersEngine, Callable[[Problem], list[int]], Callable[[list[int]], str]]:
    """(engine, prompt ids of a problem, decode) for ``tiny[:seed]``, ``smollm2``, a local Hugging
    Face model folder or ``hf:owner/name@rev`` from the local hub cache. Prompts go through the
    model's chat template with the run's system prompt and math instruction (``style``), exactly
    as workers will put them (``node.rl.tasks.prompt_token_ids``), so the pass rates measured
    here are the ones the run will see."""
    from node.engines.transformers_engine import TransformersEngine

    if model == "tiny" or model.startswith("tiny:"):
        from node.models import tiny_llama

        tok = CharTokenizer()
        seed = int(model.split(":", 1)[1]) if ":" in model else 0
        m = tiny_llama(vocab_size=tok.vocab_size, seed=seed, eos_token_id=tok.EOS)
        engine = TransformersEngine(m, device=device, eos_token_id=tok.EOS, pad_token_id=tok.PAD)
        return engine, lambda p: prompt_token_ids(tok, p, style), tok.decode
    if model == "smollm2":
        from node.models import load_smollm2

        m, hf_tok = load_smollm2(Path(cache_dir or Path.home() / ".cache" / "primenode"))
    else:
        from node.models import load_pinned_model, load_pinned_tokenizer, model_files, model_source_folder

        folder = model_source_folder(model)
        model_files(folder)  # the same checks as a run's model (config, tokenizer, safetensors)
        m = load_pinned_model(folder)
        hf_tok = load_pinned_tokenizer(folder)

    def decode(ids: list[int]) -> str:
        text: str = hf_tok.decode(ids, skip_special_tokens=True)
        return text

    pad = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else hf_tok.eos_token_id
    engine = TransformersEngine(m, device=device, eos_token_id=hf_tok.eos_token_id, pad_token_id=pad)
    return engine, lambda p: prompt_token_ids(hf_tok, p, style), decode


def pass_rates(
    problems: Sequence[Problem],
    engine: Any,
    prompt_ids: Callable[[Problem], list[int]],
    decode: Callable[[list[int]], str],
    k: int,
    *,
    max_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_prompts: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> list[float]:
    """Fraction of ``k`` sampled completions that pass, per problem (``RewardResult.passed``),
    sampled and scored as ``primenode eval`` does (``node.rl.evaluate.sample_problems``)."""
    from protocol.messages import SamplingParams

    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens)
    results = sample_problems(
        problems, engine, prompt_ids, decode, k, params, seed=seed, batch_prompts=batch_prompts, progress=progress
    )
    return [r.pass_rate for r in results]


def filter_dataset(
    input_path: str | Path,
    model: str,
    output: str | Path,
    *,
    k: int = 16,
    lo: float = INTELLECT2_PASS_WINDOW[0],
    hi: float = INTELLECT2_PASS_WINDOW[1],
    max_tokens: int = 256,
    temperature: float = 1.0,
    seed: int = 0,
    device: str = "cpu",
    limit: int | None = None,
    engine: Any = None,
    encode: Callable[[str], list[int]] | None = None,
    decode: Callable[[list[int]], str] | None = None,
    progress: Callable[[int, int], None] | None = None,
    style: PromptStyle | None = None,
    split: str = "train",
) -> FilterSummary:
    """The whole command: load (a file, a folder or ``hf:owner/name@rev`` from the local hub
    cache), sample, score, keep ``lo <= pass_rate <= hi``, write ``output`` (JSONL or Parquet).
    ``style``: the run's system prompt and math instruction (default: the built-in ones)."""
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"bad window [{lo}, {hi}]")
    if k < 1:
        raise ValueError("k must be >= 1")
    problems = load_dataset(input_path, split=split, limit=limit)
    prompt_ids: Callable[[Problem], list[int]]
    if engine is None:
        engine, prompt_ids, decode = load_model_for_sampling(model, device=device, style=style)
    else:
        assert encode is not None, "a given engine comes with its encode (prompt text -> ids)"
        text_encode = encode
        prompt_ids = lambda p: text_encode(p.prompt)  # noqa: E731
    assert decode is not None
    rates = pass_rates(
        problems,
        engine,
        prompt_ids,
        decode,
        k,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        progress=progress,
    )
    kept = [dataclasses.replace(p, pass_rate=r) for p, r in zip(problems, rates) if in_pass_window(r, lo, hi)]
    out = save_dataset(kept, output)
    return FilterSummary(len(problems), len(kept), out, {p.id: r for p, r in zip(problems, rates)})
