"""Per-token log-probabilities and entropies of completions, without the ``[tokens, vocab]`` logits.

A causal LM's forward returns fp32-castable logits for every position of every sequence:
``batch x length x vocab`` numbers, about 20 GB for one micro-batch of 8 x 4,096 tokens at
Qwen's 151,936-entry vocabulary, most of them for prompt positions the loss never reads.
The trainer needs two numbers per *completion* token: ``log p(token)`` and the entropy.

So the decoder runs without its head; the final hidden states of the positions that predict
completion tokens are gathered (``[tokens, hidden]``); and the head, the log-softmax and the
entropy run over chunks of those rows, each chunk under activation checkpointing: the
backward pass recomputes one chunk's logits at a time instead of keeping every chunk's. Peak
extra memory is then a few chunks of ``[chunk, vocab]`` fp32, whatever the batch
(Liger-Kernel's fused linear cross-entropy and prime-rl's chunked log-softmax do the same
on GPUs; this is the plain-torch version, so it runs on any device).

``chunk_tokens`` 0 keeps the full-logits path (``model(...).logits``), only so that
bench/trainer_memory.py can compare before and after in one run; both paths agree to fp32
rounding (``tests/rl/test_rl_logprobs.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Bytes of fp32 logits per chunk: with the softmax and the backward's copies, a chunk costs
# about four times this at its peak. Sized by the model (``chunk_bytes_for``): a quarter of a
# byte per parameter within 16-64 MiB. Measured on SmolLM2-135M (bf16, fp32 masters): 64 MiB
# chunks put the step's peak 170 MiB (+10 % of the state) higher than 32 MiB ones, 16 MiB saved
# only 20 MiB more and cost 2 s a step (+15 %: each chunk's backward makes a whole
# [vocab, hidden] head gradient); at Qwen2.5-0.5B's size 64 MiB and 16 MiB peak alike and
# 16 MiB costs 25 % more seconds (docs/benchmarks.md, "Trainer memory").
CHUNK_BYTES = 64 << 20
MIN_CHUNK_BYTES = 16 << 20


class HasTokens(Protocol):
    """What is read of a rollout (``node.rl.grpo.Rollout``)."""

    prompt_tokens: list[int]
    completion_tokens: list[int]


def chunk_bytes_for(params: int | None) -> int:
    """fp32 logit bytes per head chunk for a model of ``params`` parameters: ``params / 4``
    within [``MIN_CHUNK_BYTES``, ``CHUNK_BYTES``] (SmolLM2-135M: 32 MiB; Qwen2.5-0.5B and
    larger: 64 MiB); unknown size: the ceiling. Smaller chunks only add per-chunk cost."""
    if not params:
        return CHUNK_BYTES
    return min(CHUNK_BYTES, max(MIN_CHUNK_BYTES, params // 4))


def default_chunk_tokens(vocab: int, params: int | None = None) -> int:
    """Completion rows per head chunk so that one chunk's fp32 logits take
    :func:`chunk_bytes_for` ``(params)`` (without ``params``, 64 MiB: about 110 rows at Qwen's
    vocabulary, 340 at SmolLM2's; sized, 171 rows for SmolLM2-135M)."""
    return max(16, chunk_bytes_for(params) // (4 * max(1, vocab)))


def _padded_batch(
    rollouts: Sequence[HasTokens], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = [list(r.prompt_tokens) + list(r.completion_tokens) for r in rollouts]
    total = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), total), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), total), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, : len(s)] = 1
    return ids.to(device), attn.to(device)


def _head_stats(
    hidden: torch.Tensor, targets: torch.Tensor, head: Any, temperature: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log p(target)`` and the entropy of ``softmax(head(hidden) / temperature)`` per row."""
    logits = head(hidden).float()
    if softcap:  # Gemma-2 style final logit soft-capping, as the model's own forward applies it
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    tok_lp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    probs = torch.softmax(logits, dim=-1)
    entropy = lse - (probs * logits).sum(-1)
    return tok_lp, entropy


def _parts(model: Any) -> tuple[Any, Any, int]:
    """The decoder, the LM head and the vocabulary of a transformers causal LM, or of a
    wrapper that runs one under other weights (``node.rl.grpo.WithWeights.parts``)."""
    if hasattr(model, "parts"):
        decoder, head, vocab = model.parts()
        return decoder, head, int(vocab)
    head = model.get_output_embeddings()
    return model.get_decoder(), head, int(head.weight.shape[0])


def _softcap(model: Any) -> float | None:
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return float(cap) if cap else None


def completion_stats(
    model: Any,
    ids: torch.Tensor,
    attn: torch.Tensor,
    rows: torch.Tensor,
    src: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_tokens: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log p`` and entropy of ``targets`` at positions ``(rows, src)`` of the padded batch:
    the decoder once, then the head over chunks of the gathered rows (see the module doc)."""
    decoder, head, vocab = _parts(model)
    hidden = decoder(input_ids=ids, attention_mask=attn).last_hidden_state[rows, src]
    step = chunk_tokens or default_chunk_tokens(vocab)
    softcap = _softcap(getattr(model, "model", model))  # a WithWeights wraps the model
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for s in range(0, hidden.shape[0], step):
        h, t = hidden[s : s + step], targets[s : s + step]
        if torch.is_grad_enabled() and h.requires_grad:
            out = checkpoint(_head_stats, h, t, head, temperature, softcap, use_reentrant=False)
        else:
            out = _head_stats(h, t, head, temperature, softcap)
        parts.append(out)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def token_logprobs_and_entropy(
    model: Any,
    rollouts: Sequence[HasTokens],
    temperature: float,
    pad_token_id: int,
    device: torch.device,
    *,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-completion-token log p and entropy under ``softmax(logits / temperature)``.

    Returns (logprobs, entropy, mask), each (batch, longest completion), right-padded.
    ``chunk_tokens``: completion rows per head chunk (None: :func:`default_chunk_tokens`;
    0: the full-logits path). Gradients flow when autograd is on."""
    ids, attn = _padded_batch(rollouts, pad_token_id, device)
    lengths = [(len(r.prompt_tokens), len(r.completion_tokens)) for r in rollouts]
    max_c = max(c for _, c in lengths)
    rows = torch.tensor([i for i, (_, c) in enumerate(lengths) for _ in range(c)], dtype=torch.long, device=device)
    cols = torch.tensor([k for _, c in lengths for k in range(c)], dtype=torch.long, device=device)
    # the position whose hidden state predicts completion token k is prompt_len - 1 + k
    src = torch.tensor([p - 1 + k for p, c in lengths for k in range(c)], dtype=torch.long, device=device)
    targets = ids[rows, src + 1]
    lp = torch.zeros((len(rollouts), max_c), device=device)
    ent = torch.zeros((len(rollouts), max_c), device=device)
    mask = torch.zeros((len(rollouts), max_c), device=device)
    if rows.numel() == 0:
        return lp, ent, mask
    mask[rows, cols] = 1.0
    if chunk_tokens == 0:
        logits = model(input_ids=ids, attention_mask=attn).logits.float() / temperature
        picked = logits[rows, src]
        log_probs = F.log_softmax(picked, dim=-1)
        tok_lp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        tok_ent = -(log_probs.exp() * log_probs).sum(-1)
    else:
        # a module whose own forward runs decoder and head (node.rl.distributed: an FSDP root
        # must see the head run inside its forward, or its parameters are never gathered)
        fused = getattr(model, "completion_stats", None)
        args = (ids, attn, rows, src, targets, temperature, chunk_tokens)
        tok_lp, tok_ent = fused(*args) if fused is not None else completion_stats(model, *args)
    lp = lp.index_put((rows, cols), tok_lp)
    ent = ent.index_put((rows, cols), tok_ent)
    return lp, ent, mask


def logits_bytes(rollouts: Sequence[HasTokens], vocab: int) -> int:
    """fp32 bytes of the full ``[batch, length, vocab]`` logits the unchunked path holds."""
    longest = max((len(r.prompt_tokens) + len(r.completion_tokens) for r in rollouts), default=0)
    return 4 * len(rollouts) * longest * vocab


def micro_batches(lengths: Sequence[int], token_budget: int, max_rows: int = 0) -> list[tuple[int, int]]:
    """Cut consecutive sequences into ``[start, end)`` spans whose padded size (rows x the
    longest row) stays within ``token_budget`` (a single longer sequence gets a span alone);
    ``max_rows`` > 0 also caps the rows per span."""
    spans: list[tuple[int, int]] = []
    start, longest = 0, 0
    for i, n in enumerate(lengths):
        wider = max(longest, n)
        rows = i - start + 1
        if i > start and (wider * rows > token_budget or (max_rows and rows > max_rows)):
            spans.append((start, i))
            start, wider = i, n
        longest = wider
    if lengths:
        spans.append((start, len(lengths)))
    return spans


__all__ = [
    "CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "chunk_bytes_for",
    "completion_stats",
    "default_chunk_tokens",
    "logits_bytes",
    "micro_batches",
    "token_logprobs_and_entropy",
]
