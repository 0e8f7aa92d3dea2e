"""``primenode join --engine``: which roles take which engine, what is refused, and (with
vLLM installed) a vLLM worker's batch verified by a vLLM validator and by a
transformers validator. CI has no vLLM: the vLLM half is skipped there
(docs/proofs.md says how it was run)."""

from __future__ import annotations

import os

import pytest
import trio

from harness.genesis import TRAINER, VALIDATORS, WORKERS, tiny_genesis
from harness.roles import tiny_context
from node.engines.vllm_engine import vllm_available
from node.errors import NodeError
from node.home import NodeHome
from node.roles.factory import make_role

W = WORKERS[0].peer_id


def _home(tmp_path, name):
    home = NodeHome(tmp_path / name)
    home.path.mkdir(parents=True)
    return home


def test_engine_choice_is_checked_before_anything_runs(tmp_path):
    g = tiny_genesis()
    with pytest.raises(NodeError, match="unknown engine 'onnx'"):
        make_role("worker", _home(tmp_path, "a"), g, key_peer_id=W, engine="onnx")
    with pytest.raises(NodeError, match="for workers and validators"):
        make_role("trainer", _home(tmp_path, "b"), g, key_peer_id=TRAINER.peer_id, engine="vllm")
    with pytest.raises(NodeError, match="transformers engine only"):
        make_role("worker", _home(tmp_path, "c"), g, key_peer_id=W, engine="vllm", tamper="tokens")
    worker = make_role("worker", _home(tmp_path, "d"), g, key_peer_id=W, engine="vllm")
    validator = make_role("validator", _home(tmp_path, "e"), g, key_peer_id=VALIDATORS[0].peer_id, engine="vllm")
    assert worker.engine_kind == validator.engine_kind == "vllm"


@pytest.mark.skipif(vllm_available(), reason="checks the message shown where vLLM is missing")
def test_vllm_engine_without_vllm_is_a_clear_error(tmp_path):
    worker = make_role("worker", _home(tmp_path, "w"), tiny_genesis(), key_peer_id=W, engine="vllm")
    with pytest.raises(NodeError, match="--engine vllm needs vLLM"):
        worker.make_engine()


def test_the_tiny_models_folder_is_version_0_and_written_once(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from node.roles.engines import model_folder

    ctx = tiny_context(tmp_path)
    folder = model_folder(ctx)
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert model_folder(ctx) == folder and (folder / "config.json").stat().st_mtime_ns == stamp
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want = ctx.initial_model().state_dict()
    got = loaded.state_dict()
    assert set(want) <= set(got)
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="vllm not installed")
def test_vllm_worker_batch_verifies_on_vllm_and_transformers_validators(tmp_path):
    """A vLLM worker's batch, produced from trio threads as the role does, passes every rule on
    a vLLM validator (tight thresholds, replay tolerance "same") and, in a run that allows
    mixed stacks, on a transformers validator with the same weights: its tokens are the
    seeded Gumbel samples either validator replays. Tampered tokens fail TOPLOC, greedy
    decoding claimed as sampling fails the replay; a run declared for the transformers
    stack refuses the engine."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from harness.roles import engine_for
    from node.roles.rollouts import PolicyFacts, produce_batch, verify_batch
    from node.util import now_ms

    policy = PolicyFacts(0, b"\x07" * 32, now_ms())
    # vLLM's CPU attention wants head_dim >= 32: 128 wide, 2 heads
    cfg = dict(numerics="vllm-fp32-cpu", tiny_hidden_size=128, tiny_heads=2)
    ctx = tiny_context(tmp_path, **cfg)
    worker = make_role("worker", _home(tmp_path, "w"), tiny_genesis(**cfg), key_peer_id=W, engine="vllm")

    async def as_the_role_does():
        # the roles build, reload and run their engine in trio worker threads (not always
        # the same thread): vLLM's in-process engine must work that way
        engine = await trio.to_thread.run_sync(worker.make_engine)
        await trio.to_thread.run_sync(engine.load_weights, ctx.initial_model().state_dict())
        batch = await trio.to_thread.run_sync(lambda: produce_batch(ctx, engine, W, policy, 0))
        return engine, batch

    engine, batch = trio.run(as_the_role_does)
    assert engine.numerics == "vllm-fp32-cpu"
    own = verify_batch(ctx, engine, batch, W, policy)
    assert own.accept, own.reason
    # across stacks (a transformers validator, same weights) only the paper's thresholds and
    # the mixed replay tolerance are promised: the same weights in a run that says so
    paper = tiny_context(tmp_path / "paper", **cfg, toploc_thresholds="paper", sampling_tolerance="mixed")
    hf = engine_for(paper)
    cross = produce_batch(paper, engine, W, policy, 0)
    v = verify_batch(paper, hf, cross, W, policy)
    assert v.accept, v.reason
    # the two stacks sample the same tokens from the same seeds
    ref = produce_batch(paper, hf, W, policy, 0)
    same = sum(a.completion == b.completion for a, b in zip(cross.samples, ref.samples))
    assert same >= len(ref.samples) - 1, f"{same} of {len(ref.samples)} completions equal"
    bad = produce_batch(ctx, engine, W, policy, 1, tamper="tokens")
    assert verify_batch(ctx, engine, bad, W, policy).rule == "toploc"
    greedy = produce_batch(ctx, engine, W, policy, 1, tamper="greedy")  # real proofs, tokens not the seeded ones
    assert verify_batch(ctx, engine, greedy, W, policy).rule in ("sampling", "termination")
    # a run declared for the transformers stack refuses the vLLM engine
    with pytest.raises(NodeError, match="numerics"):
        tiny_context(tmp_path / "tf", **{**cfg, "numerics": "transformers-fp32-cpu"}).check_engine(engine)


def test_devnet_engine_option_sets_the_stack_and_the_node_flags(tmp_path):
    from node.genesis_file import genesis_config, read_genesis
    from node.ops.devnet import Devnet, DevnetOptions

    with pytest.raises(NodeError, match="unknown engine"):
        Devnet(DevnetOptions(out=tmp_path / "bad", engine="onnx")).prepare()
    net = Devnet(DevnetOptions(out=tmp_path / "v", engine="vllm", workers=1, validators=1))
    net.prepare()
    assert genesis_config(read_genesis(net.genesis_path).genesis)["numerics"] == "vllm-fp32-cpu"
    for n in net.nodes:
        assert ("--engine" in n.args) == (n.role in ("worker", "validator")), n.name
