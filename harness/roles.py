"""Shared helpers for role tests: a tiny run context and an engine on its initial weights."""

from __future__ import annotations

from pathlib import Path

import torch

from node.genesis_file import make_genesis
from node.home import NodeHome
from node.roles.context import RunContext
from protocol import NodeKey

OWNER = NodeKey(b"\x21" * 32)
TRAINER = NodeKey(b"\x22" * 32)
VALIDATORS = [NodeKey(b"\x23" * 32), NodeKey(b"\x24" * 32)]
WORKERS = [NodeKey(b"\x25" * 32), NodeKey(b"\x26" * 32)]


def tiny_genesis(*, fields: dict | None = None, **config):
    """The tiny test run's signed genesis: ``config`` overrides the ``[config]`` table,
    ``fields`` the genesis fields (name, validators as keys, quorum, ...)."""
    cfg = {
        "task": "target-length",
        "max_tokens": 24,
        "temperature": 1.0,
        "seed": 0,
        "tiny_hidden_size": 64,
        "tiny_layers": 2,
        # in-process test networks share one interpreter: workers cap their batches per version
        # (the lock-step pace) unless a test asks for continuous generation (0)
        "worker_batches_per_version": 2,
    }
    cfg.update(config)
    run = {
        "name": "test",
        "model": "tiny",
        "dataset": "builtin:target-length",
        "dataset_size": 64,
        "trainer": TRAINER.peer_id,
        "validators": VALIDATORS,
        "quorum": 2,
        "max_async": 2,
        "prompts_per_batch": 2,
        "group_size": 4,
        "chunk_size": 1 << 20,
    }
    run.update(fields or {})
    run["validators"] = [v.peer_id for v in run["validators"]]
    return make_genesis(OWNER, cfg, **run)


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
