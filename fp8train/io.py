"""A JSON file of results keyed by everything that produced them (batch_probe.json,
fp8_layers.json): one entry per key digest, the full key stored beside it so that a digest
collision or a hand edit never returns another key's result, and writes made atomic by a
rename so that two runs sharing a cache directory never leave a torn file."""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Optional


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
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
    os.replace(tmp, path)
