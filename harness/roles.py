"""Shared helpers for role tests: a tiny run context, an engine on its initial weights, node
homes (the tiny run's genesis and keys: ``harness/genesis.py``)."""

from __future__ import annotations

from pathlib import Path

import torch

from harness.genesis import tiny_genesis
from node.home import NodeHome
from node.roles.context import RunContext


def tiny_context(tmp_path: Path, *, fields: dict | None = None, **config) -> RunContext:
    torch.set_num_threads(1)
    return RunContext.from_genesis(tiny_genesis(fields=fields, **config).genesis, tmp_path)


def engine_for(ctx: RunContext, model=None):
    from node.engines.transformers_engine import TransformersEngine

    model = model or ctx.initial_model()
    return TransformersEngine(model, eos_token_id=ctx.eos_token_id, pad_token_id=ctx.pad_token_id)


def homes(tmp_path: Path, name: str) -> NodeHome:
    """A node home folder for one in-process role (no key: roles get theirs from the test)."""
    h = NodeHome(tmp_path / name)
    h.path.mkdir(parents=True, exist_ok=True)
    return h
