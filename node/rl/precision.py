"""Megatron-style mixed precision for a bf16 run: bf16 parameters, fp32 master weights in the optimizer.

A bf16 policy trained under autocast keeps fp32 parameters (the masters), fp32 gradients
and fp32 AdamW moments: 16 bytes per parameter at the peak of a step, plus autocast's bf16
copy of every weight while the forward runs. Here the model's parameters *are* bf16 (the
forward and backward run in bf16 and produce bf16 gradients, 2 bytes), and only the
optimizer holds fp32: the master weights and AdamW's two moments (12 bytes). Model +
optimizer state is 14 bytes per parameter and the gradients add 2 (+14 %), where an fp32
trainer's add 4 to 12 (+33 %) (docs/benchmarks.md, "Trainer memory").

The update never makes an fp32 copy of a whole gradient:

1. the global gradient norm is computed in fp32 from the bf16 gradients, a slice at a time
   (each slice upcast, its norm taken in fp32; the norm of those norms is the total, as
   ``clip_grad_norm_`` takes the norm of per-tensor norms);
2. each parameter is then updated a slice of at most ``slice_elems`` elements at a time:
   the gradient slice upcast to fp32 and multiplied by the clip coefficient, AdamW on the
   master's, the moments' and that gradient's slices (torch's own AdamW kernel, fused where
   the device has it: AdamW is element-wise, so slices compute exactly what the whole
   tensor would), then the master slice rounded into the bf16 parameter.

So the largest temporary is one slice (16 MiB of fp32 by default) instead of the tied
embedding / head's whole fp32 gradient (545 MB at Qwen's vocabulary). The result equals
fp32 AdamW applied to the upcast gradients (``tests/roles/test_precision.py``).

What it costs in learning: gradients are bf16. Within one backward autograd sums in bf16
(each op's gradient is computed in fp32 inside the kernels and rounded once), and across
micro-batches the accumulated gradient is rounded to bf16 after each micro-batch
(``bench/precision.py`` measures both against fp32 and against autocast).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adamw import adamw

# fp32 elements per update slice: 16 MiB of temporary gradient at most
SLICE_ELEMS = 1 << 22
FORMAT = "fp32-master-adamw/1"


class MasterAdamW:
    """AdamW over fp32 master copies of low-precision parameters.

    Built from parameters that are still fp32 (the model as loaded): each fp32 tensor becomes
    the master (no copy) and the parameter gets a ``dtype`` copy of it, the same object
    (tied weights stay tied). After every update each parameter holds its master rounded to
    ``dtype`` and nothing else, which is what the run publishes.

    Looks enough like a torch optimizer for the trainer (``param_groups`` for the learning
    rate, ``zero_grad``, ``state_dict``); :meth:`step` clips and updates in one call because
    the clip coefficient must be known before the first slice is updated."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        dtype: torch.dtype,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        slice_elems: int = SLICE_ELEMS,
    ) -> None:
        self.params = list(params)
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("a parameter appears twice (pass model.parameters(), which de-duplicates tied weights)")
        self.dtype = dtype
        self.slice_elems = max(1, slice_elems)
        self.param_groups: list[dict[str, Any]] = [{"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}]
        self.fused = all(p.device.type in ("cpu", "cuda") for p in self.params)
        self.master: list[torch.Tensor] = []
        self.exp_avg: list[torch.Tensor] = []
        self.exp_avg_sq: list[torch.Tensor] = []
        self.steps: list[torch.Tensor] = []
        with torch.no_grad():
            for p in self.params:
                master = p.detach().to(torch.float32).contiguous()  # an fp32 parameter's own storage
                p.data = master.to(dtype)
                self.master.append(master)
                self.exp_avg.append(torch.zeros_like(master))
                self.exp_avg_sq.append(torch.zeros_like(master))
                self.steps.append(torch.zeros((), dtype=torch.float32))

    # ------------------------------------------------------------------ the update
    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def _slices(self, n: int) -> range:
        return range(0, n, self.slice_elems)

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients, accumulated in fp32 from the low-precision
        gradients a slice at a time (never a whole fp32 gradient)."""
        norms = []
        for p in self.params:
            if p.grad is None:
                continue
            flat = p.grad.detach().reshape(-1)
            for a in self._slices(flat.numel()):
                norms.append(torch.linalg.vector_norm(flat[a : a + self.slice_elems].to(torch.float32)))
        if not norms:
            return torch.zeros((), dtype=torch.float32)
        return torch.linalg.vector_norm(torch.stack(norms))

    @torch.no_grad()
    def step(self, max_grad_norm: float | None = None) -> torch.Tensor:
        """Clip (``clip_grad_norm_``'s rule: coefficient ``max / (norm + 1e-6)``, at most 1,
        applied always) and update every parameter that has a gradient, slice by slice.
        Returns the norm before clipping. Parameters without a gradient are skipped, their
        step count unchanged, as torch's AdamW does."""
        total = self.grad_norm()
        coef = None
        if max_grad_norm is not None:
            coef = torch.clamp(max_grad_norm / (total + 1e-6), max=1.0)
        g0 = self.param_groups[0]
        beta1, beta2 = g0["betas"]
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            grad = p.grad.detach().reshape(-1)
            live = p.data.view(-1)
            master, m1, m2 = self.master[i].view(-1), self.exp_avg[i].view(-1), self.exp_avg_sq[i].view(-1)
            for a in self._slices(master.numel()):
                b = a + self.slice_elems
                g = grad[a:b].to(torch.float32, copy=True)  # the only fp32 gradient: one slice
                if coef is not None:
                    g.mul_(coef)
                step = self.steps[i].clone()  # the kernel counts it up by one, per call
                adamw(
                    [master[a:b]],
                    [g],
                    [m1[a:b]],
                    [m2[a:b]],
                    [],
                    [step],
                    fused=self.fused or None,
                    foreach=False if not self.fused else None,
                    amsgrad=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=g0["lr"],
                    weight_decay=g0["weight_decay"],
                    eps=g0["eps"],
                    maximize=False,
                )
                live[a:b].copy_(master[a:b])
            self.steps[i].add_(1)
        return total

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Master weights, moments and step counts per parameter (in ``model.parameters()``
        order), the hyper-parameters and the parameters' dtype."""
        return {
            "format": FORMAT,
            "param_dtype": str(self.dtype).removeprefix("torch."),
            "state": {
                i: {"step": s, "master": w, "exp_avg": m1, "exp_avg_sq": m2}
                for i, (s, w, m1, m2) in enumerate(zip(self.steps, self.master, self.exp_avg, self.exp_avg_sq))
            },
            "param_groups": [dict(g) for g in self.param_groups],
        }

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, or take the moments of a torch AdamW state dict (a
        checkpoint of the autocast trainer, whose fp32 parameters were loaded as the masters
        already). Anything else is refused with the reason."""
        if "format" in sd and sd["format"] != FORMAT:
            raise ValueError(f"unknown optimizer state format {sd['format']!r}")
        state = sd.get("state", {})
        if len(state) != len(self.params) and state:
            raise ValueError(f"optimizer state for {len(state)} parameters, the model has {len(self.params)}")
        for i, p in enumerate(self.params):
            st = state.get(i)
            if st is None:  # torch omits parameters that never had a gradient
                continue
            if tuple(st["exp_avg"].shape) != tuple(p.shape):
                raise ValueError(
                    f"optimizer state {i} has shape {tuple(st['exp_avg'].shape)}, the parameter {tuple(p.shape)}"
                )
            if sd.get("format") == FORMAT:
                self.master[i].copy_(st["master"])
                p.data.copy_(self.master[i])
            self.exp_avg[i].copy_(st["exp_avg"])
            self.exp_avg_sq[i].copy_(st["exp_avg_sq"])
            self.steps[i].fill_(float(st["step"]))
        groups = sd.get("param_groups") or []
        if groups:
            for key in ("lr", "betas", "eps", "weight_decay"):
                if key in groups[0]:
                    self.param_groups[0][key] = tuple(groups[0][key]) if key == "betas" else groups[0][key]


def is_master_state(sd: dict[str, Any]) -> bool:
    """Whether an optimizer state dict holds fp32 master weights (written by :class:`MasterAdamW`)."""
    return sd.get("format") == FORMAT


__all__ = ["FORMAT", "SLICE_ELEMS", "MasterAdamW", "is_master_state"]
