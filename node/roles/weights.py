"""Policy weights as state dicts: read from a version's assembled files (cached by version) and
exported by the trainer as the files a version is made of."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any, Protocol

import trio

from node.checkpoints import Checkpoints, ChunkStore


class HoldsCheckpoints(Protocol):
    """What the cache reads a version through: the role's store and its checkpoints (None
    before the role started)."""

    store: ChunkStore
    checkpoints: Checkpoints | None


class WeightCache:
    """Policy weights (state dicts) by version, loaded from the assembled checkpoint files."""

    def __init__(self, role: HoldsCheckpoints, capacity: int) -> None:
        self.role = role
        self.capacity = capacity
        self._cache: collections.OrderedDict[int, dict] = collections.OrderedDict()
        self._loading: dict[int, trio.Event] = {}  # versions being read right now

    def held(self, version: int) -> bool:
        st = self.role.store.get(version)
        return version in self._cache or (st is not None and st.assembled)

    async def get(self, version: int) -> dict:
        while version in self._loading:  # another task is reading it (a worker's read-ahead): share
            await self._loading[version].wait()
        if version in self._cache:
            self._cache.move_to_end(version)
            return self._cache[version]
        done = self._loading[version] = trio.Event()
        checkpoints = self.role.checkpoints
        assert checkpoints is not None, "the role has not started"
        try:
            with checkpoints.open_version(version) as files:
                state = await trio.to_thread.run_sync(load_state_dict, files)
        finally:
            del self._loading[version]
            done.set()
        self._cache[version] = state
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return state


def load_state_dict(files: dict[str, Path]) -> dict:
    from safetensors.torch import load_file

    state: dict = {}
    for name, path in sorted(files.items()):
        if name.endswith(".safetensors"):
            state.update(load_file(str(path)))
    if not state:
        raise RuntimeError("checkpoint holds no safetensors files")
    return state


def export_weights(model, out_dir: Path, dtype: Any = None) -> Path:
    """Write only what workers need (safetensors weights + config), never optimizer state.
    ``dtype`` (the run's policy dtype, a ``torch.dtype``): floating-point tensors are published
    in it, whatever the trainer's master weights are (fp32); None keeps them as they are."""
    import shutil

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no tqdm bars in node logs
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    state = None
    if dtype is not None and any(p.dtype != dtype for p in model.parameters()):
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    model.save_pretrained(tmp, safe_serialization=True, state_dict=state)
    if state is not None:  # config.json names the dtype the weights are in
        import json

        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["torch_dtype" if "torch_dtype" in cfg else "dtype"] = str(dtype).removeprefix("torch.")
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir
