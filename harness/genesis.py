"""Every genesis the tests and benchmarks build, from one builder.

A run is defined by its signed genesis, and tests and benchmarks need many small ones: a tiny
model's run for the role tests, the hostile bench's two runs, the fuzzers' seed file, runs
with one validator or a pinned model. They used to be written out in four places, each with
its own copy of the fields; now each is a preset of :func:`run_genesis`, which fills the
fields a small test run shares (:data:`TEST_FIELDS`), takes keys where the genesis wants peer
ids, and signs through ``node.genesis_file.make_genesis`` (so a typo in ``[config]`` is
refused here as it is by ``primenode run init``).

The network-only genesis of in-process nodes (no model, no ``[config]``) is
``node.p2p.testing.overlay_genesis``: ``NodeFactory`` in the node package builds it by
default, so it lives there; it is re-exported here so every builder is one import away.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from node.genesis_file import make_genesis, read_genesis, write_genesis
from node.p2p.testing import overlay_genesis
from protocol import NodeKey, SignedGenesis

__all__ = [
    "GARBAGE_RUN",
    "GARBAGE_VALIDATOR",
    "OWNER",
    "TEST_FIELDS",
    "TRAINER",
    "VALIDATORS",
    "WORKERS",
    "bench_genesis",
    "fuzz_genesis_toml",
    "garbage_genesis",
    "overlay_genesis",
    "run_genesis",
    "tiny_genesis",
]

# The role tests' fixed identities (harness/roles.py builds their homes).
OWNER = NodeKey(b"\x21" * 32)
TRAINER = NodeKey(b"\x22" * 32)
VALIDATORS = [NodeKey(b"\x23" * 32), NodeKey(b"\x24" * 32)]
WORKERS = [NodeKey(b"\x25" * 32), NodeKey(b"\x26" * 32)]

# The genesis fields a small test run shares; a preset or a call overrides any of them.
TEST_FIELDS: dict[str, Any] = {
    "name": "test",
    "model": "tiny",
    "dataset": "builtin:target-length",
    "dataset_size": 64,
    "quorum": 1,
    "max_async": 2,
    "prompts_per_batch": 2,
    "group_size": 4,
    "chunk_size": 1 << 20,
}


def run_genesis(
    owner: NodeKey,
    config: dict[str, Any] | None = None,
    *,
    trainer: NodeKey | None = None,
    validators: Sequence[NodeKey] | None = None,
    **fields: Any,
) -> SignedGenesis:
    """A signed genesis of a small test run: :data:`TEST_FIELDS` overridden by ``fields``,
    ``trainer`` and ``validators`` as keys (default: the owner alone), ``config`` the
    ``[config]`` table (checked as ``primenode run init`` checks it)."""
    trainer = trainer or owner
    run = {**TEST_FIELDS, **fields}
    run["trainer"] = trainer.peer_id
    run["validators"] = [v.peer_id for v in (validators if validators is not None else [trainer])]
    return make_genesis(owner, dict(config or {}), **run)


# ------------------------------------------------------------------ presets


def tiny_genesis(*, fields: dict | None = None, **config: Any) -> SignedGenesis:
    """The tiny test run of the role tests: ``config`` overrides the ``[config]`` table,
    ``fields`` the genesis fields (name, validators as keys, quorum, ...)."""
    cfg: dict[str, Any] = {
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
    run: dict[str, Any] = {"trainer": TRAINER, "validators": VALIDATORS, "quorum": 2, **(fields or {})}
    return run_genesis(OWNER, cfg, **run)


# bench/hostile.py scenario ``garbage``: node GARBAGE_VALIDATOR runs the real validator.
GARBAGE_VALIDATOR = 1
# Its run: a tiny Llama 384 wide and 6 layers deep, 96 tokens, so that a prefill is what a
# validator spends its time on (on one idle core: a garbage batch ~0.1-0.15 s, one group's
# prefill; an honest one ~0.3 s, every group's plus the sampling replay; producing one
# ~1.5 s), and as many batch slots per version as the bench needs (one version throughout:
# the slot rule's production rate is set out of the way).
GARBAGE_RUN: dict[str, Any] = {
    "task": "target-length",
    "max_tokens": 96,
    "temperature": 1.0,
    "seed": 0,
    "tiny_hidden_size": 384,
    "tiny_layers": 6,
    "worker_batches_per_version": 1_000_000,
}


def garbage_genesis(keys: list[NodeKey], created_ms: int) -> SignedGenesis:
    """The run of bench/hostile.py scenario ``garbage``: node 0 owner and trainer, node
    :data:`GARBAGE_VALIDATOR` the one validator."""
    return run_genesis(
        keys[0],
        GARBAGE_RUN,
        validators=[keys[GARBAGE_VALIDATOR]],
        name="hostile-bench-garbage",
        created_ms=created_ms,
    )


def bench_genesis(keys: list[NodeKey], created_ms: int) -> SignedGenesis:
    """The network-only run of bench/hostile.py's other scenarios: node 0 is owner, trainer
    (signs checkpoints) and the one genesis validator."""
    return overlay_genesis(
        owner=keys[0], trainer=keys[0], validators=[keys[0]], name="hostile-bench", created_ms=created_ms
    )


def fuzz_genesis_toml(config: dict[str, Any] | None = None) -> str:
    """The seed genesis file of the genesis fuzzers (the hypothesis suite and
    bench/fuzz_atheris.py): a small valid run signed by a fixed key, as TOML text."""
    owner = NodeKey(b"\x31" * 32)
    signed = run_genesis(
        owner,
        config if config is not None else {"steps": 3},
        name="fuzz",
        dataset="builtin:x",
        group_size=2,
    )
    with tempfile.TemporaryDirectory(prefix="fuzz-genesis-") as d:
        path = Path(d) / "genesis.toml"
        write_genesis(signed, path)
        assert read_genesis(path) == signed
        return path.read_text()
