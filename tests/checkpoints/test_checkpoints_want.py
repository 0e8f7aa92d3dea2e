"""A role can ask for an older version than the newest (a validator verifying a batch
that claims it): the fetch runs beside the newest one and is not abandoned for it.

Found by the 25-minute soak (docs/benchmarks.md): a validator's fetch of v457 was
cancelled when v458 was announced and never resumed, so batches claiming v457 could
not be verified and, serially, blocked the validator's queue."""

from __future__ import annotations

import contextlib

import trio

from harness.checkpoints import RUN_ID, keys, make_checkpoint, same_files
from node.checkpoints import Checkpoints, ChunkStore, LocalControlPlane


@contextlib.asynccontextmanager
async def _running(tmp_path, versions, size_mib: float = 4, max_async: int = 2):
    """A seed holding ``versions`` and a fetcher that knows the seed; yields (node, announces, sources)."""
    trainer, seed, node = await _pair(tmp_path, max_async)
    srcs = {v: make_checkpoint(tmp_path / f"ckpt{v}", size_mib, seed=v) for v in versions}
    async with trio.open_nursery() as nursery:
        await nursery.start(seed.run)
        await nursery.start(node.run)
        raws = {v: await seed.import_version(trainer, v, srcs[v], chunk_size=1 << 20) for v in versions}
        node.add_peer(trainer.peer_id)
        yield node, raws, srcs
        nursery.cancel_scope.cancel()


async def _pair(tmp_path, max_async: int = 2):
    trainer, fetcher = keys(2)
    servers: dict = {}
    seed = Checkpoints(
        ChunkStore(tmp_path / "seed", RUN_ID, trainer.peer_id),
        LocalControlPlane(trainer.peer_id, servers),
        max_async=max_async,
    )
    node = Checkpoints(
        ChunkStore(tmp_path / "node", RUN_ID, trainer.peer_id),
        LocalControlPlane(fetcher.peer_id, servers),
        max_async=max_async,
    )
    servers[trainer.peer_id] = seed.server
    servers[fetcher.peer_id] = node.server
    return trainer, seed, node


async def test_wanted_older_version_is_fetched_beside_the_newest(tmp_path):
    async with _running(tmp_path, (1, 2)) as (node, raws, srcs):
        node.on_announce(raws[1])
        node.on_announce(raws[2])  # v1's fetch is abandoned for the newest ...
        with trio.fail_after(60):
            await node.wait_assembled(2)
        assert not node.store.get(1).assembled
        assert node.want_version(1)  # ... until a role asks for it
        with trio.fail_after(60):
            await node.wait_assembled(1)
    for v in (1, 2):
        assert same_files(srcs[v], node.store.files_dir(v))


async def test_wanted_fetch_survives_a_newer_announce(tmp_path):
    async with _running(tmp_path, (1, 2)) as (node, raws, _):
        node.on_announce(raws[1])
        assert node.want_version(1)
        node.on_announce(raws[2])
        assert 1 in node.fetchers or node.store.get(1).assembled  # not cancelled
        with trio.fail_after(60):
            await node.wait_assembled(1)
            await node.wait_assembled(2)


async def test_a_version_outside_the_window_is_not_wanted(tmp_path):
    async with _running(tmp_path, (1, 3), size_mib=1, max_async=1) as (node, raws, _):
        node.on_announce(raws[3])
        assert not node.want_version(1)  # 1 < 3 - max_async: the caller must not wait for it
        assert node.want_version(7)  # not announced yet: fetched as the newest once it is
        assert 7 not in node.fetchers
