"""Shared helpers for the checkpoint-distribution tests (tests/checkpoints/)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from protocol import NodeKey

RUN_ID = hashlib.sha256(b"distribution-test-run").digest()


def make_checkpoint(dirpath: Path, size_mib: float, seed: int = 0, files: int = 2) -> Path:
    """Random float32 tensors in ``files`` safetensors files, ~``size_mib`` MiB in all."""
    dirpath.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_file = int(size_mib * 2**20 / files / 4)
    for f in range(files):
        tensors = {}
        left = per_file
        t = 0
        while left > 0:
            n = min(left, 3 * 2**20 // 4 + 1234 * t)  # odd sizes: chunk borders inside tensors
            tensors[f"layer{t}.weight"] = rng.standard_normal(n, dtype=np.float32)
            left -= n
            t += 1
        save_file(tensors, str(dirpath / f"model-{f:05d}.safetensors"))
    return dirpath


def keys(n: int) -> list[NodeKey]:
    return [NodeKey(hashlib.sha256(b"dist-key-%d" % i).digest()) for i in range(n)]


def same_files(a: Path, b: Path) -> bool:
    fa = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return fa == fb and all((a / p).read_bytes() == (b / p).read_bytes() for p in fa)
