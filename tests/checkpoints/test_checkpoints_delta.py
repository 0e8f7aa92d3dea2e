"""Sparse-delta checkpoints: bit-exact encode/apply, chains of versions through the
swarm (stores, chunk servers and fetchers over real TCP, tickets in-process), and the
deltas a node must refuse. The late joiner over real libp2p hosts is in
test_checkpoints_delta_swarm.py, kill -9 mid-apply in test_checkpoints_delta_crash.py.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from harness.checkpoints import RUN_ID, keys
from harness.deltas import SHAPES, bits, equal_dirs, forge_delta, make_versions, random_state, write_version
from node.checkpoints import Checkpoints, ChunkStore, LocalControlPlane
from node.checkpoints.delta import DeltaIncompatible, apply_delta, encode_delta, iter_changes
from node.checkpoints.server import ChunkServer
from node.checkpoints.store import DELTA_MIN_CHUNK, DELTA_MIN_CHUNKS, delta_chunk_size
from node.checkpoints.wire import send_all
from node.p2p.testing import wait_until
from node.roles.checkpoint_wiring import delta_base_for
from protocol import DeltaRef, ProtocolError, sha256
from protocol import chunk_frames as F
from protocol.delta import BINS, DELTA_FILE, ENC_DENSE, ENC_SPARSE, SEGMENT, parse_delta

CHUNK = 64 * 1024

# ------------------------------------------------------------------ encode / apply


def _files(d: Path) -> dict[str, Path]:
    return {p.name: p for p in d.iterdir()}


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    numel=st.integers(1, 3000),
    density=st.sampled_from([0.0, 0.001, 0.02, 0.3, 0.97, 1.0]),
    small_moves=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_apply_of_encode_is_the_new_version_bit_for_bit(dtype, numel, density, small_moves, seed):
    """Any bit patterns (NaN payloads, -0.0, infinities, wrap-around of the difference
    included), any share changed; or what an optimizer step does: moves of a few units in
    the last place."""
    rng = np.random.default_rng(seed)
    signed = {torch.float32: np.int32, torch.bfloat16: np.int16}[dtype]
    info = np.iinfo(signed)
    old = rng.integers(info.min, info.max, size=numel, endpoint=True, dtype=signed)
    new = old.copy()
    mask = rng.random(numel) < density
    if small_moves:
        new[mask] = old[mask] + rng.integers(-3, 4, size=int(mask.sum())).astype(signed)  # may wrap
    else:
        new[mask] = rng.integers(info.min, info.max, size=int(mask.sum()), endpoint=True, dtype=signed)
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        for name, arr in (("a", old), ("b", new)):
            (t / name).mkdir()
            tensors = {"w": torch.from_numpy(arr.copy()).view(dtype), "z": torch.zeros(3)}
            save_file(tensors, str(t / name / "m.safetensors"))
        data, stats = encode_delta(_files(t / "a"), _files(t / "b"))
        apply_delta(_files(t / "a"), data, t / "out", chunk_size=4096, durable=False)
        assert (t / "out" / "m.safetensors").read_bytes() == (t / "b" / "m.safetensors").read_bytes()
        decoded = list(iter_changes(data, _files(t / "a")))
    changed = np.flatnonzero(old != new)
    assert stats.changed == len(changed)
    if not len(changed):
        assert decoded == []
        return
    (c,) = decoded
    assert c.name == "w"
    if c.positions is None:  # dense: every element carried
        assert np.array_equal(c.values.view(signed), new)
    else:
        assert np.array_equal(np.sort(c.positions), changed)  # decode order: segment, bin, index
        assert np.array_equal(c.values.view(signed), new[c.positions])


def test_an_optimizer_step_over_several_segments_is_small_and_exact(tmp_path):
    """What the format is for: fp32 master weights moved by about lr, cast to bf16, in a
    tensor spanning two position segments (protocol.delta.SEGMENT). Exact, sparse, and
    far under the new bit patterns' size: values as differences, positions by exponent."""
    g = torch.Generator().manual_seed(7)
    n = SEGMENT + 12345
    master = torch.randn(n, generator=g) * 0.02
    move = 1e-5 * torch.sign(torch.randn(n, generator=g))
    a = write_version(tmp_path / "a", {"w": master.to(torch.bfloat16)})
    b = write_version(tmp_path / "b", {"w": (master + move).to(torch.bfloat16)})
    data, stats = encode_delta(_files(a), _files(b))
    (rec,) = parse_delta(data)
    assert rec.encoding == ENC_SPARSE and 0.01 < stats.changed_fraction < 0.5
    # a plain bitmap alone would be n / 8 bytes; the new bf16 bits 2 bytes per change
    assert stats.delta_bytes < 0.5 * (n / 8 + 2 * stats.changed)
    apply_delta(_files(a), data, tmp_path / "out", chunk_size=CHUNK, durable=False)
    assert equal_dirs(b, tmp_path / "out")
    (c,) = iter_changes(data, _files(a))
    old = load_file(str(a / "model.safetensors"))["w"].view(torch.int16).numpy()
    new = load_file(str(b / "model.safetensors"))["w"].view(torch.int16).numpy()
    assert c.positions is not None and np.array_equal(np.sort(c.positions), np.flatnonzero(old != new))
    assert np.array_equal(c.values.view(np.int16), new[c.positions])
    # the exponent classes present were merged into the encoder's few bins (one pass each
    # for the receiver), by change rate: the classes changing most and least are apart
    import zstandard

    from node.checkpoints.delta import ENCODE_BINS

    table = np.frombuffer(zstandard.ZstdDecompressor().decompress(rec.payload)[:256], dtype=np.uint8)
    present = np.unique((old.view(np.uint16) >> 7) & 0xFF)
    assert len(present) > ENCODE_BINS and len(np.unique(table[present])) == ENCODE_BINS
    cls = (old.view(np.uint16) >> 7) & 0xFF
    rate = np.bincount(cls[old != new], minlength=256)[present] / np.bincount(cls, minlength=256)[present]
    assert table[present[np.argmax(rate)]] != table[present[np.argmin(rate)]]


@pytest.mark.parametrize(
    ("direct", "workers", "chunk"),
    [(True, 1, 64 * 4096), (True, 3, 64 * 4096), (False, 2, 64 * 4096), (True, 2, 3 * 4096), (False, 1, 3 * 4096)],
)
def test_one_pass_apply_hashes_every_chunk_as_the_anchor_manifest_would(tmp_path, direct, workers, chunk):
    """apply_delta streams the base once: unchanged tensors and the header copied, changed
    ones decoded a segment at a time (on ``workers`` threads, fed on in file order), chunks
    hashed and written on other threads. Its chunk hashes must be what build_manifest
    gives for the new version's files, chunk by chunk in order, whatever the chunk size
    against tensors and segments (an odd size cuts tensors, segments and the header across
    chunks), with O_DIRECT writes or not, on one decoding thread or several; ``on_block``
    sees every chunk once, after it was written. Chunks are hashed and written in blocks of
    several (``WRITE_BLOCK``): a chunk size that does not divide the block (3 x 4096) leaves
    a short last block."""
    from node.checkpoints import build_manifest

    g = torch.Generator().manual_seed(11)
    n = SEGMENT + 777  # a sparse tensor spanning two segments
    master = torch.randn(n, generator=g) * 0.02
    before = {
        "a.big": master.to(torch.bfloat16),
        "b.same": torch.randn(5000, generator=g),  # unchanged, between changed tensors
        "c.dense": torch.randn(3000, generator=g),  # every element changes: ENC_DENSE
        "d.small": torch.randn(999, generator=g).to(torch.bfloat16),
    }
    after = dict(before)
    after["a.big"] = (master + 1e-5 * torch.sign(torch.randn(n, generator=g))).to(torch.bfloat16)
    after["c.dense"] = before["c.dense"] + 1.0
    d_small = before["d.small"].clone()
    d_small[::7] += 0.5
    after["d.small"] = d_small
    a = write_version(tmp_path / "a", before)
    b = write_version(tmp_path / "b", after)
    data, _ = encode_delta(_files(a), _files(b))
    assert {(r.name, r.encoding) for r in parse_delta(data)} == {
        ("a.big", ENC_SPARSE),
        ("c.dense", ENC_DENSE),
        ("d.small", ENC_SPARSE),
    }
    seen: list[tuple[str, int]] = []
    hashes = apply_delta(
        _files(a),
        data,
        tmp_path / "out",
        chunk_size=chunk,
        durable=False,
        direct=direct,
        on_block=lambda p, i: seen.append((p, i)),
        workers=workers,
    )
    assert equal_dirs(b, tmp_path / "out")
    want = build_manifest(RUN_ID, 1, b, chunk, created_ms=0)
    assert {f.path: list(f.chunk_hashes) for f in want.files} == hashes
    # every chunk reported once after its write (two writing threads: not necessarily in order)
    assert sorted(seen) == [
        (f.path, i) for f in sorted(want.files, key=lambda f: f.path) for i in range(len(f.chunk_hashes))
    ]
    # the control: a delta from another base rebuilds other bytes, and other hashes
    other = write_version(tmp_path / "o", {**before, "b.same": before["b.same"] + 1})
    wrong = apply_delta(_files(other), data, tmp_path / "out2", chunk_size=chunk, durable=False, direct=direct)
    assert wrong != hashes


def test_structure_change_cannot_be_a_delta(tmp_path):
    a = write_version(tmp_path / "a", random_state(0))
    grown = {**random_state(0), "extra": torch.zeros(4)}
    b = write_version(tmp_path / "b", grown)
    with pytest.raises(DeltaIncompatible, match="size changed"):
        encode_delta(_files(a), _files(b))
    renamed = random_state(0)
    renamed["norX.weight"] = renamed.pop("norm.weight")  # same file size, another header
    r = write_version(tmp_path / "r", renamed)
    with pytest.raises(DeltaIncompatible, match="header changed"):
        encode_delta(_files(a), _files(r))
    c = write_version(tmp_path / "c", random_state(0))
    (c / "config.json").write_text("{}")
    with pytest.raises(DeltaIncompatible, match=r"config\.json changed"):
        encode_delta(_files(a), _files(c))


def test_a_delta_is_cut_into_enough_chunks_for_the_swarm_to_pass_on():
    """A receiver re-serves only whole chunks, so a delta is cut into at least
    DELTA_MIN_CHUNKS of them: the largest power of two doing so, within the run's chunk
    size and not under DELTA_MIN_CHUNK."""
    for delta_bytes in [1, 1000, 300_000, 5_129_845, 20 << 20, 1 << 30]:
        for cs in [64 << 10, 1 << 20, 4 << 20]:
            d = delta_chunk_size(delta_bytes, cs)
            floor = min(DELTA_MIN_CHUNK, cs)
            assert d & (d - 1) == 0 and floor <= d <= cs
            if floor < d < cs:
                assert delta_bytes // d >= DELTA_MIN_CHUNKS > delta_bytes // (2 * d)
            elif d == cs and cs > floor:
                assert delta_bytes // d >= DELTA_MIN_CHUNKS
    # SmolLM2-135M's step at lr 3e-6 (5.1 MB): 20 chunks of 256 KiB instead of 2 of 4 MiB
    assert delta_chunk_size(5_129_845, 4 << 20) == 256 << 10


def test_a_sparse_bf16_step_is_a_small_fraction_of_the_checkpoint(tmp_path):
    v0, v1 = make_versions(tmp_path, 2, frac=0.01)
    data, stats = encode_delta(_files(v0), _files(v1))
    assert stats.full_bytes == sum(p.stat().st_size for p in v1.iterdir())
    assert 0.005 < stats.changed_fraction < 0.02
    assert stats.delta_bytes < stats.full_bytes / 15  # positions + 2-byte values, compressed
    names = {r.name for r in parse_delta(data)}
    assert "frozen.bias" not in names and "embed.weight" in names  # unchanged tensors are absent


# ------------------------------------------------------------------ swarm


class Swarm:
    """A trainer and followers in one process: chunk servers over real TCP, LocalControlPlane."""

    def __init__(self, tmp: Path, n: int, *, max_async: int = 2) -> None:
        self.keys = keys(n)
        self.servers: dict = {}
        self.overlays: dict = {}
        self.nodes: list[Checkpoints] = []
        for i, k in enumerate(self.keys):
            store = ChunkStore(tmp / f"node{i}", RUN_ID, self.keys[0].peer_id, durable=False)
            self.overlays[k.peer_id] = LocalControlPlane(k.peer_id, self.servers)
            c = Checkpoints(store, self.overlays[k.peer_id], max_async=max_async)
            self.servers[k.peer_id] = c.server
            self.nodes.append(c)

    @property
    def trainer(self) -> Checkpoints:
        return self.nodes[0]

    async def start(self, nursery: trio.Nursery) -> None:
        for c in self.nodes:
            await nursery.start(c.run)

    def link(self, i: int, peers: list[int]) -> None:
        for j in peers:
            self.nodes[i].add_peer(self.keys[j].peer_id)

    async def publish(self, version: int, src: Path, anchor_every: int, **kw) -> bytes:
        base = delta_base_for(self.trainer, version, anchor_every)
        return await self.trainer.import_version(self.keys[0], version, src, CHUNK, delta_base=base, **kw)


async def test_chain_of_deltas_rebuilds_every_version_and_a_late_joiner_catches_up_from_peers(tmp_path):
    srcs = make_versions(tmp_path / "src", 8, seed=1)
    sw = Swarm(tmp_path, 4)
    sw.link(1, [0, 2])
    sw.link(2, [0, 1])
    sw.link(3, [1, 2])  # the late joiner never asks the trainer
    rebuilt: dict[int, bool] = {}
    async with trio.open_nursery() as nursery:
        await sw.start(nursery)
        for v, src in enumerate(srcs):
            raw = await sw.publish(v, src, anchor_every=4)
            for follower in sw.nodes[1:3]:
                follower.on_announce(raw)
            with trio.fail_after(60):
                for follower in sw.nodes[1:3]:
                    await follower.wait_assembled(v)
            for follower in sw.nodes[1:3]:
                with follower.open_version(v) as files:
                    rebuilt[v] = rebuilt.get(v, True) and equal_dirs(src, next(iter(files.values())).parent)
        # the late joiner hears only the newest announce; the chain comes from peers 1 and 2
        sw.nodes[3].on_announce(raw)
        with trio.fail_after(60):
            await sw.nodes[3].wait_assembled(7)
        nursery.cancel_scope.cancel()
    assert rebuilt == dict.fromkeys(range(8), True)
    kinds = [sw.trainer.store.get(v) for v in range(8) if sw.trainer.store.get(v) is not None]
    assert [s.delta is None for s in kinds] == [True, False, False, False]  # 4 (anchor) .. 7 kept
    for follower in sw.nodes[1:]:
        assert follower.deltas_applied >= 3
    late = sw.nodes[3]
    with late.open_version(7) as files:
        assert equal_dirs(srcs[7], next(iter(files.values())).parent)
    # it fetched the anchor (4) and the deltas 5..7, from the followers only
    assert sorted(late.store.versions) == [4, 5, 6, 7]
    assert late.store.get(4).delta is None
    trainer_id = sw.keys[0].peer_id
    assert all(trainer_id not in h.get("fed_from", []) for h in late.fetch_history.values())
    # GC: versions behind the window are gone except the chain back to the anchor, whose
    # chunks stay (to serve late joiners) while its full files go once 5 is applied
    f1 = sw.nodes[1]
    assert sorted(f1.store.versions) == [4, 5, 6, 7]
    assert not f1.store.get(4).assembled and f1.store.get(4).complete
    assert f1.store.get(7).assembled


def _delta_between(a: Path, b: Path) -> bytes:
    return encode_delta(_files(a), _files(b))[0]


async def _two_nodes_at_v0(tmp_path, nursery, srcs):
    sw = Swarm(tmp_path, 2)
    sw.link(1, [0])
    await sw.start(nursery)
    raw = await sw.publish(0, srcs[0], anchor_every=10)
    sw.nodes[1].on_announce(raw)
    with trio.fail_after(30):
        await sw.nodes[1].wait_assembled(0)
    return sw


async def test_delta_changes_decode_against_the_base_the_engine_holds(tmp_path):
    """What a role's in-place load gets: the changes of v1 on exactly v0, decoded against
    v0's files (format 2 codes them against the base). Another base, or a base whose files
    are gone: None, and the role does a full load."""
    srcs = make_versions(tmp_path / "src", 2, seed=4)
    async with trio.open_nursery() as nursery:
        sw = await _two_nodes_at_v0(tmp_path, nursery, srcs)
        raw = await sw.publish(1, srcs[1], anchor_every=10)
        f = sw.nodes[1]
        f.on_announce(raw)
        with trio.fail_after(30):
            await f.wait_assembled(1)
        changes = await f.delta_changes(1, 0)
        records = await f.delta_changes(1, 0, values=False)  # what the vLLM engine asks: names, checked
        assert await f.delta_changes(1, 1) is None
        base = f.store.get(0)
        base.assembled = False  # as after GC dropped the base's files
        assert await f.delta_changes(1, 0) is None
        base.assembled = True
        nursery.cancel_scope.cancel()
    assert changes
    assert records is not None and [(r.path, r.name) for r in records] == [(c.path, c.name) for c in changes]
    old = load_file(str(srcs[0] / "model.safetensors"))
    new = load_file(str(srcs[1] / "model.safetensors"))
    for c in changes:
        got = bits(old[c.name]).reshape(-1).copy()
        if c.positions is None:
            got[:] = c.values.view(got.dtype)
        else:
            got[c.positions] = c.values.view(got.dtype)
        assert np.array_equal(got, bits(new[c.name]).reshape(-1)), c.name
    assert {c.name for c in changes} == {k for k in new if not np.array_equal(bits(old[k]), bits(new[k]))}


async def test_delta_changes_follow_a_chain_of_deltas_and_stop_at_an_anchor(tmp_path):
    """A validator on a committee replays only some versions: its engine holds v1 (or v0,
    behind the window) when it needs v3. With v1..v3 each a delta on the one before, it still
    moves in place: decoded changes of every link in order (applied one after another they
    give v3's bits; they need the engine's version's files), or one record per changed tensor
    (read whole from v3's files; no base files needed, so from v0 too). Control: across an
    anchor (v4, a full version) there is no chain, and the role does a full load."""
    srcs = make_versions(tmp_path / "src", 6, seed=7)
    async with trio.open_nursery() as nursery:
        sw = await _two_nodes_at_v0(tmp_path, nursery, srcs)
        f = sw.nodes[1]

        async def publish(v: int) -> None:
            f.on_announce(await sw.publish(v, srcs[v], anchor_every=4))  # v4 is an anchor
            with trio.fail_after(30):
                await f.wait_assembled(v)

        for v in range(1, 4):
            await publish(v)
        assert [st.version for st in f.delta_chain(3, 1)] == [2, 3]
        assert [st.version for st in f.delta_chain(3, 0, base_files=False)] == [1, 2, 3]
        changes = await f.delta_changes(3, 1)
        records = await f.delta_changes(3, 0, values=False)
        assert f.delta_chain(2, 3) is None and f.delta_chain(3, 3) is None  # never backwards, nor in place
        for v in (4, 5):
            await publish(v)
        # v1 and v2 are behind the window now: GC released their full files, not their deltas
        assert not f.store.get(1).assembled and not f.store.get(2).assembled
        assert [st.version for st in f.delta_chain(3, 0, base_files=False)] == [1, 2, 3]
        assert await f.delta_changes(3, 0, values=False) == records
        assert f.delta_chain(3, 1) is None  # decoding v2 needs v1's bits
        assert [st.version for st in f.delta_chain(5, 4)] == [5]
        assert f.delta_chain(5, 3, base_files=False) is None and await f.delta_changes(4, 3, values=False) is None
        nursery.cancel_scope.cancel()
    v0, v1, v3 = (load_file(str(srcs[i] / "model.safetensors")) for i in (0, 1, 3))
    got = {k: bits(t).reshape(-1).copy() for k, t in v1.items()}
    for c in changes:
        if c.positions is None:
            got[c.name][:] = c.values.view(got[c.name].dtype)
        else:
            got[c.name][c.positions] = c.values.view(got[c.name].dtype)
    for k, t in v3.items():
        assert np.array_equal(got[k], bits(t).reshape(-1)), k
    changed = {k for k in v3 if not np.array_equal(bits(v0[k]), bits(v3[k]))}
    assert records is not None and sorted(r.name for r in records) == sorted(changed)


@pytest.mark.parametrize("case", ["wrong_base", "wrong_result", "malformed"])
async def test_bad_delta_is_refused_never_loaded_and_the_next_anchor_is_taken(tmp_path, caplog, case):
    srcs = make_versions(tmp_path / "src", 3, seed=2)
    caplog.set_level(logging.WARNING, logger="node.checkpoints.service")
    async with trio.open_nursery() as nursery:
        sw = await _two_nodes_at_v0(tmp_path, nursery, srcs)
        t = sw.trainer.store
        base = t.get(0)
        from node.checkpoints import build_manifest

        w1 = build_manifest(RUN_ID, 1, srcs[1], CHUNK, created_ms=0).root
        if case == "wrong_base":  # names a base root this node does not hold as version 0
            data, ref = _delta_between(srcs[0], srcs[1]), DeltaRef(0, sha256(b"not v0"), w1)
            rule = "delta.base"
        elif case == "wrong_result":  # a sound delta to v1 claiming v2's weights: applies, hashes wrong
            w2 = build_manifest(RUN_ID, 1, srcs[2], CHUNK, created_ms=0).root
            data, ref = _delta_between(srcs[0], srcs[1]), DeltaRef(0, base.root, w2)
            rule = "delta.result"
        else:  # trainer-signed garbage: the chunks match their hashes, the content is no delta
            data, ref = b"PNDL" + bytes(64), DeltaRef(0, base.root, w1)
            rule = "delta.format"
        raw = forge_delta(t, sw.keys[0], 1, data, ref, CHUNK, tmp_path / "forge")
        follower = sw.nodes[1]
        follower.on_announce(raw)
        with trio.fail_after(30):
            reason = await follower.wait_outcome(1)
        assert reason is not None and reason.startswith(rule)
        assert not follower.store.get(1).assembled and follower.newest_version() == 0
        with pytest.raises(RuntimeError):
            with follower.open_version(1):
                pass
        assert not (follower.store.versions_dir / follower.store.get(1).dirname / "files").exists()
        # a delta on the refused version is refused too; the next anchor is loaded
        raw2 = await sw.publish(2, srcs[2], anchor_every=2)
        assert sw.trainer.store.get(2).delta is None
        follower.on_announce(raw2)
        with trio.fail_after(30):
            await follower.wait_assembled(2)
        nursery.cancel_scope.cancel()
    with follower.open_version(2) as files:
        assert equal_dirs(srcs[2], next(iter(files.values())).parent)
    lines = [r.getMessage() for r in caplog.records if "refused checkpoint version 1" in r.getMessage()]
    assert lines and rule in lines[0] and "never loaded" in lines[0]


class TamperingServer(ChunkServer):
    """Serves the delta file's chunks with one byte flipped (right length, wrong hash)."""

    async def _send_chunk(self, sock, st, idx, peer):
        data = bytearray(self.store.read_chunk_blocking(st, idx))
        if st.delta is not None:
            data[len(data) // 2] ^= 0xFF
        await send_all(sock, F.REPLY.pack(F.OP_GET, F.OK, idx, len(data)) + bytes(data), self.stall_timeout_s)
        self.bytes_served += len(data)


async def test_tampered_delta_chunk_is_refused_and_charged_to_its_sender(tmp_path):
    srcs = make_versions(tmp_path / "src", 2, seed=3)
    sw = Swarm(tmp_path, 3)
    bad = sw.keys[2].peer_id
    sw.nodes[2].server = TamperingServer(sw.nodes[2].store, max_upload_mbps=0)
    sw.servers[bad] = sw.nodes[2].server
    sw.link(2, [0])
    sw.link(1, [2])  # at first the follower knows only the tampering peer
    overlay = sw.overlays[sw.keys[1].peer_id]
    async with trio.open_nursery() as nursery:
        await sw.start(nursery)
        for v in (0, 1):
            raw = await sw.publish(v, srcs[v], anchor_every=10)
            sw.nodes[2].on_announce(raw)
            with trio.fail_after(30):
                await sw.nodes[2].wait_assembled(v)
        assert sw.trainer.store.get(1).delta is not None
        follower = sw.nodes[1]
        follower.on_announce(sw.trainer.store.get(0).raw)
        with trio.fail_after(30):
            await follower.wait_assembled(0)  # the anchor's chunks come untampered
        follower.on_announce(sw.trainer.store.get(1).raw)
        await wait_until(lambda: bad in overlay.banned, timeout=30, what="the tampering peer to be banned")
        assert not follower.store.get(1).complete  # no tampered chunk was kept
        sw.link(1, [0])
        with trio.fail_after(60):
            await follower.wait_assembled(1)
        nursery.cancel_scope.cancel()
    with follower.open_version(1) as files:
        assert equal_dirs(srcs[1], next(iter(files.values())).parent)
    assert overlay.penalties[(bad, "bad_chunk")] >= 1
    assert follower.deltas_applied == 1 and not follower.refused


async def test_trainer_publishes_anchor_every_k_and_when_the_delta_is_not_small(tmp_path):
    srcs = make_versions(tmp_path / "src", 6, seed=4)
    sw = Swarm(tmp_path, 1)
    async with trio.open_nursery() as nursery:
        await sw.start(nursery)
        for v in range(5):
            await sw.publish(v, srcs[v], anchor_every=3)
        # a delta must be under 1e-4 of the full files: this one is not, so an anchor
        await sw.publish(5, srcs[5], anchor_every=3, max_delta_fraction=1e-4)
        nursery.cancel_scope.cancel()
    st = sw.trainer.store
    assert [st.get(v).delta is None for v in range(3, 6)] == [True, False, True]
    d4 = st.get(4)
    assert d4.delta.base_version == 3 and d4.delta.base_root == st.get(3).root
    assert [f.path for f in d4.manifest.files] == [DELTA_FILE]
    assert d4.manifest.total_bytes < st.get(3).manifest.total_bytes / 10
    with sw.trainer.open_version(4) as files:  # the trainer applied its own delta and checked it
        assert equal_dirs(srcs[4], next(iter(files.values())).parent)


async def test_a_delta_travels_in_its_own_small_chunks_and_its_result_is_checked_in_them(tmp_path):
    """The trainer publishes a delta in chunks of ``delta_chunk_size`` (here 256 KiB under
    the run's 1 MiB), and its ``weights_root`` over the rebuilt files in those chunks; a
    follower fed by the trainer and by another follower rebuilds the version bit for bit
    and checks that root. The control: the anchor before it keeps the run's chunk size."""
    g = torch.Generator().manual_seed(5)
    w0 = torch.randn(2_000_000, generator=g).to(torch.bfloat16)
    w1 = w0.clone()
    idx = torch.randperm(len(w0), generator=g)[:400_000]  # a fifth, to new values: a ~1 MB delta
    w1[idx] = torch.randn(len(idx), generator=g).to(torch.bfloat16)
    srcs = [write_version(tmp_path / "src0", {"w": w0}), write_version(tmp_path / "src1", {"w": w1})]
    sw = Swarm(tmp_path, 3)
    sw.link(1, [0, 2])
    sw.link(2, [0, 1])
    async with trio.open_nursery() as nursery:
        await sw.start(nursery)
        for v, src in enumerate(srcs):
            raw = await sw.trainer.import_version(sw.keys[0], v, src, 1 << 20, delta_base=v - 1 if v else None)
            for follower in sw.nodes[1:]:
                follower.on_announce(raw)
            with trio.fail_after(60):
                for follower in sw.nodes[1:]:
                    await follower.wait_assembled(v)
        nursery.cancel_scope.cancel()
    anchor, delta = sw.trainer.store.get(0), sw.trainer.store.get(1)
    assert anchor.delta is None and anchor.manifest.chunk_size == 1 << 20
    assert delta.delta is not None
    size = delta.manifest.total_bytes
    assert delta.manifest.chunk_size == delta_chunk_size(size, 1 << 20) == 256 << 10
    assert len(delta.manifest.chunks()) == -(-size // (256 << 10)) >= 2
    for follower in sw.nodes[1:]:
        assert follower.deltas_applied == 1 and not follower.refused
        with follower.open_version(1) as files:
            assert equal_dirs(srcs[1], next(iter(files.values())).parent)


def test_engine_loads_a_delta_in_place_touching_only_changed_tensors(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from node.engines.transformers_engine import TransformersEngine

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "v0", safe_serialization=True)
    with torch.no_grad():  # a sparse step on two tensors
        for name in ("model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"):
            p = model.get_parameter(name)
            mask = torch.rand(p.shape) < 0.05
            p.copy_(torch.where(mask, (p.float() + 0.1).to(p.dtype), p))
    model.save_pretrained(tmp_path / "v1", safe_serialization=True)
    data, _ = encode_delta(_files(tmp_path / "v0"), _files(tmp_path / "v1"))

    engine = TransformersEngine(LlamaForCausalLM.from_pretrained(tmp_path / "v0").float(), device="cpu")
    before = {k: v._version for k, v in engine.model.state_dict().items()}
    touched = engine.load_delta(iter_changes(data, _files(tmp_path / "v0")))
    assert sorted(touched) == ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"]
    after = engine.model.state_dict()
    untouched = [k for k in after if k not in touched and k != "lm_head.weight"]  # lm_head is tied to embed
    assert untouched and all(after[k]._version == before[k] for k in untouched)
    full = LlamaForCausalLM.from_pretrained(tmp_path / "v1").float().state_dict()
    for k, v in full.items():  # same as a full load of v1 (cast to the engine's fp32 alike)
        assert torch.equal(after[k], v), k
    # a delta naming a tensor the model lacks is refused before anything is written
    bad = next(iter_changes(data, _files(tmp_path / "v0")))
    with pytest.raises(ValueError, match="does not have"):
        engine.load_delta([type(bad)(bad.path, "nope", bad.dtype, bad.numel, bad.positions, bad.values)])


def test_engine_loads_a_delta_by_tensor_from_the_new_files(tmp_path):
    """What a role does (``delta_changes(values=False)``): the delta's checked records name
    the changed tensors, the engine reads those whole from the new version's files and
    copies them in; every other tensor is not touched, and the result equals a full load.
    Names the model or the files lack are refused before anything is written."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from node.checkpoints.delta import changed_tensors
    from node.engines.transformers_engine import TransformersEngine

    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "v0", safe_serialization=True)
    with torch.no_grad():
        p = model.get_parameter("model.layers.1.self_attn.k_proj.weight")
        p.copy_(torch.where(torch.rand(p.shape) < 0.05, (p.float() + 0.1).to(p.dtype), p))
    model.save_pretrained(tmp_path / "v1", safe_serialization=True)
    data, _ = encode_delta(_files(tmp_path / "v0"), _files(tmp_path / "v1"))
    records = changed_tensors(data, _files(tmp_path / "v0"))
    assert [r.name for r in records] == ["model.layers.1.self_attn.k_proj.weight"]

    engine = TransformersEngine(LlamaForCausalLM.from_pretrained(tmp_path / "v0").float(), device="cpu")
    before = {k: v._version for k, v in engine.model.state_dict().items()}
    for bad in ("nope", "model.layers.9.mlp.up_proj.weight"):
        rec = type(records[0])(**{**records[0].__dict__, "name": bad})
        with pytest.raises(ValueError, match="does not have"):
            engine.load_delta([rec], _files(tmp_path / "v1"))
    with pytest.raises(ValueError, match="needs the new version's files"):
        engine.load_delta(records, None)
    assert {k: v._version for k, v in engine.model.state_dict().items()} == before  # nothing written
    assert engine.load_delta(records, _files(tmp_path / "v1")) == ["model.layers.1.self_attn.k_proj.weight"]
    after = engine.model.state_dict()
    assert [k for k in after if after[k]._version != before[k]] == ["model.layers.1.self_attn.k_proj.weight"]
    full = LlamaForCausalLM.from_pretrained(tmp_path / "v1").float().state_dict()
    assert all(torch.equal(after[k], v) for k, v in full.items())


def test_dense_encoding_when_nearly_everything_changed(tmp_path):
    a = write_version(tmp_path / "a", random_state(5))
    b = write_version(tmp_path / "b", {k: (v.float() + 1).to(v.dtype) for k, v in random_state(5).items()})
    data, stats = encode_delta(_files(a), _files(b))
    assert {r.encoding for r in parse_delta(data)} == {ENC_DENSE}
    apply_delta(_files(a), data, tmp_path / "out", chunk_size=CHUNK, durable=False)
    assert equal_dirs(b, tmp_path / "out")
    assert len(SHAPES) == stats.tensors


def test_apply_refuses_a_delta_that_does_not_fit_the_base(tmp_path):
    srcs = make_versions(tmp_path / "src", 2, seed=6)
    data = _delta_between(srcs[0], srcs[1])
    small = write_version(tmp_path / "small", {"embed.weight": torch.zeros(3, dtype=torch.bfloat16)})
    with pytest.raises(ProtocolError) as exc:
        apply_delta(_files(small), data, tmp_path / "out", chunk_size=CHUNK, durable=False)
    assert exc.value.rule == "delta.base"


def test_concurrent_applies_share_the_decoding_threads_and_each_is_exact(tmp_path):
    """Several applies at once in one process (a node catching up, a bench's 8 fetchers)
    share one pool of decoding and one of writing threads: each still rebuilds its version
    bit for bit with its own chunk hashes, and one refused in the middle (a delta from
    another base whose bins do not fit) leaves the others exact."""
    from concurrent.futures import ThreadPoolExecutor

    g = torch.Generator().manual_seed(13)
    n = SEGMENT + 999
    master = torch.randn(n, generator=g) * 0.02
    a = write_version(tmp_path / "a", {"w": master.to(torch.bfloat16), "s": torch.randn(4000, generator=g)})
    b = write_version(
        tmp_path / "b",
        {
            "w": (master + 1e-5 * torch.sign(torch.randn(n, generator=g))).to(torch.bfloat16),
            "s": torch.randn(4000, generator=g),
        },
    )
    data, _ = encode_delta(_files(a), _files(b))
    # another base of the same layout: the delta's ranks do not fit its bins' populations
    other = write_version(tmp_path / "o", {"w": torch.full((n,), 1e-30).to(torch.bfloat16), "s": torch.zeros(4000)})

    def one(i: int) -> object:
        base = other if i == 2 else a
        try:
            return apply_delta(_files(base), data, tmp_path / f"out{i}", chunk_size=CHUNK, durable=False)
        except ProtocolError as exc:
            return exc

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    assert isinstance(results[2], ProtocolError) and results[2].rule == "delta.format"
    for i in (0, 1, 3):
        assert equal_dirs(b, tmp_path / f"out{i}")
        assert results[i] == results[0]


def test_any_bin_table_decodes_by_its_classes_and_a_moved_class_is_caught(tmp_path):
    """The receiver finds a bin's elements by ranges of the class byte where the bin is a
    few ranges of classes, through the table otherwise (``MAX_RANGES``). A table whose
    classes absent from the tensor name any bin (here: alternating, so every bin is many
    ranges) changes no position: the version rebuilds bit for bit. A present class moved
    to another bin changes the positions: the apply refuses the delta or rebuilds other
    bytes (which the weights root check then refuses), never the new version."""
    import dataclasses

    import zstandard

    from node.checkpoints.delta import MAX_RANGES
    from protocol.delta import pack_delta

    g = torch.Generator().manual_seed(5)
    n = SEGMENT + 4321  # two segments
    master = torch.randn(n, generator=g) * 0.02
    a = write_version(tmp_path / "a", {"w": master.to(torch.bfloat16)})
    b = write_version(
        tmp_path / "b", {"w": (master + 1e-5 * torch.sign(torch.randn(n, generator=g))).to(torch.bfloat16)}
    )
    data, _ = encode_delta(_files(a), _files(b))
    (rec,) = parse_delta(data)
    raw = bytearray(zstandard.ZstdDecompressor().decompress(rec.payload))
    old = load_file(str(a / "model.safetensors"))["w"].view(torch.int16).numpy().view(np.uint16)
    cls = (old >> 7) & 0xFF
    present = np.unique(cls)
    absent = np.setdiff1d(np.arange(256), present)

    def rebuilt(table: np.ndarray, name: str) -> Path:
        payload = zstandard.ZstdCompressor().compress(bytes(table.astype(np.uint8)) + bytes(raw[256:]))
        out = tmp_path / name
        apply_delta(
            _files(a), pack_delta([dataclasses.replace(rec, payload=payload)]), out, chunk_size=CHUNK, durable=False
        )
        return out

    table = np.frombuffer(bytes(raw[:256]), dtype=np.uint8).copy()
    assert equal_dirs(b, rebuilt(table, "honest"))  # the control: the encoder's table
    scattered = table.copy()
    scattered[absent] = np.arange(len(absent)) % BINS
    runs = [
        np.count_nonzero(np.diff(np.concatenate([[0], scattered == e, [0]]).astype(np.int8)) == 1) for e in range(BINS)
    ]
    assert max(runs) > MAX_RANGES  # this table's bins are many ranges: the gather path
    assert equal_dirs(b, rebuilt(scattered, "scattered"))
    busy = present[np.argmax(np.bincount(cls, minlength=256)[present])]
    moved = table.copy()
    moved[busy] = (table[busy] + 1) % BINS
    try:
        assert not equal_dirs(b, rebuilt(moved, "moved"))
    except ProtocolError as exc:
        assert exc.rule == "delta.format"


def test_malformed_sparse_payloads_are_refused_before_anything_is_written(tmp_path):
    """Each part of a sparse payload (protocol/delta.py) broken in turn: the decoder
    refuses it with ``delta.format`` (never an IndexError, never a wrong tensor)."""
    import dataclasses

    import zstandard

    from node.checkpoints.delta import decode_record

    g = torch.Generator().manual_seed(3)
    master = torch.randn(20005, generator=g) * 0.02
    a = write_version(tmp_path / "a", {"w": master.to(torch.bfloat16)})
    b = write_version(tmp_path / "b", {"w": (master + 3e-5).to(torch.bfloat16)})
    data, _ = encode_delta(_files(a), _files(b))
    (rec,) = parse_delta(data)
    assert rec.encoding == ENC_SPARSE
    old = load_file(str(a / "model.safetensors"))["w"].view(torch.int16).numpy().view(np.uint16)
    assert decode_record(rec, old).positions is not None  # the honest control
    raw = bytearray(zstandard.ZstdDecompressor().decompress(rec.payload))
    t = 256  # the bin table: one byte per bf16 exponent class; then one segment's Rice table
    rice = np.frombuffer(bytes(raw[t : t + BINS]), dtype=np.uint8).astype(np.int64)
    counts = np.frombuffer(bytes(raw[t + BINS : t + 5 * BINS]), dtype="<u4").astype(np.int64)
    e = int(np.flatnonzero(counts)[0])  # a bin holding changes
    signs_end = t + 5 * BINS + (int((rice * counts).sum()) + 7) // 8 + (rec.changed + 7) // 8
    assert rec.changed % 8  # the last sign byte has padding bits to break

    def with_raw(b: bytes | bytearray) -> object:
        return dataclasses.replace(rec, payload=zstandard.ZstdCompressor().compress(bytes(b)))

    def edit(at: int, value: int) -> bytearray:
        out = bytearray(raw)
        out[at] = value
        return out

    cases = {
        "bin table": edit(int(np.flatnonzero(raw[:t])[0]), BINS),
        "bin counts": edit(t + BINS + 4 * e, raw[t + BINS + 4 * e] + 1),
        "Rice parameter": edit(t + e, 60),
        "sign padding": edit(signs_end - 1, raw[signs_end - 1] | 0x80),
        "unary stream": raw + b"\x01",  # one code too many
        "stray bytes": raw + b"\x00",  # padding past a byte
        "bin and Rice tables": raw[:100],
        "remainders and values": raw[: t + 5 * BINS + 10],
    }
    for says, bad in cases.items():
        with pytest.raises(ProtocolError) as exc:
            decode_record(with_raw(bad), old)
        assert exc.value.rule == "delta.format" and says in exc.value.detail, (says, exc.value.detail)
    # a frame declaring more than the record allows is refused before decompressing
    huge = dataclasses.replace(rec, payload=zstandard.ZstdCompressor().compress(bytes(rec.raw_bound + 1)))
    with pytest.raises(ProtocolError, match="allows"):
        decode_record(huge, old)
