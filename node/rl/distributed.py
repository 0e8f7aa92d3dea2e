"""The GRPO trainer over N ranks of one torch.distributed group: FSDP2, data parallel.

Why FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and AdamW state
are sharded across ranks (1/N each), so a model that does not fit one device in fp32 with
its optimizer state trains on N; it is the engine INTELLECT-2's trainer used, and it keeps
every parameter an ordinary ``DTensor`` that ``torch.distributed.checkpoint`` reshards.

Units: each decoder layer is one FSDP unit (all-gathered just before it runs, freed after),
then a root. The root is not the causal LM itself but :class:`FusedLM`, a module whose
forward runs the decoder *and* the chunked head of :mod:`node.rl.logprobs`. The chunked
log-probs run ``model.model`` and ``model.lm_head`` separately, never the LM's own forward;
had the LM been the root, its own parameters (embeddings, final norm, lm_head, tied or not)
would never be all-gathered. With :class:`FusedLM` as root they are gathered once per
forward, stay gathered through every head chunk and the backward (FSDP2 keeps a root's
parameters after forward), and are reduce-scattered once. Tied embeddings stay tied (both
names live in the root unit), so nothing is untied. The head is not a unit of its own on
purpose: ranks run different numbers of head chunks, and a unit's all-gather is a
collective that every rank must call the same number of times.

Data parallel: every rank receives all the step's groups (rank 0, the network node,
broadcasts them), so the bookkeeping of :meth:`GRPOTrainer.step` (staleness, advantages,
filters, the loss normaliser ``rollouts x max_tokens``, the micro-batch spans) is identical
on every rank and global by construction. Only the model passes are shared: each micro-batch
is cut into N contiguous slices, each rank runs its slice and the per-token log-probs and
entropies are all-gathered with a differentiable all-gather, so every rank evaluates the
same loss over the whole micro-batch. Backward through the gather hands each rank N times
the gradient of its own rows (every rank's loss is the same), and FSDP's reduction averages
over N: the sum over all rows, as in one process. A rank with an empty slice still runs a
forward and backward (on a row whose result is multiplied by 0) so that every rank calls
every collective equally often.

Old log-probs under a behaviour version: rank 0 reads that version's published weights
(``behaviour(v)``), ``set_model_state_dict(..., broadcast_from_rank0=True)`` loads them into
the sharded model, and the live shards (1/N of the model, copied first) are put back after.

Checkpoints are ``torch.distributed.checkpoint`` (DCP) folders: every rank writes its shards
of the model and optimizer state, so a checkpoint saved by N ranks loads on M. Publishing a
version gathers the full state dict on rank 0 (CPU offload), which writes the safetensors
workers load: the network carries whole checkpoints (and deltas of them), not FSDP shards.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from node.rl.grpo import BehaviourWeights, GRPOConfig, GRPOTrainer, Rollout
from node.rl.logprobs import completion_stats, token_logprobs_and_entropy
from node.util import fsync_dir, fsync_tree

# A collective that waits longer than this raises instead of hanging the group forever
# (a rank that died mid-step is noticed sooner: gloo and NCCL see its sockets close).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)

DCP_DIR = "dcp"
STATE_FILE = "trainer_state.json"


def backend_for(device: str | torch.device) -> str:
    """NCCL between GPUs, gloo on CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(device: str | torch.device = "cpu") -> tuple[int, int, torch.device]:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK). Returns (rank, world size, this rank's device)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(
            backend_for(dev), timeout=COLLECTIVE_TIMEOUT, device_id=dev if dev.type == "cuda" else None
        )
    return dist.get_rank(), dist.get_world_size(), dev


def meta_model() -> Any:
    """Context in which a model is built with its parameters on the meta device (no memory,
    no random init) and its buffers for real (rotary tables are computed, not loaded).

    Why: a rank must never hold the whole model. Ranks that take their weights from rank 0
    or from a DCP checkpoint build the architecture here; :class:`DistributedGRPOTrainer`
    shards it and gives each rank room for its own shards only. accelerate's
    ``init_empty_weights(include_buffers=False)`` does exactly this for any HF model."""
    from accelerate import init_empty_weights

    return init_empty_weights(include_buffers=False)


def leave_group(code: int = 0) -> NoReturn:
    """End this rank's process: tear the process group down, flush stdio, ``os._exit(code)``.

    Why not return and let Python exit: after its last collective, a gloo rank sometimes
    aborted in the interpreter's finalization ("terminate called without an active
    exception", about one CI run in three, a different test each time, with or without a
    barrier before ``destroy_process_group``). Finalization destroys C++ objects of c10d and
    gloo (worker threads, pending work that holds tensors) after the interpreter stopped
    being able to run their Python parts. A rank has nothing left to finalize at this
    point: its files are fsynced by the code that wrote them, so it leaves without it.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class FusedLM(torch.nn.Module):
    """The FSDP root: one forward that runs the decoder and the chunked head of ``lm``,
    so the root's parameters are gathered around both (see the module docstring)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out: tuple[torch.Tensor, torch.Tensor] = completion_stats(self.lm, *args)
        return out

    def completion_stats(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """What :func:`node.rl.logprobs.token_logprobs_and_entropy` calls: through
        ``__call__`` so that FSDP's hooks run."""
        out: tuple[torch.Tensor, torch.Tensor] = self(*args)
        return out


def shard(lm: torch.nn.Module, dtype: torch.dtype = torch.float32) -> FusedLM:
    """Wrap ``lm`` with FSDP2 over the default process group: each decoder layer a unit,
    then :class:`FusedLM` as root. Parameters stay fp32 (the optimizer's master copy);
    ``dtype`` is the compute dtype of forward and backward (the run's policy dtype),
    gradients are reduced in fp32."""
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    model: Any = lm
    decoder: Any = model.get_decoder() if hasattr(model, "get_decoder") else model
    for layer in decoder.layers:
        fully_shard(layer, mp_policy=mp)
    root = FusedLM(lm)
    fully_shard(root, mp_policy=mp)
    return root


def _tied_names(lm: torch.nn.Module) -> dict[str, str]:
    """Every parameter name that is an alias of another (tied embeddings) -> the first name."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in lm.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


class DistributedGRPOTrainer(GRPOTrainer):
    """:class:`GRPOTrainer` with the model sharded by FSDP2 over the process group (which must
    be initialised, e.g. by :func:`init_distributed`). Every rank calls :meth:`step` with the
    same groups (:func:`broadcast_groups`); only rank 0's ``behaviour`` is read.

    The same numbers as one process, to fp rounding (``tests/rl/test_fsdp.py``); not supported:
    a KL reference model (``kl_coef`` > 0) and the full-logits path (``logprob_chunk_tokens``
    0 runs chunked)."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: GRPOConfig,
        *,
        pad_token_id: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        keep_versions: int = 0,
    ) -> None:
        if config.kl_coef > 0:
            raise ValueError("the distributed trainer has no KL reference model (kl_coef must be 0)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dtype = dtype
        on_meta = any(p.is_meta for p in model.parameters())
        tie = getattr(model, "tie_weights", None)
        if on_meta and callable(tie):
            # building under meta_model re-registers every parameter, a tied head included, as
            # its own meta tensor: tie again, or the head would train apart from the embeddings
            tie()
        self._aliases = _tied_names(model)
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()} if on_meta else {}
        # shard first, then move: only this rank's shards (and one unit at a time while
        # sharding) ever reach the device, never the whole model
        self.root = shard(model, dtype)
        if on_meta:
            # parameters never existed here: room for this rank's shards only; their values come
            # from rank 0 (adopt_rank0_weights) or the checkpoint (load_state). Buffers were built
            # for real (meta_model) and to_empty erased them: put them back.
            model.to_empty(device=device)
            with torch.no_grad():
                for n, b in model.named_buffers():
                    if n in buffers:
                        b.copy_(buffers[n])
        model.to(device)
        self._live: list[torch.Tensor] | None = None  # local shards put aside while a behaviour version is loaded
        super().__init__(model, config, pad_token_id=pad_token_id, device=device, keep_versions=keep_versions)

    # ------------------------------------------------------------------ model passes
    def _logprobs(self, model: Any, rollouts: Sequence[Rollout]) -> tuple[torch.Tensor, ...]:
        if model is not self.model:
            return super()._logprobs(model, rollouts)
        b = len(rollouts)
        k = -(-b // self.world)
        mine = list(rollouts[self.rank * k : (self.rank + 1) * k])
        run = mine or list(rollouts[:1])  # an empty slice still takes part in every collective
        lp, ent, _ = token_logprobs_and_entropy(
            self.root,
            run,
            self.config.temperature,
            self.pad_token_id,
            self.device,
            chunk_tokens=self.chunk_tokens or self._sized_chunk_tokens(),
        )
        pack = torch.stack([lp, ent])
        if not mine:
            pack = pack * 0.0
        width = max(len(r.completion_tokens) for r in rollouts)
        pack = F.pad(pack, (0, width - pack.shape[2], 0, k - pack.shape[1]))
        from torch.distributed.nn.functional import all_gather

        full = torch.cat(all_gather(pack), dim=1)[:, :b]
        lengths = torch.tensor([len(r.completion_tokens) for r in rollouts], device=self.device)
        mask = (torch.arange(width, device=self.device).unsqueeze(0) < lengths.unsqueeze(1)).float()
        return full[0], full[1], mask

    # ------------------------------------------------------------------ behaviour weights
    def old_logprobs(
        self, rollouts: Sequence[Rollout], behaviour: BehaviourWeights | None = None, live: int | None = None
    ) -> list[torch.Tensor | None]:
        try:
            return super().old_logprobs(rollouts, behaviour, live)
        finally:
            self._restore_live()

    def _behaviour_forward(self, version: int, behaviour: BehaviourWeights | None) -> Any:
        """Rank 0 decides (it alone holds the published weights) and broadcasts the weights
        into the sharded model; every rank returns the same answer."""
        if version < 0:
            return None
        state: Mapping[str, torch.Tensor] | None = None
        if self.rank == 0:
            state = behaviour(version) if behaviour is not None else self._snapshots.get(version)
        have = [state is not None]
        dist.broadcast_object_list(have, src=0)
        if have[0]:
            self._load_full(state or {})
            return self.model
        if version == self.version:
            self._restore_live()
            return self.model
        return None

    def _load_full(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a full (published) state dict held by rank 0 into every rank's shards,
        keeping the live shards aside for :meth:`_restore_live`."""
        self._reshard()
        if self._live is None:
            self._live = [p.detach().clone() for p in self.model.parameters()]
        full: dict[str, Any] = {}
        if self.rank == 0:
            own = self.model.state_dict()
            full = {
                k: state[k] if k in state else state[self._aliases.get(k, k)]
                for k in own
                if k in state or self._aliases.get(k) in state
            }
            missing = [k for k, v in self.model.named_parameters() if k not in full]
            if missing:
                raise ValueError(f"behaviour weights lack {len(missing)} parameters, e.g. {missing[:3]}")
            full = {k: v.to(dtype=own[k].dtype) for k, v in full.items()}
        set_model_state_dict(
            self.model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        )

    def adopt_rank0_weights(self, full: Mapping[str, torch.Tensor]) -> None:
        """Collective: every rank's shards take rank 0's weights (``full``, its model's state
        dict from before sharding; ignored elsewhere). Starts a group from one model."""
        self._load_full(full)
        self._live = None

    def _restore_live(self) -> None:
        if self._live is None:
            return
        self._reshard()
        with torch.no_grad():
            for p, saved in zip(self.model.parameters(), self._live):
                p.copy_(saved)
        self._live = None

    def _reshard(self) -> None:
        """Put the root's parameters back to their shards: FSDP2 keeps a root's parameters
        gathered (plain tensors) after a forward without backward, and ``parameters()`` then
        lists those instead of the sharded DTensors."""
        root: Any = self.root  # an FSDPModule since fully_shard
        root.reshard()

    def _weights_copy(self) -> dict[str, torch.Tensor]:
        """The full weights on rank 0 (an empty dict elsewhere): snapshots are read by rank 0."""
        return self.full_state_dict()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank calls it; rank 0 gets the full weights on CPU, the others {}."""
        sd: Any = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return dict(sd) if self.rank == 0 else {}

    # ------------------------------------------------------------------ publishing
    def export(self, out_dir: str | os.PathLike[str], dtype: torch.dtype | None = None) -> Path | None:
        """Collective: gather the full weights on rank 0, which writes them as a plain HF folder
        (safetensors + config) for workers, floating tensors in ``dtype`` (the run's policy dtype;
        None: as trained); returns the folder on rank 0, None elsewhere."""
        sd = self.full_state_dict()
        if self.rank != 0:
            return None
        if dtype is not None:
            sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
        out = Path(out_dir)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
        _swap_in(tmp, out)
        return out

    # ------------------------------------------------------------------ checkpoints
    def write_checkpoint_files(self, folder: str | os.PathLike[str]) -> None:
        """Collective. The group's whole state into the new, empty ``folder``, fsynced (files,
        then folder): a DCP folder (every rank writes its shards of model and optimizer), the LM
        config and the counters. Nothing here is atomic: the caller gives the folder its final
        name by one rename once this returns (``save_checkpoint``, ``node.roles.resume``)."""
        tmp = Path(folder)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp / DCP_DIR)
        dist.barrier()  # every rank's shards are written before rank 0 seals the folder
        if self.rank == 0:
            self.model.config.save_pretrained(tmp)
            (tmp / "grpo_config.json").write_text(json.dumps(self.config.to_dict(), indent=1))
            attn = getattr(self.model.config, "_attn_implementation", None)
            state = {"version": self.version, "opt_steps": self._opt_steps, "world": self.world, "attn": attn}
            (tmp / STATE_FILE).write_text(json.dumps(state))
            fsync_tree(tmp)
        dist.barrier()

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Collective. :meth:`write_checkpoint_files` into ``<path>.tmp``, swapped in by rank 0
        with one rename once every rank has written: a crash leaves the previous one whole."""
        out = Path(path)
        tmp = out.with_name(out.name + ".tmp")
        self.write_checkpoint_files(tmp)
        if self.rank == 0:
            _swap_in(tmp, out)
        dist.barrier()
        return out

    def load_state(self, path: str | os.PathLike[str], restore_rng: bool = True) -> None:
        """Collective: model and optimizer from a DCP checkpoint written by any number of ranks."""
        import torch.distributed.checkpoint as dcp

        p = Path(path)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        both: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        dcp.load(both, checkpoint_id=p / DCP_DIR)
        set_state_dict(self.model, self.optimizer, model_state_dict=both["model"], optim_state_dict=both["optim"])
        state = json.loads((p / STATE_FILE).read_text())
        self.version = int(state["version"])
        self._opt_steps = int(state["opt_steps"])
        self._set_lr()

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        *,
        config: GRPOConfig | None = None,
        pad_token_id: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        restore_rng: bool = True,
    ) -> DistributedGRPOTrainer:
        """Collective: rebuild the trainer from :meth:`save_checkpoint`'s folder on this group,
        whatever number of ranks wrote it (DCP reshards)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        p = Path(path)
        if config is None:
            config = GRPOConfig.from_dict(json.loads((p / "grpo_config.json").read_text()))
        state = json.loads((p / STATE_FILE).read_text())
        kwargs = {"attn_implementation": state["attn"]} if state.get("attn") else {}
        lm_config = AutoConfig.from_pretrained(p)
        with meta_model():
            model = AutoModelForCausalLM.from_config(lm_config, dtype=torch.float32, **kwargs)
        trainer = cls(model.eval(), config, pad_token_id=pad_token_id, device=device, dtype=dtype)
        trainer.load_state(p, restore_rng=restore_rng)
        return trainer


def _swap_in(tmp: Path, out: Path) -> None:
    """Replace ``out`` by ``tmp``: one rename when ``out`` is absent, else the previous one is
    moved aside first and removed after (as :meth:`GRPOTrainer.save_checkpoint` does)."""
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    fsync_dir(out.parent)


def broadcast_groups(groups: Sequence[Sequence[Rollout]] | None) -> list[list[Rollout]]:
    """Collective: rank 0's groups for this step, on every rank (others pass None)."""
    box: list[Any] = [list(map(list, groups)) if groups is not None else None]
    dist.broadcast_object_list(box, src=0)
    out: list[list[Rollout]] = box[0]
    return out


__all__ = [
    "COLLECTIVE_TIMEOUT",
    "DistributedGRPOTrainer",
    "FusedLM",
    "backend_for",
    "broadcast_groups",
    "init_distributed",
    "leave_group",
    "meta_model",
    "shard",
]
