"""O_DIRECT chunk writes and assembly: exact bytes, unaligned tails, and the buffered fallback."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from node.checkpoints import directio
from node.checkpoints.directio import ALIGN, DirectIOUnsupported
from node.checkpoints.store import ChunkStore
from protocol import NodeKey

RUN = b"r" * 32


def _direct_ok(path) -> bool:
    try:
        fd = directio.open_direct(path / "probe", os.O_WRONLY | os.O_CREAT)
    except DirectIOUnsupported:
        return False
    os.close(fd)
    os.unlink(path / "probe")
    return True


@pytest.mark.parametrize("size", [1, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN + 17, 1 << 20])
def test_write_new_file_holds_exactly_the_bytes(tmp_path, size):
    if not _direct_ok(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    data = os.urandom(size)
    directio.write_new_file(tmp_path / "f", data, durable=True)
    assert (tmp_path / "f").read_bytes() == data
    with directio.read_file_into(tmp_path / "f", size) as view:
        assert bytes(view) == data


def test_write_new_file_refuses_an_existing_name(tmp_path):
    if not _direct_ok(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    (tmp_path / "f").write_bytes(b"old")
    with pytest.raises(FileExistsError):
        directio.write_new_file(tmp_path / "f", b"new", durable=False)
    assert (tmp_path / "f").read_bytes() == b"old"


def test_read_of_a_short_file_is_an_error(tmp_path):
    if not _direct_ok(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    (tmp_path / "f").write_bytes(b"x" * 100)
    with pytest.raises(OSError, match="short"):
        directio.read_file_into(tmp_path / "f", 5000)


def _checkpoint(src, sizes):
    src.mkdir()
    rng = np.random.default_rng(0)
    for i, n in enumerate(sizes):
        save_file({"w": rng.standard_normal(n, dtype=np.float32)}, str(src / f"part-{i}.safetensors"))


@pytest.mark.parametrize("direct", [True, False])
def test_import_and_assemble_are_byte_identical_either_way(tmp_path, direct):
    # files whose lengths are not multiples of 4 KiB, chunks of 64 KiB: aligned bodies, odd tails
    trainer = NodeKey.generate()
    _checkpoint(tmp_path / "src", [70_001, 5, 16_384])
    store = ChunkStore(tmp_path / "store", RUN, trainer.peer_id, direct_io=direct)
    _, raw = store.import_directory_blocking(trainer, 1, tmp_path / "src", chunk_size=64 * 1024)
    store.add_announce(raw)
    files = store.assemble_blocking(store.versions[1])
    for f in (tmp_path / "src").iterdir():
        assert (files / f.name).read_bytes() == f.read_bytes()
        load_file(str(files / f.name))
    st = store.versions[1]
    for i, st_chunk in enumerate(st.chunks):
        assert hashlib.sha256(store.read_chunk_blocking(st, i)).digest() == st_chunk[3]


def test_a_filesystem_that_refuses_o_direct_gets_buffered_writes(tmp_path, monkeypatch):
    def refuse(path, flags, mode=0o644):
        raise DirectIOUnsupported(22, "refused (test)")

    monkeypatch.setattr(directio, "open_direct", refuse)
    trainer = NodeKey.generate()
    _checkpoint(tmp_path / "src", [9_999])
    store = ChunkStore(tmp_path / "store", RUN, trainer.peer_id)
    assert store.direct_io
    _manifest, raw = store.import_directory_blocking(trainer, 1, tmp_path / "src", chunk_size=64 * 1024)
    assert not store.direct_io  # switched off after the first refusal, and the write still happened
    store.add_announce(raw)
    files = store.assemble_blocking(store.versions[1])
    assert (files / "part-0.safetensors").read_bytes() == (tmp_path / "src" / "part-0.safetensors").read_bytes()
    assert not list((tmp_path / "store" / "tmp").iterdir())  # no leftovers of the refused attempt


def test_config_direct_io_false_reaches_the_roles_store(tmp_path):
    from harness.genesis import TRAINER, tiny_genesis
    from node.config import NodeConfig
    from node.errors import NodeError
    from node.home import NodeHome
    from node.roles.factory import make_role

    (tmp_path / "config.toml").write_text("direct_io = false\n")
    assert NodeConfig.load(tmp_path / "config.toml").direct_io is False
    (tmp_path / "config.toml").write_text('direct_io = "no"\n')
    with pytest.raises(NodeError, match="direct_io must be bool"):
        NodeConfig.load(tmp_path / "config.toml")

    home = NodeHome(tmp_path / "home")
    home.path.mkdir(parents=True)
    for flag in (False, True):
        role = make_role("trainer", home, tiny_genesis(), key_peer_id=TRAINER.peer_id, direct_io=flag)
        assert role.store.direct_io is flag
