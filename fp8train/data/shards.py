"""Token shards: flat binary files of token ids behind a fixed 1 KiB header, memory-mapped for
training (as nanoGPT's and llm.c's pre-tokenized shards), plus a meta.json per prepared dataset.

Header (little-endian): magic b"FP8TOKS\\0", format version, bytes per token (2: uint16, 4:
uint32, chosen from the vocabulary size), token count, largest token id in the shard, vocabulary
size, tokenizer name (UTF-8, 256 bytes, zero-padded); zeros up to 1024 bytes. The file size must
be exactly 1024 + count × bytes per token: anything else is a truncated or corrupt shard.
"""
from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass

import numpy as np

from ..errors import BadInput
from ..io import atomic_write, atomic_write_json

MAGIC = b"FP8TOKS\0"
VERSION = 1
HEADER_BYTES = 1024
_HEADER = struct.Struct("<8sIIQII256s")
META_FILE = "meta.json"
CHECKED_FILE = "token_ids_checked.json"   # the largest id in each shard's body, as scanned


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2 ** 16 else np.dtype(np.uint32)


@dataclass(frozen=True)
class ShardHeader:
    itemsize: int
    count: int
    max_token: int
    vocab_size: int
    tokenizer: str

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint16) if self.itemsize == 2 else np.dtype(np.uint32)


def write_shard(path: str, tokens: np.ndarray, vocab_size: int, tokenizer: str) -> None:
    """Write under a temporary name, then rename: a shard that exists is complete."""
    dtype = dtype_for_vocab(vocab_size)
    tokens = np.ascontiguousarray(tokens, dtype=dtype)
    max_token = int(tokens.max()) if len(tokens) else 0
    header = _HEADER.pack(MAGIC, VERSION, dtype.itemsize, len(tokens), max_token, vocab_size,
                          tokenizer.encode("utf-8")[:256])
    def write(fh) -> None:
        fh.write(header.ljust(HEADER_BYTES, b"\0"))
        fh.write(tokens.tobytes())
    atomic_write(path, write, binary=True)


def read_header(path: str) -> ShardHeader:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(HEADER_BYTES)
        size = os.path.getsize(path)
    except OSError as e:
        raise BadInput(f"shard '{path}': cannot read it ({e.strerror or e})") from None
    if len(raw) < _HEADER.size or raw[:8] != MAGIC:
        raise BadInput(f"shard '{path}': not a token shard (bad header magic); prepare the "
                          "dataset again with scripts/prepare_data.py")
    magic, version, itemsize, count, max_token, vocab, name = _HEADER.unpack(raw[:_HEADER.size])
    if version != VERSION or itemsize not in (2, 4):
        raise BadInput(f"shard '{path}': unsupported header (version {version}, "
                          f"{itemsize} bytes per token)")
    expected = HEADER_BYTES + count * itemsize
    if size != expected:
        raise BadInput(f"shard '{path}' is truncated or corrupt: its header says {count:,} "
                          f"tokens ({expected:,} bytes) but the file has {size:,} bytes")
    if max_token >= vocab:
        raise BadInput(f"shard '{path}': token id {max_token} is outside its vocabulary "
                          f"of {vocab}")
    return ShardHeader(itemsize, count, max_token, vocab, name.rstrip(b"\0").decode("utf-8"))


def open_shard(path: str) -> np.memmap:
    h = read_header(path)
    if h.count == 0:
        return np.zeros(0, dtype=h.dtype)
    return np.memmap(path, dtype=h.dtype, mode="r", offset=HEADER_BYTES, shape=(h.count,))


def read_meta(directory: str) -> dict:
    path = os.path.join(directory, META_FILE)
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except OSError:
        raise BadInput(f"'{directory}' has no {META_FILE}: it is not a prepared dataset (or "
                          "its preparation did not finish; run scripts/prepare_data.py again, "
                          "it resumes)") from None
    except ValueError as e:
        raise BadInput(f"'{path}' is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or "splits" not in meta:
        raise BadInput(f"'{path}' is not a prepared-dataset description (no 'splits')")
    return meta


def write_meta(directory: str, meta: dict) -> None:
    atomic_write_json(os.path.join(directory, META_FILE), meta, indent=1, sort_keys=True)


def body_max_ids(directory: str, names: list, log=print) -> dict:
    """The largest token id in the body of each shard `names` of `directory`: a vectorised max
    over the memory map, done once and recorded in CHECKED_FILE beside the shards, keyed by each
    shard's size and modification time, so a shard that changed since is scanned again. The
    header's own max is not enough: it is written by whatever wrote the shard. A directory that
    cannot be written (a read-only shared copy) is scanned on every run."""
    record_path = os.path.join(directory, CHECKED_FILE)
    try:
        with open(record_path, encoding="utf-8") as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        record = {}
    record = record if isinstance(record, dict) else {}
    out, fresh, scanned, t0 = {}, {}, 0, time.time()
    for name in names:
        path = os.path.join(directory, name)
        st = os.stat(path)
        seen = record.get(name)
        if isinstance(seen, dict) and seen.get("size") == st.st_size and \
                seen.get("mtime_ns") == st.st_mtime_ns and isinstance(seen.get("max_token"), int):
            out[name] = seen["max_token"]
        else:
            tokens = open_shard(path)
            out[name] = int(tokens.max()) if len(tokens) else 0
            scanned += len(tokens)
        fresh[name] = dict(size=st.st_size, mtime_ns=st.st_mtime_ns, max_token=out[name])
    if fresh != record:
        note = f"recorded in {record_path}"
        try:
            atomic_write_json(record_path, fresh, unique=True, indent=1, sort_keys=True)
        except OSError as e:
            note = (f"not recorded ({e.strerror or e}: '{directory}' is not writable), so every "
                    "run checks them again")
        log(f"data: checked every token id of {len(names)} shard{'s' * (len(names) != 1)} "
            f"({scanned:,} tokens scanned) in {time.time() - t0:.2f} s; {note}")
    return out
