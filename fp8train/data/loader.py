"""Data for training: prepared token shards (scripts/prepare_data.py) or a small text corpus
tokenized on the fly -> windows of seq_len + 1 tokens.

Batches are a pure function of (seed, global sequence number), so the data position is the
step counter and a resumed run draws exactly the batches it would have drawn.
"""
from __future__ import annotations

import hashlib
import os
import urllib.request
from dataclasses import dataclass

import numpy as np

from ..errors import BadInput, one_line
from ..io import atomic_write
from .sources import resolved_dataset

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
    """Any `transformers.AutoTokenizer`, by hub name or local directory. `what` names the
    setting in errors ("key 'tokenizer'", "--tokenizer")."""

    def __init__(self, name: str, what: str = "key 'tokenizer'"):
        if _is_path(name) and not os.path.exists(name):
            raise BadInput(f"{what}: cannot load tokenizer '{name}' (no such directory)")
        import transformers
        from huggingface_hub.utils import logging as hub_logging
        transformers.utils.logging.set_verbosity_error()  # no "sequence too long" warnings
        hub_logging.set_verbosity_error()  # no line per download retry
        self.tok = _load_hf_tokenizer(transformers.AutoTokenizer, name, what)
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


def _load_hf_tokenizer(auto, name: str, what: str):
    """A directory or a cached hub tokenizer loads without any network request. Otherwise the
    hub is asked only when it is allowed (not offline) and answers a single quick request:
    its client retries a dead connection for about a minute per file."""
    def fail(why: str):
        return BadInput(f"{what}: cannot load tokenizer '{name}' ({why})")
    try:
        return auto.from_pretrained(name, local_files_only=True)
    except Exception as e:  # not cached, not a tokenizer directory, no such path
        local_error = one_line(e, 200, first_line=True)
    if os.path.exists(name) or _is_path(name):
        raise fail(local_error)  # a path, not a hub name: the hub cannot help
    if _offline():
        raise fail(f"not in the local HuggingFace cache, and offline mode is set "
                   f"({_offline_variable()}); download it once with network access, or use a "
                   f"local tokenizer directory")
    unreachable = hub_unreachable()
    if unreachable:
        raise fail(f"not in the local HuggingFace cache, and the hub cannot be reached: "
                   f"{unreachable}; download it once with network access, or use a local "
                   f"tokenizer directory")
    try:
        return auto.from_pretrained(name)
    except Exception as e:  # no such repository, not a tokenizer, a failed download
        raise fail(one_line(e, 200, first_line=True)) from None


def _is_path(name: str) -> bool:
    """Spelled as a path: a hub name is "name" or "org/name"."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and \
        os.sep in name


def hub_unreachable(timeout: float = 10.0) -> "str | None":
    """Why the HuggingFace hub (HF_ENDPOINT) cannot be reached, or None when it answers one
    HEAD request, through the same proxy variables its client reads. Any HTTP answer, even an
    error status, means it is reachable."""
    import urllib.error
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or timeout)
    except ValueError:
        pass  # not a number: the default
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"),
                               timeout=timeout).close()
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as e:  # URLError, refused, timed out, a malformed endpoint
        return f"{endpoint}: {one_line(getattr(e, 'reason', None) or e, 150)}"
    return None


def build_tokenizer(name: str):
    return ByteTokenizer() if name == "byte" else HFTokenizer(name)


# ------------------------------------------------------------------------------------------------
# Corpus
# ------------------------------------------------------------------------------------------------

OFFLINE_VARIABLES = ("FP8TRAIN_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                     "TRANSFORMERS_OFFLINE")


def _offline_variable() -> "str | None":
    """The first variable that sets offline mode ("0", "false", "no", "off" do not)."""
    for v in OFFLINE_VARIABLES:
        if os.environ.get(v, "").strip().lower() not in ("", "0", "false", "no", "off"):
            return f"{v}={os.environ[v]}"
    return None


def _offline() -> bool:
    return _offline_variable() is not None


def _download(url: str, dest: str, sha256: str) -> None:
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    with urllib.request.urlopen(url, timeout=30) as r:
        data = r.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise OSError(f"checksum mismatch for {url}")
    atomic_write(dest, data, unique=True)   # an interrupted download never looks complete


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
        raise BadInput(f"dataset 'tinyshakespeare' not found at '{path}' ({how}); "
                          f"download {TINYSHAKESPEARE_URL} to that path, or set data_dir "
                          f"(or FP8TRAIN_DATA_DIR) to the folder that holds tinyshakespeare.txt")
    if not os.path.isfile(dataset):
        raise BadInput(f"key 'dataset': file '{dataset}' not found")
    return dataset


@dataclass
class TokenSplits:
    train: "np.ndarray | ShardedTokens"
    val: "np.ndarray | ShardedTokens"
    vocab_size: int
    source: str = ""            # where the tokens came from, for the log


def load_splits(cfg, log=print, fetch=lambda f: f()) -> "TokenSplits":
    """The run's train and val tokens: prepared shards when `dataset` names them (checked,
    memory-mapped), else a text corpus tokenized here. `fetch(f)` runs what only one process
    should do (a download of tinyshakespeare, the scan of the shards' token ids): the trainer
    runs it on rank 0 alone."""
    if cfg.dataset == "synthetic":
        splits = synthetic_splits()
        for split, part in (("train", splits.train), ("val", splits.val)):
            _check_window(part, split, "dataset 'synthetic'", cfg.seq_len)
        return splits
    dataset = resolved_dataset(cfg.dataset, cfg.data_dir)   # as the config does (evaluate.py)
    directory = prepared_dir(dataset, cfg.data_dir)
    if directory is not None:
        return load_prepared(directory, dataset, cfg.data_dir, cfg.tokenizer, cfg.seq_len,
                             log, fetch)
    tokenizer = build_tokenizer(cfg.tokenizer)
    fetch(lambda: corpus_path(dataset, cfg.data_dir, log))
    return load_tokens(dataset, cfg.data_dir, tokenizer, cfg.seq_len, cfg.val_fraction)


def _check_window(tokens, split: str, what: str, seq_len: int) -> None:
    if len(tokens) < seq_len + 1:
        raise BadInput(f"{what}: the {split} split has {len(tokens):,} tokens, fewer than "
                          f"seq_len + 1 = {seq_len + 1}")


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
                  seq_len: int, log=print, fetch=lambda f: f()) -> TokenSplits:
    """Memory-map a prepared dataset and check it before any step runs: complete, headers valid,
    sizes matching, every token id inside the vocabulary (scanned once, shards.body_max_ids),
    the tokenizer the run says, each split longer than one window."""
    from .shards import body_max_ids, open_shard, read_header, read_meta
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


def eval_sequence_count(val_tokens: int, seq_len: int, requested: int, warn=None) -> int:
    """How many validation windows an evaluation reads: `requested`, or as many disjoint windows
    as the split holds when it holds fewer. More would overlap (1e6 of them over a small split:
    gigabytes of windows, hours of evaluation, no better an estimate)."""
    fits = max(1, (val_tokens - 1) // seq_len)
    if requested > fits and warn is not None:
        warn(f"key 'eval_sequences' ({requested:,}) is more than the validation split holds: "
             f"{val_tokens:,} tokens make {fits:,} windows of seq_len {seq_len}; evaluating on "
             f"{fits:,} (set eval_sequences <= {fits:,}, or prepare a larger validation split)")
    return min(requested, fits)


def val_batches(tokens: np.ndarray, seq_len: int, n_sequences: int, micro: int, warn=None):
    """A fixed set of validation windows, evenly spread over the split, in micro-batches. The
    set depends only on n_sequences (capped by eval_sequence_count), never on the batch plan,
    so val/loss compares like with like across evaluations and across runs."""
    n_sequences = eval_sequence_count(len(tokens), seq_len, n_sequences, warn)
    starts = np.linspace(0, len(tokens) - seq_len - 1, num=n_sequences).astype(np.int64)
    return [_windows(tokens, starts[i:i + micro], seq_len)
            for i in range(0, n_sequences, micro)]


def check_batch_fits(cfg, effective: int, train_tokens: int) -> None:
    """An effective batch larger than the training split's windows would read some windows
    twice in one step (and a huge one builds gigabytes of batches before it fails)."""
    seq_len, windows = cfg.seq_len, (train_tokens - 1) // cfg.seq_len
    key = "batch_size" if cfg.target_effective_batch_size is None else \
        "target_effective_batch_size"
    if effective > windows:
        raise BadInput(f"{cfg.source}: key '{key}': an effective batch of {effective:,} "
                          f"sequences is more than the training split holds ({train_tokens:,} "
                          f"tokens make {windows:,} windows of seq_len {seq_len}); lower {key} "
                          f"(at most {windows:,} sequences per step) or seq_len, or use a larger "
                          "dataset")


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
