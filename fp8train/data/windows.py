"""Windows of seq_len + 1 tokens and the batches made of them: prepared shards read as one
sequence (ShardedTokens), the training order keyed on the global sequence number
(RandomWindows), the fixed validation windows, and this rank's micro-batches in training order
(BatchStream). torch is imported only when a batch is made.

Batches are a pure function of (seed, global sequence number), so the data position is the
step counter and a resumed run draws exactly the batches it would have drawn.
"""
from __future__ import annotations

import numpy as np

from ..errors import BadInput


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
        return inputs_and_targets(self.tokens, self.starts(first, count), self.seq_len)


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
    return [inputs_and_targets(tokens, starts[i:i + micro], seq_len)
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


def inputs_and_targets(tokens, starts: np.ndarray, seq_len: int):
    """(inputs, targets) as torch tensors: the windows at `starts`, targets shifted by one."""
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
