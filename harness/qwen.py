"""A small random Qwen2-architecture model folder with a Qwen-style tokenizer, built offline.

What makes it Qwen-like, and what each trait tests:

* a byte-level BPE tokenizer (trained here on a few sentences), with ``<|endoftext|>``
  (pad), ``<|im_start|>`` and ``<|im_end|>`` (EOS) as *added* special tokens whose ids
  lie past the tokenizer's ``vocab_size``, and a ChatML chat template: prompts go through
  the template, completions end on an id that a bound by ``vocab_size`` would refuse;
* the model's embedding has more rows than the tokenizer has ids (Qwen pads its
  vocabulary to a multiple of 64), grouped-query attention and tied embeddings
  (Qwen2.5-0.5B's ``tie_word_embeddings``): checkpoints without ``lm_head.weight``;
* the folder is what ``save_pretrained`` writes (config.json, generation_config.json,
  model.safetensors, tokenizer files), plus an unrelated README that a run must not pin.
"""

from __future__ import annotations

from pathlib import Path

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CORPUS = [
    "You are a careful mathematician. Reason step by step before answering.",
    "Let's think step by step and output the final answer within \\boxed{}.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? The answer is 72.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) { } \\boxed{42} system user assistant",
]


def qwen_tokenizer():
    """A byte-level BPE tokenizer with Qwen's added special tokens and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    core.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    tok.add_special_tokens(
        {"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]}
    )
    tok.chat_template = CHATML
    assert tok.eos_token_id >= tok.vocab_size  # the trait under test: an added EOS past vocab_size
    return tok


def qwen_folder(path: Path, seed: int = 0, eos_bias: float = 0.4):
    """Write the model folder at ``path``; returns its tokenizer. ``eos_bias`` makes the EOS
    row of the (tied) embedding point along the final norm, so completions end on it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = qwen_tokenizer()
    rows = -(-len(tok) // 64) * 64  # padded like Qwen's 151,936 rows for 151,665 ids
    config = Qwen2Config(
        vocab_size=rows,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight[tok.eos_token_id] = model.model.norm.weight * eos_bias
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    (path / "README.md").write_text("not part of the model\n")
    return tok
