"""Files written whole or not at all, and the keyed JSON caches built on them.

`atomic_write` is the one way fp8train replaces a file: write a temporary file beside it, then
rename it over the target, so that a reader (or a crash) sees the old file or the whole new
one, never a torn one. The caches (batch_probe.json, fp8_layers.json) keep one entry per key
digest, with the full key stored beside it so that a digest collision or a hand edit never
returns another key's result."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from typing import Any, Callable, Optional, Union


def atomic_write(path: str, data: Union[str, bytes, Callable[[Any], None]], *,
                 binary: bool = False, fsync: bool = False, unique: bool = False) -> None:
    """Replace `path` with `data` (text, bytes, or a function that writes to the open file;
    `binary` for a function that writes bytes). `fsync`: on disk before the rename
    (checkpoints). `unique`: a temporary name of this process's own, where several processes
    may write the same file (shared caches, downloads). The temporary file is opened plainly,
    so the result gets the umask's mode like any new file; it is removed if the write fails."""
    binary = binary or isinstance(data, bytes)
    tmp = f"{path}.{os.getpid()}.tmp" if unique else f"{path}.tmp"
    try:
        with open(tmp, "wb" if binary else "w", encoding=None if binary else "utf-8") as fh:
            if callable(data):
                data(fh)
            else:
                fh.write(data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def atomic_write_json(path: str, obj: Any, *, unique: bool = False, **dump_kw) -> None:
    """`obj` as JSON (json.dump's keyword arguments), replacing `path` atomically."""
    atomic_write(path, json.dumps(obj, **dump_kw) + "\n", unique=unique)


def writable_dir(path: str) -> Optional[str]:
    """Create the directory `path` (and its parents) if needed; None when it is there and
    writable, else why not ("cannot create 'P': reason" or "'P' is not writable")."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"cannot create '{path}': {e.strerror or e}"
    if not os.access(path, os.W_OK):
        return f"'{path}' is not writable"
    return None


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def read_entry(path: str, key: dict) -> Optional[dict]:
    """The entry stored under `key`, or None (no file, another key, a damaged file)."""
    try:
        with open(path, encoding="utf-8") as fh:
            entry = json.load(fh).get(_digest(key))
    except (OSError, ValueError, AttributeError):
        return None
    return entry if isinstance(entry, dict) and entry.get("key") == key else None


def write_entry(path: str, key: dict, entry: dict) -> None:
    """Store `entry` (plus the key and the date) under `key`, keeping the other entries."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[_digest(key)] = dict(key=key, **entry, date=time.strftime("%Y-%m-%d %H:%M:%S"))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write_json(path, data, unique=True, indent=1, sort_keys=True)
