"""Factories for the sparse-delta tests (tests/checkpoints/test_checkpoints_delta*.py): a run of
checkpoint versions where each changes a small share of its elements, as an RL step
does after the cast to bf16, and a trainer-signed delta nobody honest would publish."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from node.checkpoints import ChunkStore, build_manifest, sign_announce
from protocol import DeltaRef, NodeKey
from protocol.delta import DELTA_FILE

# name -> (shape, dtype): bf16 weights as the run's dtype, an fp32 norm, a frozen tensor
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "embed.weight": ((512, 96), torch.bfloat16),
    "layer0.proj.weight": ((96, 384), torch.bfloat16),
    "layer1.proj.weight": ((384, 96), torch.bfloat16),
    "norm.weight": ((96,), torch.float32),
    "frozen.bias": ((1000,), torch.float32),
}


def random_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g).to(dt) for k, (shape, dt) in SHAPES.items()}


def step(state: dict[str, torch.Tensor], seed: int, frac: float) -> dict[str, torch.Tensor]:
    """A new version: ``frac`` of the elements of every tensor but the frozen one nudged
    (in fp32, then cast back, so most nudges of a bf16 weight change its bits)."""
    g = torch.Generator().manual_seed(10_000 + seed)
    out = {}
    for k, t in state.items():
        t = t.clone()
        if not k.startswith("frozen"):
            mask = torch.rand(t.shape, generator=g) < frac
            upd = t.float() + mask * torch.randn(t.shape, generator=g) * 0.05
            t = upd.to(t.dtype)
        out[k] = t
    return out


def write_version(dirpath: Path, state: dict[str, torch.Tensor]) -> Path:
    """Files as the trainer exports them: one safetensors file and a config."""
    if dirpath.exists():
        shutil.rmtree(dirpath)
    dirpath.mkdir(parents=True)
    save_file(state, str(dirpath / "model.safetensors"), metadata={"format": "pt"})
    (dirpath / "config.json").write_text(json.dumps({"model_type": "toy", "hidden": 96}))
    return dirpath


def make_versions(root: Path, n: int, seed: int = 0, frac: float = 0.01) -> list[Path]:
    """``n`` exported versions under ``root/v<i>``, each a sparse step from the one before."""
    state = random_state(seed)
    out = []
    for v in range(n):
        if v:
            state = step(state, seed * 1000 + v, frac)
        out.append(write_version(root / f"v{v}", state))
    return out


def forge_delta(
    store: ChunkStore, key: NodeKey, version: int, data: bytes, ref: DeltaRef, chunk_size: int, scratch: Path
) -> bytes:
    """A trainer-signed delta version with the delta file ``data`` and delta fields ``ref``,
    whatever they say; its chunks are put into ``store`` (which then serves them) and the
    announce returned. What a buggy or hostile trainer could publish."""
    d = scratch / f"forged-{version}"
    d.mkdir(parents=True)
    (d / DELTA_FILE).write_bytes(data)
    chunks: list[tuple[bytes, bytes]] = []
    m = build_manifest(
        store.run_id, version, d, chunk_size, on_chunk=lambda h, c: chunks.append((h, bytes(c))), delta=ref
    )
    raw = sign_announce(key, m)
    store.add_announce(raw)  # first: the store writes a chunk in place in a version it knows
    for h, c in chunks:
        store.write_object_blocking(h, c)
        store.mark_held(h)
    return raw


def equal_dirs(a: Path, b: Path) -> bool:
    fa = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return fa == fb and all((a / p).read_bytes() == (b / p).read_bytes() for p in fa)


def bits(t: torch.Tensor) -> np.ndarray:
    """The bit patterns of a tensor (to compare NaN payloads and -0.0 exactly)."""
    size = t.element_size()
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[size]).numpy().copy()
