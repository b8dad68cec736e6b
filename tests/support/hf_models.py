"""Tiny transformers models of several families, written to local directories (config.json and
a tokenizer, no weights): what `model: hf:<directory>` trains in the tests, offline.

The shapes keep every projection's dimensions multiples of 16, so the FP8 backends convert
them; the vocabulary (320) is larger than the byte tokenizer's 256 ids, as a real model's often
is larger than its tokenizer's."""
from __future__ import annotations

import os

VOCAB = 320
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def family_config(family: str):
    """The transformers config of a tiny model of `family`."""
    import transformers as t
    if family == "llama":
        return t.LlamaConfig(**SHAPE, tie_word_embeddings=False)
    if family == "qwen3":   # q/k norms, explicit head_dim, tied embeddings
        return t.Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=True)
    if family == "gemma":   # scaled embeddings, GeGLU, (1 + w) norms, tied embeddings
        return t.GemmaConfig(**SHAPE, head_dim=16)
    if family == "mistral":  # sliding-window attention
        return t.MistralConfig(**SHAPE, sliding_window=32, tie_word_embeddings=False)
    if family == "gpt2":    # Conv1D projections: no FP8 backend converts them
        return t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                            bos_token_id=0, eos_token_id=0)
    raise ValueError(family)


FAMILIES = ("llama", "qwen3", "gemma")   # the three every capability is proven on


def write_model(directory: str, family: str, weights: bool = False, seed: int = 0) -> str:
    """A model directory: config.json and the byte tokenizer (256 ids); with `weights`, random
    weights too (for init_from: pretrained). Returns the directory."""
    import torch
    import transformers
    from fp8train.evaluate.hf_export import byte_tokenizer

    os.makedirs(directory, exist_ok=True)
    config = family_config(family)
    if weights:
        torch.manual_seed(seed)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    else:
        config.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory
