"""Secrets in the environment never reach the run's files: what counts as one, and redaction.

A variable is a secret when its name (upper-cased) contains TOKEN, SECRET, PASSWORD, PASSWD,
API_KEY, APIKEY, PRIVATE_KEY or CREDENTIAL, or ends in _KEY (WANDB_API_KEY, HF_TOKEN,
HUGGING_FACE_HUB_TOKEN, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, GITHUB_TOKEN, ...), or is
named in FP8TRAIN_SECRET_VARS (comma-separated). Not: names ending in _PATH, _FILE or _DIR
(where a secret is kept, not the secret; HF_TOKEN_PATH), nor TOKENIZER* names. Values shorter
than MIN_LENGTH characters are ignored, so that redaction never mangles ordinary text ("true",
"1", a short word).

The values are read once per process (`secret_values()`); `redact` replaces each of them with
"***" in a string, or in every string of nested dicts, lists and tuples (keys included).
"""
from __future__ import annotations

import functools
import os
from typing import Any, Iterable, Mapping, Optional

MIN_LENGTH = 8
MASK = "***"
EXTRA_NAMES_VAR = "FP8TRAIN_SECRET_VARS"
_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "API_KEY", "APIKEY", "PRIVATE_KEY",
            "CREDENTIAL")
_NOT_SECRET_SUFFIXES = ("_PATH", "_FILE", "_DIR")


def is_secret_name(name: str, extra: Iterable[str] = ()) -> bool:
    """Whether an environment variable of this name holds a secret (see the module's doc)."""
    upper = name.upper()
    if upper == EXTRA_NAMES_VAR:   # a list of names, not a secret
        return False
    if upper in {e.strip().upper() for e in extra if e.strip()}:
        return True
    if upper.endswith(_NOT_SECRET_SUFFIXES) or "TOKENIZER" in upper:
        return False
    return upper.endswith("_KEY") or any(m in upper for m in _MARKERS)


def find_secret_values(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The secret values in `environ`, longest first (so that a value that is part of another
    does not split it), without the ones shorter than MIN_LENGTH."""
    extra = environ.get(EXTRA_NAMES_VAR, "").split(",")
    values = {v.strip() for k, v in environ.items()
              if is_secret_name(k, extra) and len(v.strip()) >= MIN_LENGTH}
    return tuple(sorted(values, key=lambda v: (-len(v), v)))


@functools.lru_cache(maxsize=1)
def secret_values() -> tuple[str, ...]:
    """This process's secret values, read from os.environ once (the first call)."""
    return find_secret_values(os.environ)


def redact(obj: Any, values: Optional[Iterable[str]] = None) -> Any:
    """`obj` with every secret value replaced by "***": a string, or a copy of dicts, lists and
    tuples with their strings (keys too) redacted; anything else as it is. `values` defaults to
    `secret_values()`. With no secret values, `obj` itself comes back (no copy, no cost)."""
    values = secret_values() if values is None else tuple(values)
    if not values:
        return obj
    return _redact(obj, values)


def _redact(obj: Any, values: tuple[str, ...]) -> Any:
    if isinstance(obj, str):
        for v in values:
            if v in obj:
                obj = obj.replace(v, MASK)
        return obj
    if isinstance(obj, dict):
        return {_redact(k, values): _redact(v, values) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_redact(x, values) for x in obj]
    if isinstance(obj, tuple):
        items = [_redact(x, values) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)  # namedtuple
    return obj
