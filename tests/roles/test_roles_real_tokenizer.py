"""Issue 14 point 6: token ids are bounded by the model's vocabulary as the model sees it.

Qwen's and Llama 3's EOS is an *added* special token: its id is at or past the HF
tokenizer's ``vocab_size`` (which leaves added tokens out), so a bound by ``vocab_size``
rejected every honest completion that ended properly, and struck the honest worker. The
tokenizer here is built offline the same way (a word-level vocabulary plus an added
``<|im_end|>`` EOS), saved with a tiny Llama as a local model folder, and used through the
genesis like any user's model.
"""

from __future__ import annotations

import pytest
import torch

from harness.genesis import WORKERS, tiny_genesis
from harness.roles import engine_for
from node.roles.context import RunContext
from node.roles.rollouts import PolicyFacts, produce_batch, verify_batch
from node.util import now_ms

W = WORKERS[0].peer_id


def _model_folder(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", *"abcdefghijklmnopqrstuvwxyz0123456789", "write", "a", "reply", "of", "about", "tokens", "."]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    tok.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    assert tok.eos_token_id >= tok.vocab_size  # the trap: an added token past vocab_size
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # make the added EOS likely, so honest completions end on it
        model.lm_head.weight[tok.eos_token_id] = model.model.norm.weight * 0.4
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return tok


def test_an_added_special_eos_is_inside_the_vocabulary(tmp_path):
    tok = _model_folder(tmp_path / "model")
    genesis = tiny_genesis(fields={"model": str(tmp_path / "model")}, max_tokens=16)
    ctx = RunContext.from_genesis(genesis.genesis, tmp_path / "cache")
    assert ctx.vocab_size == len(tok) > tok.vocab_size
    engine = engine_for(ctx)
    assert engine.vocab_size == len(tok) and tok.eos_token_id in engine.eos_token_ids
    policy = PolicyFacts(0, b"\x11" * 32, now_ms())
    batch = produce_batch(ctx, engine, W, policy, 0)
    ends = [s.token_ids()[-1] for s in batch.samples]
    assert tok.eos_token_id in ends  # honest completions that end on the added EOS ...
    v = verify_batch(ctx, engine, batch, W, policy)
    assert v.accept, v.reason  # ... are accepted


def test_ids_past_the_models_output_rows_are_still_refused(tmp_path):
    """The adversarial side of the same bound: an id the model cannot emit."""
    from harness.attacks import forged_batch

    tok = _model_folder(tmp_path / "model")
    ctx = RunContext.from_genesis(
        tiny_genesis(fields={"model": str(tmp_path / "model")}, max_tokens=16).genesis, tmp_path / "cache"
    )
    engine = engine_for(ctx)
    policy = PolicyFacts(0, b"\x11" * 32, now_ms())
    past = len(tok)  # one past the last row
    with pytest.raises(IndexError):  # not even an honest prefill can run it ...
        forged_batch(ctx, engine, W, policy, 0, lambda *_: [past])
    from dataclasses import replace

    from protocol import Sample

    honest = produce_batch(ctx, engine, W, policy, 0)
    bad = replace(
        honest, samples=(replace(honest.samples[0], completion=Sample.pack_tokens([past])), *honest.samples[1:])
    )
    v = verify_batch(ctx, engine, bad, W, policy)  # ... and the validator refuses it before any prefill
    assert not v.accept and v.rule == "tokens", v.reason
