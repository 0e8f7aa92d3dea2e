"""InferenceEngine on Hugging Face transformers: batched, KV-cached seeded Gumbel-max
sampling (``proofs.sampling``: each completion's tokens follow from its seed alone,
whatever the batch), and capture of the final-norm hidden states for
TOPLOC proofs during that same generation (a forward hook on the final norm, so
no second pass).

Rows are left-padded; positions come from the attention mask, so a padded row
sees the same positions as an unpadded one. On CPU compute stays fp32, the stack
the run's TOPLOC thresholds are calibrated for (on this AVX512-BF16 CPU bf16
matmuls are ~3x faster, but a bf16 validator drifts to the tight limit against
fp32 proofs: docs/benchmarks.md); proofs cast the captured states to bf16.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from node.engines.base import Completion, check_seeds, read_tensors
from proofs.sampling import seeded_choice
from protocol.delta import DeltaRecord
from protocol.messages import SamplingParams


def final_norm(model: Any) -> torch.nn.Module:
    """The module whose output is the last hidden state (Llama-style ``model.model.norm``)."""
    for path in ("model.norm", "model.model.norm", "transformer.ln_f", "gpt_neox.final_layer_norm"):
        mod: Any = model
        for part in path.split("."):
            mod = getattr(mod, part, None)
            if mod is None:
                break
        if isinstance(mod, torch.nn.Module):
            return mod
    raise ValueError(f"cannot find the final norm of {type(model).__name__}")


# checkpoint dtype -> (numpy view of its bit patterns, torch dtype): a delta carries bits
_BITS_AS: dict[str, tuple[str, torch.dtype]] = {
    "F32": ("<i4", torch.float32),
    "BF16": ("<i2", torch.bfloat16),
    "F16": ("<i2", torch.float16),
    "F64": ("<i8", torch.float64),
}


class TransformersEngine:
    """``TransformersEngine(model, device="cpu")``; ``model`` is a causal LM
    (e.g. LlamaForCausalLM). ``max_batch`` caps rows per forward (memory)."""

    def __init__(
        self,
        model: Any,
        *,
        device: str | torch.device | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        max_batch: int = 64,
    ) -> None:
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device).eval()
        eos = eos_token_id
        if eos is None:
            gen_cfg = getattr(model, "generation_config", None)
            eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
            if eos is None:
                eos = getattr(model.config, "eos_token_id", None)
        self._eos_ids: set[int] = set([eos] if isinstance(eos, int) else (eos or []))
        self._eos: int | None = eos if isinstance(eos, int) else (next(iter(eos)) if eos else None)
        self.pad_token_id = pad_token_id if pad_token_id is not None else (self._eos if self._eos is not None else 0)
        self.max_batch = max_batch
        self._captured: list[torch.Tensor] | None = None
        final_norm(model).register_forward_hook(self._hook)

    # ------------------------------------------------------------ interface

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self._eos_ids)

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer: every token id the model can emit."""
        return int(self.lm_head_weight().shape[0])

    def lm_head_weight(self) -> torch.Tensor:
        """The (V, H) output matrix a validator multiplies final hidden states with."""
        head = self.model.get_output_embeddings()
        if head is None or getattr(head, "bias", None) is not None:
            raise ValueError(f"{type(self.model).__name__} has no bias-free output layer to replay sampling with")
        return head.weight.detach()

    @property
    def numerics(self) -> str:
        """The numerics stack, as a run genesis names it: "transformers-fp32-cpu"."""
        dtype = next(self.model.parameters()).dtype
        name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
        return f"transformers-{name}-{self.device.type}"

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        seeds: Sequence[Sequence[int]],
        capture_hidden: bool = False,
    ) -> list[list[Completion]]:
        check_seeds(prompts, n, seeds)
        if n < 1 or params.max_tokens < 1:
            raise ValueError("n and max_tokens must be >= 1")
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise ValueError(f"bad sampling params {params}")
        rows: list[tuple[int, list[int], int]] = []
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty: generation needs at least one token")
            rows += [(i, [int(t) for t in prompt], j) for j in range(n)]
        done: list[Completion] = []
        for start in range(0, len(rows), self.max_batch):
            part = rows[start : start + self.max_batch]
            done += self._generate_batch(
                [p for _, p, _ in part], [seeds[i][j] for i, _, j in part], params, capture_hidden
            )
        return [done[i * n : (i + 1) * n] for i in range(len(prompts))]

    def prefill_hidden(self, prompt_tokens: Sequence[int], completion_tokens: Sequence[int]) -> torch.Tensor:
        return self.prefill_hidden_batch([(prompt_tokens, completion_tokens)])[0]

    def prefill_hidden_batch(
        self,
        pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
        token_budget: int | None = None,
        max_pad: float = 0.25,
    ) -> list[torch.Tensor]:
        """Validator side, batched (an addition to the interface): final-norm states of
        prompt + claimed completion, fp32 CPU, in the order given, from the base model
        (no LM head). The cost is all matmuls, so the aim is to compute no token twice
        and no padding:

        * completions that share a prompt (a GRPO group) share one prefill of it: the
          prompt runs once, its KV cache is repeated for the group's completions;
        * other sequences are sorted by length and cut into micro-batches of at most
          ``token_budget`` padded tokens (default: the generation batch cap times the
          longest sequence) whose rows are padded by at most ``max_pad`` of their width.

        Rows are right-padded and run without an attention mask: attention is causal,
        so a real token never sees the padding after it, and SDPA takes its unmasked path."""
        prompts = [[int(t) for t in p] for p, _ in pairs]
        comps = [[int(t) for t in c] for _, c in pairs]
        if any(len(p) + len(c) == 0 for p, c in zip(prompts, comps)):
            raise ValueError("empty sequence: nothing to prefill")
        out: list[torch.Tensor | None] = [None] * len(pairs)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(tuple(p), []).append(i)
        rest: list[int] = []
        for prompt, members in groups.items():
            if len(members) < 2 or not prompt or self._base() is None:
                rest += members
                continue
            for start in range(0, len(members), self.max_batch):
                part = members[start : start + self.max_batch]
                for i, hidden in zip(part, self._forward_group(list(prompt), [comps[i] for i in part])):
                    out[i] = hidden
        seqs = {i: prompts[i] + comps[i] for i in rest}
        order = sorted(rest, key=lambda i: -len(seqs[i]))
        start = 0
        while start < len(order):
            width = len(seqs[order[start]])  # the longest of this micro-batch (sorted)
            budget = token_budget or self.max_batch * width
            end = start + 1
            while (
                end < len(order)
                and end - start < self.max_batch
                and (end + 1 - start) * width <= budget
                and width - len(seqs[order[end]]) <= max_pad * width
            ):
                end += 1
            part = order[start:end]
            for i, hidden in zip(part, self._forward_hidden([seqs[i] for i in part])):
                out[i] = hidden
            start = end
        return [h for h in out if h is not None]

    def _base(self) -> Any:
        """The base model whose output is the final norm's (Llama-style), or None."""
        base = getattr(self.model, "model", None)
        return base if base is not None and final_norm(self.model) is getattr(base, "norm", None) else None

    def _right_padded(self, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
        ids = torch.full((len(seqs), max(len(s) for s in seqs)), self.pad_token_id, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        return ids.to(self.device)

    def _forward_hidden(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """Final-norm states of right-padded rows, no mask (see prefill_hidden_batch)."""
        ids = self._right_padded(seqs)
        base = self._base()
        with torch.inference_mode():
            if base is not None:
                hidden = base(input_ids=ids, use_cache=False).last_hidden_state
            else:  # generic path: run the whole LM (one logit row), read the hook
                self._captured = []
                try:
                    self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
                    hidden = self._captured[0]
                finally:
                    self._captured = None
        return [hidden[b, : len(s)].float().cpu() for b, s in enumerate(seqs)]

    def _forward_group(self, prompt: list[int], comps: list[list[int]]) -> list[torch.Tensor]:
        """One prompt, several completions: prefill the prompt once, repeat its KV cache
        per completion, then run the right-padded completions on top of it."""
        base = self._base()
        with torch.inference_mode():
            first = base(input_ids=self._right_padded([prompt]), use_cache=True)
            head = first.last_hidden_state[0].float().cpu()
            if max(len(c) for c in comps) == 0:
                return [head.clone() for _ in comps]
            cache = first.past_key_values
            cache.batch_repeat_interleave(len(comps))
            ids = self._right_padded(comps)
            pos = torch.arange(len(prompt), len(prompt) + ids.shape[1], device=self.device)
            hidden = base(
                input_ids=ids, position_ids=pos.expand(len(comps), -1), past_key_values=cache, use_cache=True
            ).last_hidden_state
        return [torch.cat([head, hidden[b, : len(c)].float().cpu()]) for b, c in enumerate(comps)]

    def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        """Copy new weights into the live parameters (no re-allocation, hooks stay).
        Tied weights (lm_head = embeddings) may be absent, as in HF checkpoints."""
        own = self.model.state_dict()
        unexpected = sorted(set(state_dict) - set(own))
        missing = sorted(set(own) - set(state_dict))
        if getattr(self.model.config, "tie_word_embeddings", False):
            missing = [k for k in missing if k != "lm_head.weight"]
        if unexpected or missing:
            raise ValueError(f"state dict does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, value in state_dict.items():
            if tuple(own[name].shape) != tuple(value.shape):
                raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(own[name].shape)}")
        with torch.no_grad():
            for name, value in state_dict.items():
                own[name].copy_(torch.as_tensor(value).to(own[name].dtype))

    # a role hands load_delta the changed tensors' names, not decoded elements: reading the
    # changed tensors whole from the verified new files beat decoding the delta's elements
    # (docs/benchmarks.md, "full reload vs delta in place": 0.94 s of decoding on SmolLM2)
    delta_values = False

    def load_delta(self, changes: Iterable[Any], files: Mapping[str, Any] | None = None) -> list[str]:
        """Move the live weights to the next version in place from a sparse delta; a tensor
        the delta does not name is not touched. Two forms of ``changes``:

        - names only (``protocol.delta.DeltaRecord``: the delta's records, what
          ``Checkpoints.delta_changes(values=False)`` gives a role): each changed tensor is
          read whole from ``files``, the new version's ``{path: file}`` (checked against
          its signed root before this is called), and copied into the parameter;
        - decoded (objects with ``name``, ``dtype`` (the checkpoint's safetensors dtype),
          ``numel``, ``positions`` (flat indices, or None for every element) and ``values``
          (the new bit patterns as unsigned ints of the dtype's size), as
          ``node.checkpoints.delta.iter_changes`` gives them): only the changed elements
          are written.

        New values are cast to the parameter's dtype exactly as a full load casts them.
        Everything is checked against the model before anything is written. Returns the
        names of the tensors written."""
        changes = list(changes)
        if changes and isinstance(changes[0], DeltaRecord):  # names only: whole tensors from files
            return self._load_tensors([c.name for c in changes], files)
        own = self.model.state_dict()
        todo = []
        for c in changes:
            if c.name not in own:
                raise ValueError(f"delta names {c.name!r}, which the model does not have")
            if own[c.name].numel() != c.numel:
                raise ValueError(f"{c.name}: delta for {c.numel} elements, the model has {own[c.name].numel()}")
            if c.dtype not in _BITS_AS:
                raise ValueError(f"{c.name}: no in-place load for dtype {c.dtype}")
            todo.append(c)
        with torch.no_grad():
            for c in todo:
                signed, torch_dtype = _BITS_AS[c.dtype]
                vals = torch.from_numpy(c.values.view(signed)).view(torch_dtype)
                flat = own[c.name].view(-1)
                vals = vals.to(device=flat.device, dtype=flat.dtype)
                if c.positions is None:
                    flat.copy_(vals)
                else:
                    flat[torch.from_numpy(c.positions).to(flat.device)] = vals
        return [c.name for c in todo]

    def _load_tensors(self, names: list[str], files: Mapping[str, Any] | None) -> list[str]:
        own = self.model.state_dict()
        unknown = [n for n in names if n not in own]
        if unknown:
            raise ValueError(f"delta names {unknown[:5]}, which the model does not have")
        tensors = read_tensors(names, files)
        for name, value in tensors.items():
            if tuple(own[name].shape) != tuple(value.shape):
                raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(own[name].shape)}")
        with torch.no_grad():
            for name, value in tensors.items():
                own[name].copy_(value.to(own[name].dtype))
        return sorted(tensors)

    # ------------------------------------------------------------ internals

    def _hook(self, _module: Any, _inputs: Any, output: Any) -> None:
        if self._captured is not None:
            self._captured.append((output[0] if isinstance(output, tuple) else output).detach())

    def _left_pad(self, seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[b, width - len(s) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        return ids.to(self.device), mask.to(self.device), pos.to(self.device)

    def _sample(
        self, logits: torch.Tensor, seeds: list[int], position: int, params: SamplingParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token (seeded Gumbel-max at completion ``position``) and its log-probability
        under the temperature-scaled distribution (top-p/top-k change what can be drawn,
        not the reported log-probability)."""
        logits = logits.float()
        tokens = seeded_choice(logits, seeds, [position] * len(seeds), params)
        logp = torch.log_softmax(logits / params.temperature if params.temperature > 0 else logits, dim=-1)
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]

    def _generate_batch(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        params: SamplingParams,
        capture: bool,
    ) -> list[Completion]:
        batch = len(prompts)
        ids, mask, pos = self._left_pad(prompts)
        width = ids.shape[1]
        tokens: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        rows: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        active = [True] * batch
        next_pos = torch.tensor([len(p) for p in prompts], device=self.device)
        self._captured = [] if capture else None
        try:
            with torch.inference_mode():
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
                if capture:
                    prefill = self._captured.pop()  # type: ignore[union-attr]
                    for b, p in enumerate(prompts):
                        rows[b].append(prefill[b, width - len(p) :].float().cpu())
                cache, logits = out.past_key_values, out.logits[:, -1, :]
                for step in range(params.max_tokens):
                    new, lps = self._sample(logits, seeds, step, params)
                    fed = list(active)
                    new_list, lp_list = new.tolist(), lps.tolist()
                    for b in range(batch):
                        if active[b]:
                            tokens[b].append(new_list[b])
                            logprobs[b].append(lp_list[b])
                            if new_list[b] in self._eos_ids:
                                active[b], finish[b] = False, "stop"
                    more = any(active) and step + 1 < params.max_tokens
                    if not more and not capture:
                        break
                    # Feed what was just sampled: the next logits, and (when capturing)
                    # the hidden state of that token; finished rows get padding.
                    feed = torch.tensor(
                        [new_list[b] if fed[b] else self.pad_token_id for b in range(batch)], device=self.device
                    )
                    mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=self.device)], dim=1)
                    out = self.model(
                        input_ids=feed[:, None],
                        attention_mask=mask,
                        position_ids=next_pos[:, None],
                        past_key_values=cache,
                        use_cache=True,
                        logits_to_keep=1,
                    )
                    next_pos = next_pos + 1
                    if capture:
                        state = self._captured.pop()  # type: ignore[union-attr]
                        for b in range(batch):
                            if fed[b]:
                                rows[b].append(state[b, -1:].float().cpu())
                    if not more:
                        break
                    cache, logits = out.past_key_values, out.logits[:, -1, :]
        finally:
            self._captured = None
        return [
            Completion(
                prompt_tokens=list(prompts[b]),
                tokens=tokens[b],
                logprobs=logprobs[b],
                seed=seeds[b],
                finish_reason=finish[b],
                hidden=torch.cat(rows[b], dim=0) if capture else None,
            )
            for b in range(batch)
        ]
