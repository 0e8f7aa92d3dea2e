"""What the devnet's genesis asks of each step: the prompts a step learns from, split across workers."""

from __future__ import annotations

import pytest

from node.genesis_file import read_genesis
from node.ops.devnet import Devnet, DevnetOptions
from node.roles.context import genesis_config


@pytest.mark.parametrize(("workers", "per_batch"), [(1, 16), (2, 8), (3, 6)])
def test_a_step_takes_one_batch_per_worker_and_the_step_prompts_are_split_among_them(tmp_path, workers, per_batch):
    net = Devnet(DevnetOptions(out=tmp_path / "net", workers=workers, validators=1))
    net.prepare()
    g = read_genesis(net.genesis_path).genesis
    assert g.prompts_per_batch == per_batch  # ceil(16 / workers): every step learns from >= 16 prompts
    assert genesis_config(g)["batches_per_step"] == workers
    assert genesis_config(g)["worker_batches_per_version"] == 1


def test_an_explicit_batch_size_overrides_the_split(tmp_path):
    net = Devnet(DevnetOptions(out=tmp_path / "net", workers=2, validators=1, prompts_per_batch=3))
    net.prepare()
    assert read_genesis(net.genesis_path).genesis.prompts_per_batch == 3
