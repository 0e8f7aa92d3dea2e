"""Garbage collection keeps exactly the versions within the max_async window (and pinned ones)."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from harness.checkpoints import RUN_ID, keys
from node.checkpoints import ChunkStore


def _publish(store, key, version, tmp_path, shared):
    d = tmp_path / f"ckpt{version}"
    d.mkdir()
    rng = np.random.default_rng(version)
    # one tensor changes every version, one never does (content addressing shares its chunks)
    save_file({"frozen": shared, "w": rng.standard_normal(100_000, dtype=np.float32)}, str(d / "model.safetensors"))
    save_file({"frozen": shared}, str(d / "frozen.safetensors"))
    _, raw = store.import_directory_blocking(key, version, d, chunk_size=64 * 1024)
    st, _ = store.add_announce(raw)
    store.assemble_blocking(st)
    st.assembled = True
    return st


@pytest.mark.parametrize("max_async", [0, 2])
def test_gc_keeps_exactly_the_window(tmp_path, max_async):
    trainer = keys(1)[0]
    store = ChunkStore(tmp_path / "store", RUN_ID, trainer.peer_id)
    shared = np.arange(50_000, dtype=np.float32)
    for v in range(1, 7):
        _publish(store, trainer, v, tmp_path, shared)
        store.gc(max_async)
        assert sorted(store.versions) == list(range(max(1, v - max_async), v + 1))

    kept = sorted(store.versions)
    assert kept == list(range(6 - max_async, 7))
    # disk agrees with the index: a dropped version's folder (its files, which are its chunks) is gone
    assert sorted(p.name for p in store.versions_dir.iterdir()) == sorted(st.dirname for st in store.versions.values())
    # after a restart the same versions are there, complete
    again = ChunkStore(tmp_path / "store", RUN_ID, trainer.peer_id)
    assert sorted(again.versions) == kept and all(st.complete and st.assembled for st in again.versions.values())


def test_gc_never_touches_a_pinned_version(tmp_path):
    trainer = keys(1)[0]
    store = ChunkStore(tmp_path / "store", RUN_ID, trainer.peer_id)
    shared = np.arange(50_000, dtype=np.float32)
    _publish(store, trainer, 1, tmp_path, shared)
    with store.open_version(1) as files:  # being loaded (or served)
        for v in range(2, 5):
            _publish(store, trainer, v, tmp_path, shared)
            assert 1 not in store.gc(2)
        assert sorted(store.versions) == [1, 2, 3, 4]
        assert all(p.exists() for p in files.values())
        st1 = store.get(1)
        assert all(len(store.read_chunk_blocking(st1, i)) == c[2] for i, c in enumerate(st1.chunks))
    assert store.gc(2) == [1]
    assert sorted(store.versions) == [2, 3, 4]
