"""Data for training: prepared token shards (scripts/prepare_data.py) or a small text corpus
tokenized on the fly -> windows of seq_len + 1 tokens.

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
from .errors import one_line

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
            raise ConfigError(f"key 'tokenizer': cannot load tokenizer '{name}' "
                              f"({one_line(e, 200, first_line=True)})") from None
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
    if not os.path.isfile(dataset):
        raise ConfigError(f"key 'dataset': file '{dataset}' not found")
    return dataset


@dataclass
class TokenSplits:
    train: "np.ndarray | ShardedTokens"
    val: "np.ndarray | ShardedTokens"
    vocab_size: int
    source: str = ""            # where the tokens came from, for the log


def load_splits(cfg, log=print, fetch=lambda f: f()) -> "TokenSplits":
    """The run's train and val tokens: prepared shards when `dataset` names them (checked,
    memory-mapped), else a text corpus tokenized here. `fetch(f)` runs the corpus lookup (which
    may download tinyshakespeare): the trainer runs it on rank 0 alone."""
    if cfg.dataset == "synthetic":
        return synthetic_splits()
    directory = prepared_dir(cfg.dataset, cfg.data_dir)
    if directory is not None:
        return load_prepared(directory, cfg.dataset, cfg.data_dir, cfg.tokenizer, cfg.seq_len)
    tokenizer = build_tokenizer(cfg.tokenizer)
    fetch(lambda: corpus_path(cfg.dataset, cfg.data_dir, log))
    return load_tokens(cfg.dataset, cfg.data_dir, tokenizer, cfg.seq_len, cfg.val_fraction)


PREPARED = ("fineweb-edu", "openwebtext")  # known datasets that exist only as prepared shards


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
                  seq_len: int) -> TokenSplits:
    """Memory-map a prepared dataset and check it before any step runs: complete, headers valid,
    sizes matching, token ids inside the vocabulary, the tokenizer the run says, each split
    longer than one window."""
    from .shards import read_header, read_meta, open_shard
    if not os.path.isfile(os.path.join(directory, "meta.json")):
        if dataset in PREPARED:
            raise ConfigError(f"dataset '{dataset}' is not prepared: '{directory}/meta.json' "
                              f"not found; run: {prepare_command(dataset, data_dir)}")
        read_meta(directory)  # raises with the reason
    meta = read_meta(directory)
    try:  # hand-edited or from another tool: a bad field is a config error, not a traceback
        vocab = int(meta["vocab_size"])
        shard_names = {split: [str(n) for n in meta["splits"].get(split, {}).get("shards", [])]
                       for split in ("train", "val")}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ConfigError(f"'{os.path.join(directory, 'meta.json')}' is not a valid prepared-"
                          "dataset description (missing or malformed 'vocab_size' or 'splits'); "
                          "prepare the dataset again with scripts/prepare_data.py") from None
    if meta.get("tokenizer") != tokenizer_name:
        raise ConfigError(f"key 'tokenizer' is '{tokenizer_name}' but '{directory}' was prepared "
                          f"with tokenizer '{meta.get('tokenizer')}' (vocabulary {vocab:,}); set "
                          f"tokenizer: {meta.get('tokenizer')}")
    parts = {}
    for split in ("train", "val"):
        arrays = []
        for name in shard_names[split]:
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                raise ConfigError(f"shard '{path}' listed in meta.json is missing")
            h = read_header(path)
            if h.vocab_size != vocab or h.max_token >= vocab:
                raise ConfigError(f"shard '{path}': token ids up to {h.max_token} / vocabulary "
                                  f"{h.vocab_size}, but the dataset's vocabulary is {vocab}: "
                                  "a tokenizer mismatch; prepare the dataset again")
            arrays.append(open_shard(path))
        parts[split] = ShardedTokens(arrays)
        if len(parts[split]) < seq_len + 1:
            raise ConfigError(f"dataset '{directory}': the {split} split has "
                              f"{len(parts[split]):,} tokens, fewer than seq_len + 1 = "
                              f"{seq_len + 1}")
    return TokenSplits(parts["train"], parts["val"], vocab,
                       f"{directory} ({len(shard_names['train'])} train shards)")


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


# ------------------------------------------------------------------------------------------------
# Batches
# ------------------------------------------------------------------------------------------------

class ShardedTokens:
    """Several memory-mapped shards read as one token sequence."""

    def __init__(self, arrays: list):
        self.arrays = [a for a in arrays if len(a)]
        self.bounds = np.cumsum([0] + [len(a) for a in self.arrays])

    def __len__(self) -> int:
        return int(self.bounds[-1])

    def take(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows tokens[s : s + length] for each start s, as int64."""
        out = np.empty((len(starts), length), dtype=np.int64)
        shard = np.searchsorted(self.bounds, starts, side="right") - 1
        for k in np.unique(shard):
            rows = np.nonzero(shard == k)[0]
            local = starts[rows] - self.bounds[k]
            inside = local + length <= len(self.arrays[k])
            if inside.all():  # the common case: one fancy-indexed read per shard
                out[rows] = self.arrays[k][local[:, None] + np.arange(length)]
                continue
            for r, lo in zip(rows, local):  # windows that cross into the next shard
                out[r] = self._slice(int(self.bounds[k] + lo), length)
        return out

    def _slice(self, start: int, length: int) -> np.ndarray:
        parts, k = [], int(np.searchsorted(self.bounds, start, side="right") - 1)
        while length > 0:
            lo = start - int(self.bounds[k])
            piece = self.arrays[k][lo:lo + length]
            parts.append(piece)
            length -= len(piece)
            start += len(piece)
            k += 1
        return np.concatenate(parts)


def take_windows(tokens, starts: np.ndarray, length: int) -> np.ndarray:
    if isinstance(tokens, ShardedTokens):
        return tokens.take(starts, length)
    return tokens[starts[:, None] + np.arange(length)[None, :]].astype(np.int64)


class RandomWindows:
    """Training windows in a random order that visits every window once per epoch, keyed on the
    global sequence number.

    The training tokens are cut into n = (tokens - 1) // seq_len windows (inputs tokens[w·T :
    w·T + T], targets shifted by one). Sequence g of the run (g = step × effective batch +
    position in the step) is window perm_e(g mod n) of epoch e = g // n, where perm_e is a
    keyed bijection of [0, n) (a Feistel network with cycle walking: no table, no state). So
    within an epoch no two sequences, and therefore no two ranks, read the same window; the
    data a run sees depends only on the seed and the effective batch, not on how it is split
    into micro-batches, accumulation steps and ranks; and the step counter is the data position.
    """

    def __init__(self, tokens, seq_len: int, seed: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.n_windows = (len(tokens) - 1) // seq_len
        self.key = _splitmix64(np.array([seed], dtype=np.uint64))[0]
        bits = max(2, int(self.n_windows - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)

    def starts(self, first: int, count: int) -> np.ndarray:
        g = np.arange(first, first + count, dtype=np.int64)
        epoch, j = np.divmod(g, self.n_windows)
        return self._permute(j.astype(np.uint64), epoch.astype(np.uint64)) * self.seq_len

    def _permute(self, x: np.ndarray, epoch: np.ndarray) -> np.ndarray:
        out = x.copy()
        todo = np.ones(len(x), dtype=bool)
        while todo.any():  # cycle walking: re-encrypt until the value lands in [0, n)
            out[todo] = self._feistel(out[todo], epoch[todo])
            todo = out >= np.uint64(self.n_windows)
        return out.astype(np.int64)

    def _feistel(self, x: np.ndarray, epoch: np.ndarray) -> np.ndarray:
        half, mask = np.uint64(self.half), self.mask
        left, right = x >> half, x & mask
        for r in range(4):
            k = _splitmix64(self.key ^ (epoch * np.uint64(0x9E3779B1) + np.uint64(r + 1)))
            left, right = right, left ^ (_splitmix64(right ^ k) & mask)
        return (left << half) | right

    def batch(self, first: int, count: int):
        """(inputs, targets) for global sequences first .. first + count - 1."""
        return _windows(self.tokens, self.starts(first, count), self.seq_len)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A fast, well-mixed 64-bit hash (Steele et al.'s SplitMix64 finaliser); uint64 wraps."""
    with np.errstate(over="ignore"):
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


def _windows(tokens, starts: np.ndarray, seq_len: int):
    import torch
    w = torch.from_numpy(take_windows(tokens, starts, seq_len + 1))
    return w[:, :-1], w[:, 1:]


class BatchStream:
    """This rank's micro-batches in training order: sequences position + rank offset + m × micro
    for each micro-step m, then the next step at position + effective batch. With depth > 0 a
    background thread prepares them ahead (numpy slicing releases the GIL) and pins them for
    non-blocking copies to a GPU, so the loop never waits for data."""

    def __init__(self, windows: RandomWindows, position: int, rank_offset: int, micro: int,
                 accum: int, effective: int, pin: bool, depth: int):
        self.windows, self.micro, self.pin = windows, micro, pin
        self.firsts = self._firsts(position, rank_offset, micro, accum, effective)
        self.queue = None
        if depth > 0:
            import queue
            import threading
            self.queue = queue.Queue(maxsize=depth)
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._fill, daemon=True, name="batch-prefetch")
            self.thread.start()

    @staticmethod
    def _firsts(position, rank_offset, micro, accum, effective):
        while True:
            for m in range(accum):
                yield position + rank_offset + m * micro
            position += effective

    def _make(self):
        x, y = self.windows.batch(next(self.firsts), self.micro)
        return (x.pin_memory(), y.pin_memory()) if self.pin else (x, y)

    def _fill(self) -> None:
        while not self.stop.is_set():
            try:
                item = self._make()
            except BaseException as e:  # handed to the loop, which raises it
                item = e
            while not self.stop.is_set():
                try:
                    self.queue.put(item, timeout=0.1)
                    break
                except Exception:  # queue.Full: the loop is busy; check stop and retry
                    continue
            if isinstance(item, BaseException):
                return

    def next(self):
        if self.queue is None:
            return self._make()
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        # Joined, not just told: a daemon thread still inside torch when the interpreter exits
        # can abort the process ("terminate called without an active exception").
        if self.queue is not None:
            self.stop.set()
            self.thread.join(timeout=10)
