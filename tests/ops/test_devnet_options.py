"""What the devnet's genesis asks of each step: the prompts a step learns from, split across workers."""

from __future__ import annotations

import pytest

from node.genesis_file import genesis_config, read_genesis
from node.ops.devnet import Devnet, DevnetOptions


@pytest.mark.parametrize(("workers", "per_batch"), [(1, 16), (2, 8), (3, 6)])
def test_a_step_takes_one_batch_per_worker_and_the_step_prompts_are_split_among_them(tmp_path, workers, per_batch):
    net = Devnet(DevnetOptions(out=tmp_path / "net", workers=workers, validators=1))
    net.prepare()
    g = read_genesis(net.genesis_path).genesis
    assert g.prompts_per_batch == per_batch  # ceil(16 / workers): every step learns from >= 16 prompts
    assert genesis_config(g)["batches_per_step"] == workers
    # paced one version ahead (issue 35, the devnet is asynchronous): one batch per worker per
    # version, generated while the trainer trains on the one before; --lockstep waits instead
    assert (genesis_config(g)["worker_batches_per_version"], genesis_config(g)["worker_lead_versions"]) == (1, 1)
    lock = Devnet(DevnetOptions(out=tmp_path / "lock", workers=workers, validators=1, lockstep=True))
    lock.prepare()
    assert genesis_config(read_genesis(lock.genesis_path).genesis)["worker_lead_versions"] == 0


def test_an_explicit_batch_size_overrides_the_split(tmp_path):
    net = Devnet(DevnetOptions(out=tmp_path / "net", workers=2, validators=1, prompts_per_batch=3))
    net.prepare()
    assert read_genesis(net.genesis_path).genesis.prompts_per_batch == 3


def test_a_dataset_file_is_pinned_by_content_and_loaded_by_every_node(tmp_path):
    """``--dataset FILE`` (the filter's output): the genesis names the file, its size and its
    content hash; a node's context loads it and accepts it, and refuses a copy that differs."""
    from node.errors import ConfigError
    from node.rl.tasks import addition_problems, dataset_hash, save_dataset
    from node.roles.context import RunContext

    problems = addition_problems(12, seed=3)
    data = save_dataset(problems, tmp_path / "filtered.jsonl")
    net = Devnet(DevnetOptions(out=tmp_path / "net", validators=1, dataset=data, system_prompt="", lr=3e-5))
    net.prepare()
    g = read_genesis(net.genesis_path).genesis
    assert (g.dataset, g.dataset_size, g.dataset_hash) == (str(data.resolve()), 12, dataset_hash(problems))
    config = genesis_config(g)
    assert (config["system_prompt"], config["lr"]) == ("", 3e-5)
    ctx = RunContext.from_genesis(g, tmp_path / "cache")
    assert [p.prompt for p in ctx.problems] == [p.prompt for p in problems]

    save_dataset(addition_problems(12, seed=4), data)  # same size, other problems
    with pytest.raises(ConfigError, match="dataset_hash"):
        RunContext.from_genesis(g, tmp_path / "cache")


def test_a_bf16_policy_declares_a_bf16_stack_and_engines_compute_in_it(tmp_path):
    """``--policy-dtype bfloat16``: the genesis's numerics stack names bf16, and the engine a
    worker or validator builds computes in bf16 (not upcast to fp32) and reports that stack."""
    from node.roles.context import RunContext
    from node.roles.engines import build_engine

    net = Devnet(DevnetOptions(out=tmp_path / "net", validators=1, policy_dtype="bfloat16"))
    net.prepare()
    g = read_genesis(net.genesis_path).genesis
    assert genesis_config(g)["numerics"] == "transformers-bf16-cpu"
    ctx = RunContext.from_genesis(g, tmp_path / "cache")
    engine = build_engine(ctx, "transformers")
    assert engine.numerics == "transformers-bf16-cpu"
    ctx.check_engine(engine)


def test_a_bad_dataset_file_is_refused_before_anything_starts(tmp_path):
    from node.errors import ConfigError

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="no problems"):
        Devnet(DevnetOptions(out=tmp_path / "net", validators=1, dataset=empty)).prepare()
    with pytest.raises(ConfigError, match="not found"):
        Devnet(DevnetOptions(out=tmp_path / "net", validators=1, dataset=tmp_path / "missing.jsonl")).prepare()


def test_a_bf16_stack_replays_sampling_with_the_mixed_tolerance():
    """bf16 engines round differently between a worker's cached decode and a validator's
    batched prefill (a bf16 devnet on the 1e-3 "same" tolerance rejected honest workers), so
    a declared bf16 stack defaults to "mixed"; a declared fp32 stack keeps "same"."""
    from node.roles.context import REPLAY_PRESETS, replay_config_for
    from protocol.run_config import RunConfig

    def replay(table):
        return replay_config_for(RunConfig.decode(table))

    assert replay({"numerics": "transformers-fp32-cpu"}) == REPLAY_PRESETS["same"]
    bf16 = {"numerics": "transformers-bf16-cpu", "policy_dtype": "bfloat16"}
    assert replay(bf16) == REPLAY_PRESETS["mixed"]
    assert replay({**bf16, "sampling_tolerance": "same"}) == REPLAY_PRESETS["same"]
