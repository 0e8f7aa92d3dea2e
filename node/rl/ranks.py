"""The trainer role over N ranks: rank 0 is the network node, ranks 1..N-1 follow its orders.

Rank 0 runs the ordinary trainer role (libp2p identity, ledger, publishing) with a
:class:`RankGroup` where it would hold a ``GRPOTrainer``: the same calls (``step``,
``save_checkpoint``, ``export``, ``version``), each of which first broadcasts an order to
the other ranks (``broadcast_object_list`` over the process group: the admitted groups of
a step travel with it) and then takes part itself. Ranks 1..N-1 run :func:`follow`: receive
an order, take part in the same collective, repeat, until ``stop``. Orders are strictly
ordered by the process group, so every rank calls every collective in the same sequence.

Every rank of one torchrun runs on one machine, so a checkpoint folder written by the
group is readable by every rank under the same path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from node.rl.distributed import DistributedGRPOTrainer, init_distributed, leave_group, meta_model
from node.rl.grpo import BehaviourWeights, Group, GRPOConfig
from node.rl.metrics import StepMetrics
from node.rl.torchrun import launched_rank, under_torchrun


def _order(*order: Any) -> tuple[Any, ...]:
    """Collective: rank 0's order on every rank (others pass nothing)."""
    box: list[Any] = [order if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    out: tuple[Any, ...] = box[0]
    return out


def _build(
    lm_config: dict[str, Any] | None,
    grpo: dict[str, Any],
    pad_token_id: int,
    checkpoint: str | None,
    device: str,
    dtype: str,
    model: torch.nn.Module | None = None,
) -> DistributedGRPOTrainer:
    """Collective: the sharded trainer, from a group checkpoint or from rank 0's model
    (the others build the same architecture and receive rank 0's weights)."""
    cfg = GRPOConfig.from_dict(grpo)
    torch_dtype = getattr(torch, dtype)
    if checkpoint is not None:
        return DistributedGRPOTrainer.from_checkpoint(
            checkpoint, config=cfg, pad_token_id=pad_token_id, device=device, dtype=torch_dtype
        )
    full: dict[str, torch.Tensor] = {}
    if model is None:
        from transformers import AutoConfig, AutoModelForCausalLM

        assert lm_config is not None
        conf_dict = dict(lm_config)
        attn = conf_dict.pop("_attn", None)
        conf = AutoConfig.for_model(conf_dict.pop("model_type"), **conf_dict)
        kwargs = {"attn_implementation": attn} if attn else {}
        with meta_model():  # this rank's shards are filled from rank 0's weights below
            model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32, **kwargs).eval()
    else:
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = DistributedGRPOTrainer(model, cfg, pad_token_id=pad_token_id, device=device, dtype=torch_dtype)
    trainer.adopt_rank0_weights(full)
    return trainer


class RankGroup:
    """Rank 0's handle on the group, with the trainer API the trainer role uses."""

    def __init__(self, trainer: DistributedGRPOTrainer) -> None:
        self.trainer = trainer

    @classmethod
    def start(
        cls,
        *,
        config: GRPOConfig,
        pad_token_id: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
        checkpoint: str | os.PathLike[str] | None = None,
        model: torch.nn.Module | None = None,
    ) -> RankGroup:
        """Collective (rank 0): build the trainer on every rank, from ``checkpoint`` (a group
        checkpoint folder) or from ``model`` (rank 0's initial weights)."""
        ckpt = str(checkpoint) if checkpoint is not None else None
        lm_config = None
        if model is not None:
            conf: Any = model.config
            lm_config = {**conf.to_dict(), "_attn": getattr(conf, "_attn_implementation", None)}
        args = (lm_config, config.to_dict(), pad_token_id, ckpt, device, dtype)
        _order("init", *args)
        return cls(_build(*args, model=model))

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def world(self) -> int:
        return self.trainer.world

    def step(self, groups: Sequence[Group], behaviour: BehaviourWeights | None = None) -> StepMetrics:
        _order("step", [list(g) for g in groups])
        return self.trainer.step(groups, behaviour)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        _order("save", str(path))
        return self.trainer.save_checkpoint(path)

    def write_checkpoint_files(self, folder: str | os.PathLike[str]) -> None:
        """The group's state into ``folder`` (the trainer role's versioned states, node/roles/resume.py)."""
        _order("write", str(folder))
        self.trainer.write_checkpoint_files(folder)

    def export(self, out_dir: str | os.PathLike[str], dtype: torch.dtype | None = None) -> Path | None:
        name = str(dtype).removeprefix("torch.") if dtype is not None else None
        _order("export", str(out_dir), name)
        return self.trainer.export(out_dir, dtype)

    def stop(self) -> None:
        """Collective: the followers leave their loop; every rank passes a barrier first, so no
        rank tears the group down while another still talks (gloo aborted the process then)."""
        _order("stop")
        dist.barrier()


def follow(device: str = "cpu") -> NoReturn:
    """Ranks 1..N-1: take part in rank 0's orders until it says stop (or the group fails),
    then end the process (:func:`node.rl.distributed.leave_group` says why it does not return)."""
    init_distributed(device)
    assert dist.get_rank() != 0, "rank 0 leads (RankGroup), it does not follow"
    trainer: DistributedGRPOTrainer | None = None
    while True:
        kind, *args = _order()
        if kind == "init":
            trainer = _build(*args)
        elif kind == "stop":
            dist.barrier()  # with RankGroup.stop: nobody tears down while another rank still talks
            break
        else:
            assert trainer is not None, f"order {kind!r} before init"
            if kind == "step":
                trainer.step(args[0])
            elif kind == "save":
                trainer.save_checkpoint(args[0])
            elif kind == "write":
                trainer.write_checkpoint_files(args[0])
            elif kind == "export":
                trainer.export(args[0], getattr(torch, args[1]) if args[1] else None)
            else:
                raise ValueError(f"unknown order {kind!r}")
    leave_group(0)


def is_group_checkpoint(path: Path) -> bool:
    """A checkpoint folder written by a rank group (DCP), not by one process."""
    from node.rl.distributed import STATE_FILE

    return (path / STATE_FILE).exists()


__all__ = ["RankGroup", "follow", "is_group_checkpoint", "launched_rank", "under_torchrun"]
