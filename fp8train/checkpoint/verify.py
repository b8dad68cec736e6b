"""Whether a checkpoint on disk can be used. Loading verifies the manifest (`verify`): a corrupt
or partial checkpoint (any damage, a missing manifest included) is reported, and the caller
(locate.py) moves it aside and uses the previous one, while an intact one this version cannot
continue (another checkpoint format: `resume_refusal`) is refused. Verification also checks what
loading would unpickle (`safe_load.unsafe_content`): a checkpoint from elsewhere cannot run code.
"""
from __future__ import annotations

import json
import os
import time

from ..errors import BadInput, one_line
from .files import MANIFEST, MANIFEST_FORMAT, TRAIN_STATE, checksums, list_names, read_manifest
from .safe_load import unsafe_content
from .train_state import TrainState, components_of


def read_train_state(path: str) -> "tuple[TrainState, dict]":
    """The counters of checkpoint `path`, and its components' states ({name: state_dict}).
    BadInput, in one line, for a checkpoint this version cannot resume (`resume_refusal`) or an
    unreadable train_state.json."""
    refusal = resume_refusal(path)
    if refusal:
        raise BadInput(f"cannot resume from '{path}': {refusal}")
    try:
        with open(os.path.join(path, TRAIN_STATE), encoding="utf-8") as fh:
            saved = json.load(fh)
        return TrainState.from_dict(saved), components_of(saved)
    except (OSError, ValueError) as e:   # json's errors are ValueErrors
        raise BadInput(f"cannot resume from '{path}': {TRAIN_STATE} cannot be read "
                          f"({one_line(e, with_type=True)})") from None


def resume_refusal(path: str) -> str | None:
    """Why checkpoint `path`, intact, cannot be resumed by this version: it was written by an
    older or a newer fp8train (its format). None when its format is this version's, and when
    it has no manifest but is not an older fp8train's (then it is damaged: `verify` says so)."""
    manifest = read_manifest(path)
    found = manifest.get("format")
    if not manifest:
        names = list_names(path)
        if TRAIN_STATE in names or not any(n.startswith("custom_checkpoint_") for n in names):
            return None
        found = None
    elif found == MANIFEST_FORMAT:
        return None
    if isinstance(found, int) and found > MANIFEST_FORMAT:
        return (f"it was written by a newer fp8train (checkpoint format {found}; this version "
                f"resumes format {MANIFEST_FORMAT}); continue it with the fp8train that wrote it")
    what = f"checkpoint format {found}" if found else \
        "no manifest" if not manifest else "a manifest without a format"
    return (f"it was written by another version of fp8train ({what}; this version resumes "
            f"checkpoint format {MANIFEST_FORMAT}, whose training state is JSON); finish that "
            f"run with the fp8train that wrote it, or start a new run (export, sampling and "
            f"evaluation still read its model)")


# Read errors that say for certain what is on disk; any other (EIO, ESTALE, EACCES) does not.
_CERTAIN = (FileNotFoundError, IsADirectoryError, NotADirectoryError)


def verify(path: str, resume: bool = False) -> tuple[str | None, str]:
    """(problem, note): problem is None when the checkpoint is complete, every file matches its
    manifest and nothing in it could run code when loaded (`unsafe_content`: a checksum does not
    tell a crafted checkpoint, whose author writes the manifest too); note: what was checked.
    A checkpoint without a manifest is read unverified for its model (an older fp8train wrote
    none), but never resumed (`resume`): this version writes the manifest before the directory
    gets its name, so a step directory without one is damaged or a partial copy.

    A read that fails for any reason but a missing file (EIO, ESTALE, EACCES: a network
    filesystem's hiccup, a permission) proves nothing about the checkpoint: that is a
    BadInput, so that an intact checkpoint is never moved aside for it."""
    try:
        return _verify(path, resume)
    except OSError as e:
        if isinstance(e, _CERTAIN):   # vanished, or not what was written, while checked
            return f"cannot be read ({one_line(e, with_type=True)})", ""
        raise BadInput(f"checkpoint '{path}' cannot be read ({one_line(e, with_type=True)}); nothing was "
                          f"moved aside: check the filesystem and try again") from None


def _verify(path: str, resume: bool) -> tuple[str | None, str]:
    names = os.listdir(path)
    if MANIFEST not in names:
        if not any(f.startswith(("model", "pytorch_model")) for f in names):
            return ("empty" if not names else "no manifest and no model files"), ""
        if resume:
            return (f"no {MANIFEST}: every checkpoint this version writes has one, so it is "
                    f"damaged or an incomplete copy"), ""
        unsafe = unsafe_content(path)
        if unsafe:
            return unsafe, ""
        return None, "no manifest (written by an older fp8train): not verified"
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as fh:
            files = json.load(fh)["files"]
        if not isinstance(files, dict) or not all(
                isinstance(w, dict) and isinstance(w.get("size"), int)
                and isinstance(w.get("sha256"), str) for w in files.values()):
            raise ValueError("its file list is not {name: {size, sha256}}")
    except (*_CERTAIN, ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest ({one_line(e, with_type=True)})", ""
    t0, total = time.time(), 0
    for rel, want in files.items():
        full = os.path.join(path, rel)
        try:
            size = os.stat(full).st_size
        except _CERTAIN:
            return f"file '{rel}' is missing", ""
        if not os.path.isfile(full):
            return f"file '{rel}' is missing", ""
        if size != want["size"]:
            return f"file '{rel}' has {size:,} bytes, the manifest says {want['size']:,}", ""
        total += size
    actual = checksums(path, only=list(files))
    for rel, want in files.items():
        if actual[rel]["sha256"] != want["sha256"]:
            return f"file '{rel}' does not match its checksum", ""
    unsafe = unsafe_content(path)   # after the checksums: a torn write reads as corrupt
    if unsafe:
        return unsafe, ""
    return None, (f"verified {len(files)} files, {total / 2**20:,.1f} MiB, in "
                  f"{time.time() - t0:.1f} s")
