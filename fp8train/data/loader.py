"""The run's train and val tokens: prepared token shards (scripts/prepare_data.py), checked and
memory-mapped; a small text corpus tokenized here; or the synthetic stream of the benchmarks.
Batches are cut from them in windows.py.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..errors import BadInput
from .catalog import PREPARED
from .corpus import corpus_path
from .shards import body_max_ids, open_shard, read_header, read_meta
from .sources import resolved_dataset
from .tokenizers import build_tokenizer
from .windows import ShardedTokens


@dataclass
class TokenSplits:
    train: "np.ndarray | ShardedTokens"
    val: "np.ndarray | ShardedTokens"
    vocab_size: int
    source: str = ""            # where the tokens came from, for the log


def load_splits(cfg, log=print, fetch=lambda f: f()) -> "TokenSplits":
    """The run's train and val tokens (`cfg`: the config's data section): prepared shards when `dataset` names them (checked,
    memory-mapped), else a text corpus tokenized here. `fetch(f)` runs what only one process
    should do (a download of tinyshakespeare, the scan of the shards' token ids): the trainer
    runs it on rank 0 alone."""
    if cfg.dataset == "synthetic":
        splits = synthetic_splits()
        for split, part in (("train", splits.train), ("val", splits.val)):
            _check_window(part, split, "dataset 'synthetic'", cfg.seq_len)
        return splits
    dataset = resolved_dataset(cfg.dataset, cfg.dir)   # as the config does (evaluate.py)
    directory = prepared_dir(dataset, cfg.dir)
    if directory is not None:
        return load_prepared(directory, dataset, cfg.dir, cfg.tokenizer, cfg.seq_len,
                             log, fetch)
    tokenizer = build_tokenizer(cfg.tokenizer)
    fetch(lambda: corpus_path(dataset, cfg.dir, log))
    return load_tokens(dataset, cfg.dir, tokenizer, cfg.seq_len, cfg.val_fraction)


def _check_window(tokens, split: str, what: str, seq_len: int) -> None:
    if len(tokens) < seq_len + 1:
        raise BadInput(f"{what}: the {split} split has {len(tokens):,} tokens, fewer than "
                          f"seq_len + 1 = {seq_len + 1}")


def prepared_dir(dataset: str, data_dir: str):
    """The prepared-shard directory `dataset` names, or None for a text corpus."""
    if os.path.isdir(dataset):
        return dataset
    if dataset in PREPARED:
        return os.path.join(data_dir, dataset)
    if dataset == "tinyshakespeare" and os.path.isfile(
            os.path.join(data_dir, "tinyshakespeare", "meta.json")):
        return os.path.join(data_dir, "tinyshakespeare")
    return None


def prepare_command(dataset: str, data_dir: str) -> str:
    return (f"python scripts/prepare_data.py --dataset {dataset} --tokenizer gpt2 "
            f"--data_dir {data_dir}")


def load_prepared(directory: str, dataset: str, data_dir: str, tokenizer_name: str,
                  seq_len: int, log=print, fetch=lambda f: f()) -> TokenSplits:
    """Memory-map a prepared dataset and check it before any step runs: complete, headers valid,
    sizes matching, every token id inside the vocabulary (scanned once, shards.body_max_ids),
    the tokenizer the run says, each split longer than one window."""
    if not os.path.isfile(os.path.join(directory, "meta.json")):
        if dataset in PREPARED:
            raise BadInput(f"dataset '{dataset}' is not prepared: '{directory}/meta.json' "
                              f"not found; run: {prepare_command(dataset, data_dir)}")
        read_meta(directory)  # raises with the reason
    meta = read_meta(directory)
    try:  # hand-edited or from another tool: a bad field is a config error, not a traceback
        vocab = int(meta["vocab_size"])
        shard_names = {split: [str(n) for n in meta["splits"].get(split, {}).get("shards", [])]
                       for split in ("train", "val")}
        if vocab < 2:
            raise ValueError(vocab)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise BadInput(f"'{os.path.join(directory, 'meta.json')}' is not a valid prepared-"
                          "dataset description (missing or malformed 'vocab_size' or 'splits'); "
                          "prepare the dataset again with scripts/prepare_data.py") from None
    if meta.get("tokenizer") != tokenizer_name:
        raise BadInput(f"key 'tokenizer' is '{tokenizer_name}' but '{directory}' was prepared "
                          f"with tokenizer '{meta.get('tokenizer')}' (vocabulary {vocab:,}); set "
                          f"tokenizer: {meta.get('tokenizer')}")
    parts, headers = {}, {}
    for split in ("train", "val"):
        arrays = []
        for name in shard_names[split]:
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                raise BadInput(f"shard '{path}' listed in meta.json is missing")
            h = headers[name] = read_header(path)
            if h.vocab_size != vocab or h.max_token >= vocab:
                raise BadInput(f"shard '{path}': token ids up to {h.max_token} / vocabulary "
                                  f"{h.vocab_size}, but the dataset's vocabulary is {vocab}: "
                                  "a tokenizer mismatch; prepare the dataset again")
            arrays.append(open_shard(path))
        parts[split] = ShardedTokens(arrays)
        _check_window(parts[split], split, f"dataset '{directory}'", seq_len)
    names = [n for split in ("train", "val") for n in shard_names[split]]
    for name, largest in fetch(lambda: body_max_ids(directory, names, log)).items():
        if largest >= vocab:
            path = os.path.join(directory, name)
            at = int(np.argmax(open_shard(path) >= vocab))
            raise BadInput(f"shard '{path}' holds token id {largest}, outside the dataset's "
                              f"vocabulary of {vocab:,} (the first such id is at position "
                              f"{at:,}; the header says at most {headers[name].max_token}): "
                              "the shard is corrupt; prepare the dataset again with "
                              "scripts/prepare_data.py")
    return TokenSplits(parts["train"], parts["val"], vocab,
                       f"{directory} ({len(shard_names['train'])} train shards)")


def load_tokens(dataset: str, data_dir: str, tokenizer, seq_len: int, val_fraction: float,
                log=print) -> TokenSplits:
    path = corpus_path(dataset, data_dir, log)  # no download when it is already there
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"key 'dataset': cannot read '{path}' as UTF-8 text: {e}") from None
    ids = tokenizer.encode(text)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    ids = ids.astype(dtype, copy=False)
    n_val = int(len(ids) * val_fraction)
    train, val = ids[:len(ids) - n_val], ids[len(ids) - n_val:]
    for name, part in (("training", train), ("validation", val)):
        if len(part) < seq_len + 1:
            raise BadInput(f"key 'dataset': '{path}' gives {len(part):,} {name} tokens, "
                              f"fewer than seq_len + 1 = {seq_len + 1}")
    return TokenSplits(train=train, val=val, vocab_size=tokenizer.vocab_size, source=path)


SYNTHETIC_VOCAB = 50257   # GPT-2's: the LM head of a benchmark is as large as a real run's


def synthetic_splits(train_tokens: int = 1 << 23, val_tokens: int = 1 << 18) -> TokenSplits:
    """A fixed, learnable token stream that needs no files: benchmarks (scripts/bench.py) and
    smoke tests on machines without data. "Words" of 1-6 random tokens are drawn from a Zipf
    distribution over a 16,384-word dictionary, so the loss falls quickly from ln(50257) = 10.8
    and a precision or compile mode that breaks numerics shows within a few hundred steps.
    The same stream every time (fixed seeds)."""
    rng = np.random.default_rng(20261122)
    n_words = 16384
    lengths = rng.integers(1, 7, n_words)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    spelling = rng.integers(0, SYNTHETIC_VOCAB, int(lengths.sum())).astype(np.uint16)
    cdf = np.cumsum(1.0 / np.arange(1, n_words + 1))
    cdf /= cdf[-1]

    def stream(n: int, seed: int) -> np.ndarray:
        u = np.random.default_rng(seed).random(n // 2 + 1)
        words = np.minimum(np.searchsorted(cdf, u), n_words - 1)   # Zipf by inverse CDF
        lens = lengths[words]           # 3.5 tokens per word on average: n // 2 words suffice
        first = np.repeat(np.cumsum(lens) - lens, lens)
        pos = np.repeat(offsets[words], lens) + np.arange(int(lens.sum())) - first
        return spelling[pos][:n]

    return TokenSplits(train=stream(train_tokens, 1), val=stream(val_tokens, 2),
                       vocab_size=SYNTHETIC_VOCAB, source="synthetic (Zipf words, no files)")
