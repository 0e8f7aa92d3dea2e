"""InferenceEngine on vLLM (optional extra; not installed on the CPU dev machine).

vLLM exposes no hidden states, so (as measured, see the shared notes) we run the
engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), reach its model runner and
hook the final norm; each forward's rows are split per request with the runner's
``input_batch.req_ids`` and ``query_start_loc`` (~4% throughput).

vLLM never feeds the last sampled token back, so its hidden state is missing:
we ask for one token more than wanted and drop it (a "length" finish), and for a
row that stopped on EOS we take that one missing row from a prefill of the
completed sequence on the pooling runner (the validator path), at the cost of a
prefill for those rows only. Validators use ``prefill_hidden`` (pooling runner,
``token_embed`` without activation), which matched transformers within 8e-5.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import torch

from .base import Completion, SamplingConfig
from .transformers_engine import completion_seed


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VLLMEngine:
    """``VLLMEngine(model_path, dtype="float32", **llm_kwargs)``: a HF model folder
    (e.g. the SmolLM2 cache from node.models). Construct under ``if __name__ == "__main__"``
    in scripts; CPU builds need ``VLLM_CPU_KVCACHE_SPACE`` (we default it to 2 GiB)."""

    def __init__(self, model_path: str, *, dtype: str = "float32", **llm_kwargs: Any) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        from vllm import LLM

        self.model_path = model_path
        self.dtype = dtype
        self._llm_kwargs = dict(enforce_eager=True, **llm_kwargs)
        try:  # log-probabilities after temperature, like the transformers engine
            self.llm = LLM(model=model_path, dtype=dtype, logprobs_mode="processed_logprobs", **self._llm_kwargs)
        except TypeError:
            self.llm = LLM(model=model_path, dtype=dtype, **self._llm_kwargs)
        self._runner = self.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        self._rows: dict[str, list[torch.Tensor]] | None = None
        self._runner.model.model.norm.register_forward_hook(self._hook)
        self._pooler: Any = None
        eos = self.llm.get_tokenizer().eos_token_id
        self._eos = int(eos) if eos is not None else None

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    # ------------------------------------------------------------ capture

    def _hook(self, _module: Any, _inputs: Any, output: Any) -> None:
        if self._rows is None:
            return
        hidden = output[0] if isinstance(output, tuple) else output
        runner = self._runner
        req_ids = list(runner.input_batch.req_ids)
        qsl = getattr(runner, "query_start_loc_cpu", None)
        if qsl is None:
            loc = runner.query_start_loc
            qsl = getattr(loc, "cpu", loc)
        starts = [int(v) for v in torch.as_tensor(qsl)[: len(req_ids) + 1].tolist()]
        for i, rid in enumerate(req_ids):
            if rid is None:
                continue
            rows = hidden[starts[i] : starts[i + 1]].detach().float().cpu()
            self._rows.setdefault(str(rid), []).append(rows)

    def _rows_for(self, request_id: str) -> torch.Tensor:
        assert self._rows is not None
        keys = [k for k in self._rows if k == request_id or k.startswith(f"{request_id}-") or k.endswith(f"_{request_id}")]
        if len(keys) != 1:
            raise RuntimeError(f"cannot map vLLM request {request_id} to captured rows ({len(keys)} candidates)")
        return torch.cat(self._rows[keys[0]], dim=0)

    # ------------------------------------------------------------ interface

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingConfig,
        seeds: Sequence[int],
        capture_hidden: bool = False,
    ) -> list[list[Completion]]:
        from vllm import SamplingParams

        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: generation needs at least one token")
        extra = 1 if capture_hidden else 0  # the extra token makes vLLM feed the last wanted one
        requests, sampling, owners = [], [], []
        for i, prompt in enumerate(prompts):
            for j in range(n):  # one request per completion: its own seed, its own hidden rows
                requests.append({"prompt_token_ids": [int(t) for t in prompt]})
                sampling.append(
                    SamplingParams(
                        n=1,
                        temperature=params.temperature,
                        top_p=params.top_p,
                        max_tokens=params.max_tokens + extra,
                        seed=completion_seed(seeds[i], j),
                        logprobs=0,
                    )
                )
                owners.append(i)
        self._rows = {} if capture_hidden else None
        try:
            outputs = self.llm.generate(requests, sampling_params=sampling, use_tqdm=False)
            result: list[list[Completion]] = [[] for _ in prompts]
            missing: list[Completion] = []
            for req, out, owner in zip(requests, outputs, owners):
                seq = out.outputs[0]
                tokens = list(seq.token_ids)
                logprobs = [float(d[t].logprob) for d, t in zip(seq.logprobs or [], tokens)]
                finish = "stop" if seq.finish_reason == "stop" else "length"
                if len(tokens) > params.max_tokens:
                    tokens, logprobs, finish = tokens[: params.max_tokens], logprobs[: params.max_tokens], "length"
                hidden = None
                if capture_hidden:
                    rows = self._rows_for(str(out.request_id))
                    hidden = rows[: len(req["prompt_token_ids"]) + len(tokens)]
                c = Completion(req["prompt_token_ids"], tokens, logprobs, seeds[owner], finish, hidden)
                if capture_hidden and hidden is not None and hidden.shape[0] < len(c.prompt_tokens) + len(tokens):
                    missing.append(c)
                result[owner].append(c)
        finally:
            self._rows = None
        for c in missing:  # stopped on EOS: its own row was never computed
            c.hidden = torch.cat([c.hidden, self.prefill_hidden(c.prompt_tokens, c.tokens)[-1:]], dim=0)
        return result

    def prefill_hidden(self, prompt_tokens: Sequence[int], completion_tokens: Sequence[int]) -> torch.Tensor:
        return self.prefill_hidden_batch([(prompt_tokens, completion_tokens)])[0]

    def prefill_hidden_batch(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[torch.Tensor]:
        pooler = self._pooling_llm()
        prompts = [{"prompt_token_ids": [int(t) for t in p] + [int(t) for t in c]} for p, c in pairs]
        outs = pooler.encode(prompts, pooling_task="token_embed", use_tqdm=False)
        return [torch.as_tensor(o.outputs.data).float().cpu() for o in outs]

    def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        """Hot reload: vLLM's model maps HF names itself; cached prefixes are dropped."""
        self._runner.model.load_weights(weights=((k, torch.as_tensor(v)) for k, v in state_dict.items()))
        self.llm.reset_prefix_cache()
        if self._pooler is not None:
            runner = self._pooler.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
            runner.model.load_weights(weights=((k, torch.as_tensor(v)) for k, v in state_dict.items()))

    def _pooling_llm(self) -> Any:
        if self._pooler is None:
            from vllm import LLM

            self._pooler = LLM(
                model=self.model_path,
                dtype=self.dtype,
                runner="pooling",
                convert="embed",
                pooler_config={"task": "token_embed", "use_activation": False},
                **self._llm_kwargs,
            )
        return self._pooler
