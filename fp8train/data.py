"""Minimal data path: a text corpus -> token ids -> random windows of seq_len + 1.

Batches are a pure function of (seed, global sequence number), so the data position is the
step counter and a resumed run draws exactly the batches it would have drawn.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.request
from dataclasses import dataclass

import numpy as np

from .config import ConfigError

TINYSHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt")
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


# ------------------------------------------------------------------------------------------------
# Tokenizers
# ------------------------------------------------------------------------------------------------

class ByteTokenizer:
    """UTF-8 bytes as tokens: 256 ids, no files, no downloads."""
    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """Any `transformers.AutoTokenizer`, by hub name or local directory."""

    def __init__(self, name: str):
        import transformers
        transformers.utils.logging.set_verbosity_error()  # no "sequence too long" warnings
        try:
            self.tok = transformers.AutoTokenizer.from_pretrained(name)
        except Exception as e:  # hub offline, missing dir, not a tokenizer
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"key 'tokenizer': cannot load tokenizer '{name}' "
                              f"({first[:200]})") from None
        self.name = name
        self.vocab_size = len(self.tok)

    def encode(self, text: str) -> np.ndarray:
        # Encode in chunks of lines: one huge string is slow for some tokenizers.
        lines = text.splitlines(keepends=True)
        chunks = ["".join(lines[i:i + 2000]) for i in range(0, len(lines), 2000)]
        ids = [np.asarray(self.tok(c, add_special_tokens=False)["input_ids"], dtype=np.int64)
               for c in chunks]
        return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def build_tokenizer(name: str):
    return ByteTokenizer() if name == "byte" else HFTokenizer(name)


# ------------------------------------------------------------------------------------------------
# Corpus
# ------------------------------------------------------------------------------------------------

def _offline() -> bool:
    return any(os.environ.get(v, "") not in ("", "0") for v in
               ("FP8TRAIN_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _download(url: str, dest: str, sha256: str) -> None:
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    with urllib.request.urlopen(url, timeout=30) as r:
        data = r.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise OSError(f"checksum mismatch for {url}")
    # Write to a temporary name and rename, so an interrupted download never looks complete.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest) or ".", suffix=".part")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, dest)


def corpus_path(dataset: str, data_dir: str, log=print) -> str:
    """The text file behind `dataset`, downloading tinyshakespeare if it is missing."""
    if dataset == "tinyshakespeare":
        path = os.path.join(data_dir, "tinyshakespeare.txt")
        if os.path.isfile(path):
            return path
        how = "offline mode is set" if _offline() else None
        if how is None:
            try:
                log(f"downloading tinyshakespeare to {path}")
                _download(TINYSHAKESPEARE_URL, path, TINYSHAKESPEARE_SHA256)
                return path
            except Exception as e:  # no network, DNS failure, HTTP error, bad checksum
                how = f"download failed: {e}"
        raise ConfigError(f"dataset 'tinyshakespeare' not found at '{path}' ({how}); "
                          f"download {TINYSHAKESPEARE_URL} to that path, or set data_dir "
                          f"(or FP8TRAIN_DATA_DIR) to the folder that holds tinyshakespeare.txt")
    if dataset in ("fineweb-edu", "openwebtext"):
        raise ConfigError(f"dataset '{dataset}' needs prepared token shards under "
                          f"'{os.path.join(data_dir, dataset)}/', and preparing them is not "
                          f"available in this version; use tinyshakespeare or a .txt file")
    if not os.path.isfile(dataset):
        raise ConfigError(f"key 'dataset': file '{dataset}' not found")
    return dataset


@dataclass
class TokenSplits:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int


def load_tokens(dataset: str, data_dir: str, tokenizer, seq_len: int, val_fraction: float,
                log=print) -> TokenSplits:
    path = corpus_path(dataset, data_dir, log)  # no download when it is already there
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"key 'dataset': cannot read '{path}' as UTF-8 text: {e}") from None
    ids = tokenizer.encode(text)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    ids = ids.astype(dtype, copy=False)
    n_val = int(len(ids) * val_fraction)
    train, val = ids[:len(ids) - n_val], ids[len(ids) - n_val:]
    for name, part in (("training", train), ("validation", val)):
        if len(part) < seq_len + 1:
            raise ConfigError(f"key 'dataset': '{path}' gives {len(part):,} {name} tokens, "
                              f"fewer than seq_len + 1 = {seq_len + 1}")
    return TokenSplits(train=train, val=val, vocab_size=tokenizer.vocab_size)


# ------------------------------------------------------------------------------------------------
# Batches
# ------------------------------------------------------------------------------------------------

class RandomWindows:
    """Random windows of the training tokens, keyed on the global sequence number.

    Sequence g of the run (g = step x effective batch + position in the step) always starts at
    the same offset, a hash of (seed, g). So the data a run sees depends only on the seed and
    the effective batch, not on how it is split into micro-batches, accumulation steps and
    ranks; ranks read disjoint sequence numbers; and there is no generator state to save: the
    step counter is the data position.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.n_starts = len(tokens) - seq_len  # start + seq_len + 1 <= len(tokens)
        self.key = _splitmix64(np.array([seed], dtype=np.uint64))[0]

    def starts(self, first: int, count: int) -> np.ndarray:
        g = np.arange(first, first + count, dtype=np.uint64)
        return (_splitmix64(g ^ self.key) % np.uint64(self.n_starts)).astype(np.int64)

    def batch(self, first: int, count: int):
        """(inputs, targets) for global sequences first .. first + count - 1."""
        return _windows(self.tokens, self.starts(first, count), self.seq_len)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A fast, well-mixed 64-bit hash (Steele et al.'s SplitMix64 finaliser); uint64 wraps."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def val_batches(tokens: np.ndarray, seq_len: int, n_sequences: int, micro: int):
    """A fixed set of validation windows, evenly spread over the split, in micro-batches. The
    set depends only on n_sequences, never on the batch plan, so val/loss compares like with
    like across evaluations and across runs."""
    starts = np.linspace(0, len(tokens) - seq_len - 1, num=n_sequences).astype(np.int64)
    return [_windows(tokens, starts[i:i + micro], seq_len)
            for i in range(0, n_sequences, micro)]


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int):
    import torch
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    w = torch.from_numpy(tokens[idx].astype(np.int64))
    return w[:, :-1], w[:, 1:]
