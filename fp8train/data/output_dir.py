"""The output directory of scripts/prepare_data.py: which files in it are a preparation's
(shards, meta.json, the progress record a rerun resumes from), what a rerun finds there (a
finished or resumable preparation with the same arguments, or one with other arguments, which
is refused), and creating it.
"""
from __future__ import annotations

import json
import os
import re

from ..errors import BadInput
from ..io import writable_dir
from .catalog import KNOWN
from .documents import looks_local
from .shards import CHECKED_FILE, META_FILE

PROGRESS = ".progress.json"
CARRY = ".carry.npy"   # the tokens carried into the next shard, saved with the progress
# The arguments that decide the output: a rerun (or a resume) must repeat them.
OUTPUT_ARGS = ("dataset", "tokenizer", "text_field", "config_name", "split", "shard_tokens",
               "val_tokens", "val_docs", "max_tokens")


def arguments(a) -> dict:
    """The arguments of the PrepareArgs `a` that decide the output, a local dataset's path made
    absolute."""
    rec = {k: getattr(a, k) for k in OUTPUT_ARGS}
    if a.dataset not in KNOWN and a.dataset != "tinyshakespeare" and looks_local(a.dataset):
        rec["dataset"] = os.path.abspath(os.path.expanduser(a.dataset))
    return rec


def is_ours(name: str) -> bool:
    """A file the preparation (or training's token-id check) writes into a prepared directory."""
    return name.startswith((META_FILE, PROGRESS, CARRY, CHECKED_FILE)) or bool(
        re.fullmatch(r"(train|val)_\d{6}\.bin(\.tmp)?", name))


def remove_ours(directory: str) -> None:
    meta = os.path.join(directory, META_FILE)
    if os.path.exists(meta):  # first: a directory with meta.json counts as complete
        os.remove(meta)
    for name in os.listdir(directory):
        if is_ours(name):
            os.remove(os.path.join(directory, name))


def _differences(recorded: dict, now: dict) -> str:
    def show(v):
        return "default" if v is None else repr(v)
    return ", ".join(f"{k}: {show(recorded[k])} -> {show(now[k])}"
                     for k in OUTPUT_ARGS if k in recorded and recorded[k] != now[k])


def previous_preparation(a, log) -> "dict | None":
    """What is already in the output directory of the PrepareArgs `a`: the meta of a finished
    preparation with these arguments (nothing to do), None to go on (nothing there, or a
    resumable preparation with these arguments), or a BadInput (other arguments, other files)."""
    out = a.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise BadInput(f"output directory '{out}' is a file")
    if not os.path.isdir(out):
        return None
    meta_path, progress = os.path.join(out, META_FILE), os.path.join(out, PROGRESS)
    if a.overwrite and any(is_ours(n) for n in os.listdir(out)):
        remove_ours(out)
        log(f"--overwrite: removed the previous preparation in {out}")
    foreign = sorted(n for n in os.listdir(out) if not is_ours(n))
    if foreign:
        raise BadInput(f"output directory '{out}' holds files that are not a prepared "
                          f"dataset ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}"
                          "); choose another --name or --output_dir")
    now = arguments(a)
    if os.path.isfile(meta_path):
        try:
            with open(meta_path, encoding="utf-8") as fh:
                meta = json.load(fh)
        except ValueError:
            raise BadInput(f"'{meta_path}' is not valid JSON; pass --overwrite to prepare "
                              f"'{out}' again") from None
        diff = _differences(meta.get("arguments") or {}, now)
        if diff:
            raise BadInput(f"'{out}' is already prepared with other arguments ({diff}); pass "
                              "--overwrite to replace it, or choose another --name or "
                              "--output_dir")
        log(f"{out} is already prepared with these arguments (meta.json exists): nothing to "
            "do; --overwrite prepares it again")
        return meta
    if os.path.isfile(progress):
        with open(progress) as fh:
            diff = _differences(json.load(fh).get("arguments") or {}, now)
        if diff:
            raise BadInput(f"'{out}' holds an unfinished preparation with other arguments "
                              f"({diff}); rerun with those to resume it, or pass --overwrite to "
                              "start again")
    return None


def make_dirs(path: str) -> list:
    """Create `path` and its missing parents; the ones created, outermost first."""
    created, p = [], os.path.abspath(path)
    while not os.path.exists(p):
        created.insert(0, p)
        p = os.path.dirname(p)
    why = writable_dir(path)
    if why:
        raise BadInput(f"output directory: {why}")
    return created
