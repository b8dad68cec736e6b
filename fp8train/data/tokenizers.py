"""Every tokenizer, one class each, behind one interface: `name`, `vocab_size`, `eot` (the
end-of-text id that separates documents, or None), `encode(text)`, `encode_batch(texts)` and
`decode(ids)`.

Training on a text corpus uses `build_tokenizer` (bytes: 256 ids); scripts/prepare_data.py uses
`prepare_tokenizer`, which needs an end-of-text token (bytes: 256 ids and the end-of-text id
256; gpt2 through tiktoken where it is installed). transformers and tiktoken are imported only
when such a tokenizer is made.
"""
from __future__ import annotations

import os

import numpy as np

from ..errors import BadInput
from ..hub import is_path, load_pretrained


class ByteTokenizer:
    """UTF-8 bytes as tokens: 256 ids, no files, no downloads. `eot=True` adds the end-of-text
    id 256 (257 ids), as prepared shards have."""
    name = "byte"

    def __init__(self, eot: bool = False):
        self.vocab_size = 257 if eot else 256
        self.eot = 256 if eot else None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts) -> list:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64)
                for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class TiktokenGPT2:
    """GPT-2's BPE through tiktoken: several times faster than the HF tokenizer."""
    name, vocab_size = "gpt2", 50257

    def __init__(self):
        import tiktoken
        self.enc = tiktoken.get_encoding("gpt2")
        self.eot = self.enc.eot_token

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.enc.encode_ordinary(text), dtype=np.int64)

    def encode_batch(self, texts) -> list:
        return [np.asarray(ids, dtype=np.int64) for ids in self.enc.encode_ordinary_batch(texts)]

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in ids])


class HFTokenizer:
    """Any `transformers.AutoTokenizer`, by hub name or local directory. `what` names the
    setting in errors ("key 'tokenizer'", "--tokenizer"). `eot=True`: its end-of-text id
    (eos_token, else <|endoftext|>) is required, to separate documents."""

    def __init__(self, name: str, what: str = "key 'tokenizer'", eot: bool = False):
        if is_path(name) and not os.path.exists(name):
            raise BadInput(f"{what}: cannot load tokenizer '{name}' (no such directory)")
        import transformers
        from huggingface_hub.utils import logging as hub_logging
        transformers.utils.logging.set_verbosity_error()  # no "sequence too long" warnings
        hub_logging.set_verbosity_error()  # no line per download retry
        self.tok = load_pretrained(transformers.AutoTokenizer, name, what, "tokenizer")
        self.name = name
        self.vocab_size = len(self.tok)
        self.eot = self._eot() if eot else None

    def _eot(self) -> int:
        eot = self.tok.eos_token_id
        if eot is None:
            eot = self.tok.convert_tokens_to_ids("<|endoftext|>")
            if eot == self.tok.unk_token_id:
                eot = None
        if eot is None:
            raise BadInput(f"tokenizer '{self.name}' has no end-of-text token (eos_token or "
                           "<|endoftext|>) to separate documents")
        return int(eot)

    def encode(self, text: str) -> np.ndarray:
        # Encode in chunks of lines: one huge string is slow for some tokenizers.
        lines = text.splitlines(keepends=True)
        chunks = ["".join(lines[i:i + 2000]) for i in range(0, len(lines), 2000)]
        ids = [np.asarray(self.tok(c, add_special_tokens=False)["input_ids"], dtype=np.int64)
               for c in chunks]
        return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)

    def encode_batch(self, texts) -> list:
        out = self.tok(list(texts), add_special_tokens=False)["input_ids"]
        return [np.asarray(ids, dtype=np.int64) for ids in out]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def build_tokenizer(name: str):
    """The tokenizer a run on a text corpus uses (and samples decode with)."""
    return ByteTokenizer() if name == "byte" else HFTokenizer(name)


def prepare_tokenizer(name: str):
    """The tokenizer scripts/prepare_data.py uses: one with an end-of-text token."""
    if name == "byte":
        return ByteTokenizer(eot=True)
    if name == "gpt2":
        try:  # tiktoken is several times faster than the HF tokenizer, where it is installed
            return TiktokenGPT2()
        except Exception:
            pass
    return HFTokenizer(name, what="--tokenizer", eot=True)
