"""Checkpoint manifests: build one from a directory, sign it as the trainer, verify it.

A manifest travels inside the trainer's signed ``CheckpointAnnounce`` envelope.
Nodes keep that envelope byte for byte, so a restarted node re-checks the
trainer's signature from disk instead of trusting its own files.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import node.util
from protocol import (
    CheckpointAnnounce,
    CheckpointManifest,
    DeltaRef,
    Envelope,
    FileEntry,
    NodeKey,
    ProtocolError,
    ReplayGuard,
    open_envelope,
    seal,
)

DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024


def checkpoint_files(src_dir: Path | str) -> list[tuple[str, Path]]:
    """Regular files under ``src_dir`` as (relative posix path, absolute path), sorted."""
    root = Path(src_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            rel = p.relative_to(root).as_posix()
            if any(part.startswith(".") for part in rel.split("/")):
                continue  # editor droppings, temp files
            out.append((rel, p))
    if not out:
        raise FileNotFoundError(f"{root} holds no files")
    return out


def build_manifest(
    run_id: bytes,
    version: int,
    src_dir: Path | str,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    created_ms: int | None = None,
    on_chunk: Callable[[bytes, memoryview], None] | None = None,
    delta: DeltaRef | None = None,
) -> CheckpointManifest:
    """Cut every file of ``src_dir`` into ``chunk_size`` pieces and hash them (``delta``:
    the files are a delta against that base, see protocol/delta.py).

    ``on_chunk(sha256, data)`` sees every chunk as it is read (the store uses it
    to import the chunks in the same pass). Blocking: call it from a thread.
    """
    files = []
    buf = bytearray(chunk_size)
    view = memoryview(buf)
    for rel, path in checkpoint_files(src_dir):
        size = path.stat().st_size
        hashes = []
        with open(path, "rb", buffering=0) as f:
            done = 0
            while done < size:
                want = min(chunk_size, size - done)
                got = 0
                while got < want:
                    n = f.readinto(view[got:want])
                    if not n:
                        raise OSError(f"{path} shrank while being read")
                    got += n
                h = hashlib.sha256(view[:want]).digest()
                hashes.append(h)
                if on_chunk is not None:
                    on_chunk(h, view[:want])
                done += want
        files.append(FileEntry(path=rel, size=size, chunk_hashes=tuple(hashes)))
    files_t = tuple(files)
    return CheckpointManifest(
        run_id=run_id,
        version=version,
        chunk_size=chunk_size,
        files=files_t,
        created_ms=node.util.now_ms() if created_ms is None else created_ms,
        root=CheckpointManifest.compute_root(run_id, version, chunk_size, files_t, delta),
        delta=delta,
    )


def sign_announce(
    key: NodeKey, manifest: CheckpointManifest, seq: int | None = None, now_ms: int | None = None
) -> bytes:
    """The trainer's signed ``CheckpointAnnounce`` envelope for ``manifest``."""
    when = node.util.now_ms() if now_ms is None else now_ms
    seq = time.time_ns() if seq is None else seq
    return seal(key, manifest.run_id, CheckpointAnnounce(manifest=manifest), when, seq)


def accept_announce(env: Envelope[Any], run_id: bytes, trainer: str) -> CheckpointManifest:
    """Check an opened envelope: a CheckpointAnnounce of this run, signed by the trainer."""
    if not isinstance(env.body, CheckpointAnnounce):
        raise ProtocolError("envelope.type", "not a CheckpointAnnounce")
    if env.sender != trainer:
        raise ProtocolError("manifest.signer", f"manifest signed by {env.sender}, not by the run's trainer")
    m = env.body.manifest
    if m.run_id != run_id or env.run_id != run_id:
        raise ProtocolError("run_id", "manifest belongs to another run")
    return m


def verify_announce(
    raw: bytes,
    run_id: bytes,
    trainer: str,
    now_ms: int | None = None,
    guard: ReplayGuard | None = None,
) -> tuple[CheckpointManifest, Envelope[Any]]:
    """Open and check announce envelope bytes; raise ProtocolError if anything is off.

    ``guard=None`` skips the timestamp/replay checks (re-reading stored bytes).
    """
    env = open_envelope(
        raw,
        run_id=run_id,
        now_ms=node.util.now_ms() if now_ms is None else now_ms,
        guard=guard,
        allowed_types={CheckpointAnnounce.TYPE_ID},
    )
    return accept_announce(env, run_id, trainer), env
