"""The config stored with a checkpoint (config.yaml) against the run's: the hash of what the run
trains (every key a resume may not change, in the manifest), the keys and derived values a
resume would change, and the derived values (batch plan, schedule length) it was saved with.
"""
from __future__ import annotations

import hashlib
import json
import os

from ..config.requires import inert_keys
from ..config.schema import RESUME_FREE
from ..config.yaml_files import upgrade_saved
from .files import CONFIG_NAME


def config_hash(values: dict) -> str:
    """What the run trains: every key a resume may not change (not in RESUME_FREE), canonically
    serialised."""
    kept = {k: v for k, v in sorted(values.items()) if k not in RESUME_FREE}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def changed_on_resume(checkpoint: str, current: dict, derived: dict | None = None) -> list[str]:
    """'key old -> new' for every key that differs from the config stored in `checkpoint` and
    changes training (not in config.RESUME_FREE, nor inert in both configs: config/requires.py),
    and for each entry of `derived` (the training data's size, the effective batch) that
    differs from the checkpoint's derived values."""
    import yaml
    path = os.path.join(checkpoint, CONFIG_NAME)
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as fh:
        saved = upgrade_saved(yaml.safe_load(fh) or {})
    before = saved.pop("derived", None) or {}
    # A key inert in both runs (an FP8 recipe with FP8 off in both) changes nothing.
    inert = inert_keys(saved) & inert_keys(current)
    changes = [f"{k} {saved[k]!r} -> {v!r}" for k, v in current.items()
               if k in saved and k not in RESUME_FREE and k not in inert and saved[k] != v]
    for k, v in (derived or {}).items():
        if k in before and before[k] != v:
            old, new = (_brief(before[k]), _brief(v)) if k == "data" else (before[k], v)
            changes.append(f"{k} {old} -> {new}")
    return changes


def _brief(d: dict) -> str:
    return f"({d.get('train_tokens')} train / {d.get('val_tokens')} val tokens)"


def saved_derived(checkpoint: str) -> dict:
    """The `derived` section of the config stored with a checkpoint (batch plan, ...)."""
    import yaml
    try:
        with open(os.path.join(checkpoint, CONFIG_NAME), encoding="utf-8") as fh:
            return (yaml.safe_load(fh) or {}).get("derived") or {}
    except (OSError, yaml.YAMLError):
        return {}
