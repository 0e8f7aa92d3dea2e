"""One rank of the FSDP tests: ``python -m harness.fsdp_child SPEC.json`` under torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The spec says where the trainer comes
from (a seed or a checkpoint), which steps to run, where to checkpoint; rank 0 writes each
step's metrics and full weights so the test compares them with one process."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from harness.rl import fake_groups
from node.rl.distributed import DistributedGRPOTrainer, broadcast_groups, init_distributed, leave_group
from node.rl.grpo import GRPOConfig
from node.rl.ranks import RankGroup, follow

torch.set_num_threads(1)


def tiny(seed: int, tied: bool):
    """The model both sides train: a char Llama, optionally with tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=70,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def config() -> GRPOConfig:
    return GRPOConfig(lr=1e-2, warmup_steps=0, max_grad_norm=1.0, max_tokens=8, temperature=1.0, micro_batch_size=5)


def step_groups(step: int, version: int) -> list:
    """Step 2 onwards mixes a stale version in (old log-probs under other weights)."""
    groups = fake_groups(step, n_groups=3, group_size=4, version=version)
    if step >= 2:
        groups += fake_groups(100 + step, n_groups=1, group_size=4, version=version - 1)
    return groups


def group_mode(spec: dict, rank: int) -> None:
    """The trainer role's use: rank 0 drives a RankGroup, the other ranks follow its orders."""
    out, published = Path(spec["out"]), Path(spec["published"])
    if rank != 0:
        follow(spec.get("device", "cpu"))
        return

    def behaviour(version: int) -> dict[str, torch.Tensor] | None:
        f = published / f"v{version}" / "model.safetensors"
        return load_file(f) if f.exists() else None

    grp = RankGroup.start(config=config(), model=tiny(spec["seed"], spec["tied"]))
    grp.export(published / f"v{grp.version}")
    for _ in range(spec["steps"]):
        m = grp.step(step_groups(grp.version + 1, grp.version), behaviour)
        grp.export(published / f"v{grp.version}")
        grp.save_checkpoint(spec["save"])
        torch.save(behaviour(grp.version), out / f"weights_{grp.version}.pt")
        (out / f"metrics_{grp.version}.json").write_text(json.dumps(m.__dict__, default=str))
    grp.stop()
    leave_group(0)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank, world, device = init_distributed(spec.get("device", "cpu"))
    print(f"pid {os.getpid()} rank {rank} of {world}", flush=True)
    out = Path(spec["out"])
    # the kill test reads the pids from files: lines on the ranks' shared stdout can interleave
    (out / f"pid_{rank}").write_text(str(os.getpid()))
    if rank == 0:
        (out / "backend.txt").write_text(torch.distributed.get_backend())
    if spec.get("group"):
        group_mode(spec, rank)
        return
    if spec.get("resume"):
        tr = DistributedGRPOTrainer.from_checkpoint(spec["resume"], config=config(), device=device)
    else:
        tr = DistributedGRPOTrainer(tiny(spec["seed"], spec["tied"]), config(), device=device)
    published = Path(spec["published"])  # every version's weights, as the trainer role publishes them

    def behaviour(version: int) -> dict[str, torch.Tensor] | None:
        f = published / f"v{version}" / "model.safetensors"
        return load_file(f) if f.exists() else None

    tr.export(published / f"v{tr.version}")
    for _ in range(spec["steps"]):
        step = tr.version + 1
        groups = broadcast_groups(step_groups(step, tr.version) if rank == 0 else None)
        m = tr.step(groups, behaviour if rank == 0 else None)
        tr.export(published / f"v{tr.version}")
        weights = tr.full_state_dict()
        if spec.get("save"):
            tr.save_checkpoint(spec["save"])
        if rank == 0:
            torch.save(weights, out / f"weights_{tr.version}.pt")
            (out / f"metrics_{tr.version}.json").write_text(json.dumps(m.__dict__, default=str))
            print(f"committed {tr.version}", flush=True)
    # every rank done with its collectives before any tears the group down: a rank leaving while
    # the other still talks aborted once in gloo's teardown ("terminate called without an active
    # exception", CI 2026-11-24)
    torch.distributed.barrier()
    leave_group(0)


if __name__ == "__main__":
    main()
