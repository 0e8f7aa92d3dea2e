"""kill -9 in the middle of applying a delta: the last good version stays loadable, the
half-written result is never taken for the new version, and the restarted node applies
the delta again to the exact bytes.

The child process applies version 1 (a delta on version 0) in a real node store and
stops after the first block of the weights file, telling the parent on stdout; the parent kills it
there with SIGKILL, so the kill lands mid-apply every time (no timing guess)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import trio

from harness.checkpoints import RUN_ID, keys
from harness.deltas import equal_dirs, make_versions
from node.checkpoints import Checkpoints, ChunkStore, LocalControlPlane

REPO = Path(__file__).resolve().parents[2]
CHUNK = 64 * 1024

# The child writes one chunk at a time (an apply writes blocks of up to 4 MiB, and these
# test weights are smaller than one), so its pause after the first chunk is mid-file.
CHILD = """
import sys
from node.checkpoints import ChunkStore, delta

delta.WRITE_BLOCK = 1

store = ChunkStore(sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3])
def pause(path, index):
    if path == "model.safetensors":
        print("wrote", path, index, flush=True)
        sys.stdin.readline()  # the parent kills us while we wait here
store.assemble_blocking(store.versions[1], store.versions[0], on_block=pause)
print("done", flush=True)
"""


async def _publish_two(tmp_path: Path, srcs: list[Path]) -> ChunkStore:
    """The trainer's store with version 0 (anchor) and 1 (delta on 0)."""
    trainer = keys(1)[0]
    store = ChunkStore(tmp_path / "trainer", RUN_ID, trainer.peer_id, durable=False)
    c = Checkpoints(store, LocalControlPlane(trainer.peer_id, {}))
    async with trio.open_nursery() as nursery:
        await nursery.start(c.run)
        await c.import_version(trainer, 0, srcs[0], CHUNK)
        await c.import_version(trainer, 1, srcs[1], CHUNK, delta_base=0)
        nursery.cancel_scope.cancel()
    assert store.get(1).delta is not None
    return store


def _copy_versions(src: ChunkStore, dst: ChunkStore) -> None:
    """The node received both versions' chunks (as its fetcher would have stored them)."""
    for v in (0, 1):
        st = src.get(v)
        dst.add_announce(st.raw)
        for h in st.by_hash:
            dst.write_object_blocking(h, src.read_object_blocking(h))
            dst.mark_held(h)


async def _reapply(store: ChunkStore) -> Checkpoints:
    """A node restarted on ``store``: it finishes what was complete but not assembled."""
    node = Checkpoints(store, LocalControlPlane("restarted", {}))
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        with trio.fail_after(30):
            assert await node.wait_outcome(1) is None
        nursery.cancel_scope.cancel()
    return node


def test_kill_9_mid_apply_leaves_the_last_good_version_loadable(tmp_path):
    srcs = make_versions(tmp_path / "src", 2, seed=7, frac=0.05)
    trainer_store = trio.run(_publish_two, tmp_path, srcs)
    home = tmp_path / "node"
    store = ChunkStore(home, RUN_ID, trainer_store.trainer)
    _copy_versions(trainer_store, store)
    store.assemble_blocking(store.versions[0])
    store.versions[0].assembled = True
    assert store.versions[1].complete and not store.versions[1].assembled

    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(home), RUN_ID.hex(), trainer_store.trainer],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        text=True,
    )
    try:
        line = child.stdout.readline()
        assert line.startswith("wrote"), f"the child did not reach the first block: {line!r}"
        vdir = home / "versions" / store.versions[1].dirname
        partial = vdir / "files.tmp" / "model.safetensors"
        assert partial.exists() and partial.read_bytes() != (srcs[1] / "model.safetensors").read_bytes()
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL

    # restart: version 0 is loadable and exact; version 1 is not taken as assembled
    store = ChunkStore(home, RUN_ID, trainer_store.trainer)
    assert store.versions[0].assembled and not store.versions[1].assembled
    assert not (vdir / "files").exists() and not (vdir / "files.tmp").exists()
    with store.open_version(0) as files:
        assert equal_dirs(srcs[0], files["model.safetensors"].parent)
    # the restarted node applies the delta again, to the trainer's exact bytes
    node = trio.run(_reapply, store)
    with node.open_version(1) as files:
        assert equal_dirs(srcs[1], files["model.safetensors"].parent)
