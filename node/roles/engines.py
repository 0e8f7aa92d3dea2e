"""Build the inference engine a worker or validator runs (``primenode join --engine``).

``transformers`` (the default) runs the policy in-process from the model object;
``vllm`` runs the optional vLLM engine (node/engines/vllm_engine.py), which loads
a HF model folder: the run's own folder for a local model, the converted SmolLM2
cache, or, for the built-in tiny model, version 0 saved once into the node's
cache. Either way the engine's numerics stack must be the one the genesis
declares (``RunContext.check_engine``): a vLLM worker in a run declared
``transformers-fp32-cpu`` is refused before it produces anything, because tight
TOPLOC thresholds assume both sides compute alike.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from node.engines.base import InferenceEngine
from node.errors import ConfigError, ModelError
from node.roles.context import RunContext

ENGINES = ("transformers", "vllm")


def check_engine_choice(engine: str, role: str | None = None, tamper: str | None = None) -> None:
    """Refuse an ``--engine`` choice before anything runs: a name no backend has, an engine
    for a role that runs no engine (``role``; None skips that check), or a ``--tamper`` mode
    (those exist for the transformers engine only). The one check the CLI, the daemon, the
    devnet and the role factory all apply."""
    if engine not in ENGINES:
        raise ConfigError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}")
    if engine != "transformers" and role is not None and role not in ("worker", "validator"):
        raise ConfigError(f"--engine {engine} is for workers and validators; the {role} runs transformers")
    if engine != "transformers" and tamper:
        raise ConfigError("--tamper modes exist for the transformers engine only")


def build_engine(ctx: RunContext, kind: str, device: str = "cpu") -> InferenceEngine:
    """The engine of ``kind`` on version 0 of the policy (blocking: run it in a thread)."""
    check_engine_choice(kind)
    engine: InferenceEngine
    if kind == "transformers":
        from node.engines.transformers_engine import TransformersEngine

        # the engine computes in the run's engine dtype (bf16 for a bf16 policy): version 0 is
        # built in fp32 and cast once; later versions are cast on load (load_weights/load_delta)
        model = ctx.initial_model().to(ctx.engine_dtype)
        engine = TransformersEngine(model, device=device, eos_token_id=ctx.eos_token_id, pad_token_id=ctx.pad_token_id)
    else:
        from node.engines.vllm_engine import VLLMEngine, vllm_available

        if not vllm_available():
            raise ModelError(
                "--engine vllm needs vLLM in this Python environment "
                "(`pip install -e '.[vllm]'` on a GPU box; docs/proofs.md, section vLLM)"
            )
        engine = VLLMEngine(
            model_folder(ctx), dtype=str(ctx.engine_dtype).removeprefix("torch."), eos_token_id=ctx.eos_token_id
        )
    ctx.check_engine(engine)
    return engine


def scoring_engine(ctx: RunContext, device: str = "cpu", state_dict: Any = None) -> Any:
    """A transformers engine on the run's policy for scoring (``primenode eval``, the trainer's
    held-out evaluation): version 0 in the run's engine dtype, as ``build_engine`` makes it, then
    ``state_dict`` (a published version's weights) loaded as a worker loads a new version. No
    numerics check: a score is not a proof, and an operator may score on another device."""
    from node.engines.transformers_engine import TransformersEngine

    model = ctx.initial_model().to(ctx.engine_dtype)
    engine = TransformersEngine(model, device=device, eos_token_id=ctx.eos_token_id, pad_token_id=ctx.pad_token_id)
    if state_dict is not None:
        engine.load_weights(state_dict)
    return engine


def model_folder(ctx: RunContext) -> Path:
    """A HF folder holding version 0 of the run's policy (written once for the tiny model)."""
    g = ctx.genesis
    if ctx.model_dir is not None:  # a model pinned by content: the verified folder
        return ctx.model_dir
    if g.model == "smollm2":
        from node.models import SMOLLM2_DIRNAME, load_smollm2

        folder = Path(ctx.cache_dir) / SMOLLM2_DIRNAME
        if not (folder / "config.json").exists():
            load_smollm2(ctx.cache_dir)  # converts the packaged GGUF into that folder
        return folder
    if Path(g.model).is_dir():
        return Path(g.model)
    folder = Path(ctx.cache_dir) / "initial-models" / g.run_id.hex()[:16]
    if not (folder / "config.json").exists():
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        ctx.initial_model().save_pretrained(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)  # atomic: a crash mid-save leaves no half folder behind
    return folder
