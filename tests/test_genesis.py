"""Run genesis files: written by `primenode run init`, verified on load, tamper-evident."""

from __future__ import annotations

import pytest

from node.errors import NodeError
from node.genesis_file import genesis_config, make_genesis, read_genesis, write_genesis
from protocol import NodeKey

OWNER, TRAINER, V1, V2 = (NodeKey(bytes([i]) * 32) for i in (11, 12, 13, 14))


def genesis(**over):
    fields = dict(name="t", model="tiny", dataset="builtin:target-length", dataset_size=64,
                  trainer=TRAINER.peer_id, validators=[V1.peer_id, V2.peer_id], quorum=2, max_async=2,
                  prompts_per_batch=4, group_size=4, chunk_size=1 << 20)
    fields.update(over)
    return make_genesis(OWNER, {"lr": 1e-4, "steps": 5, "task": "target-length"}, **fields)


def test_file_round_trip_keeps_run_id(tmp_path):
    signed = genesis()
    write_genesis(signed, tmp_path / "run.toml")
    loaded = read_genesis(tmp_path / "run.toml")
    assert loaded == signed
    assert loaded.genesis.run_id == signed.genesis.run_id
    assert genesis_config(loaded.genesis)["lr"] == 1e-4


@pytest.mark.parametrize("old,new", [("steps = 5", "steps = 6"), ("quorum = 2", "quorum = 1"),
                                     ("max_async = 2", "max_async = 9")])
def test_edited_file_is_refused(tmp_path, old, new):
    path = tmp_path / "run.toml"
    write_genesis(genesis(), path)
    path.write_text(path.read_text().replace(old, new))
    with pytest.raises(NodeError, match="invalid genesis"):
        read_genesis(path)


def test_quorum_larger_than_validators_is_refused():
    with pytest.raises(NodeError, match="quorum"):
        genesis(quorum=3)


def test_missing_file_and_missing_field(tmp_path):
    with pytest.raises(NodeError, match="does not exist"):
        read_genesis(tmp_path / "nope.toml")
    (tmp_path / "bad.toml").write_text('run_id = "00"\n')
    with pytest.raises(NodeError, match="missing"):
        read_genesis(tmp_path / "bad.toml")
