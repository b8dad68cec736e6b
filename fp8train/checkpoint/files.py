"""The files of a checkpoint directory, under <output_dir>/checkpoints/: the names (step_NNNNNNN/,
the `latest` pointer, manifest.json, train_state.json, config.yaml), the checkpoint format, the
manifest read back, each file's size and SHA-256, fsync of files and directories, the mode every
file written gets (the umask's), sizes on disk and directory listings that never raise.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

STEP_DIR = re.compile(r"^step_(\d{7,})$")
LATEST = "latest"
CONFIG_NAME = "config.yaml"
MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"
RUN_FILES = ("config.yaml", "train.log", "metrics.jsonl")   # a run directory has them first
MANIFEST_FORMAT = 2   # 1: the counters were Accelerate's custom_checkpoint_0.pkl, a pickle


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def step_of(path: str) -> int:
    """The step of checkpoint directory `path` (…/step_NNNNNNN), the inverse of step_dir_name."""
    return int(STEP_DIR.match(os.path.basename(os.path.normpath(path))).group(1))


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint `path`; {} when it has none that can be read."""
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def list_names(path: str) -> list:
    try:
        return os.listdir(path)
    except OSError:
        return []


def file_mode() -> int:
    """The mode open() gives a new file here: 0o666 less the process's umask."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:   # Linux: read, not set
            for line in fh:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def give_normal_mode(paths) -> None:
    """Every file in `paths` (files, or directories: the files under them) gets the mode of a
    newly opened file. safetensors writes through a private temporary file (mode 0600) that it
    renames into place: left so, a checkpoint or an export on a shared filesystem would be
    unreadable to the rest of the team while every other file of the run is not. A file that
    cannot be changed (another user's) is left as it is."""
    mode = file_mode()
    for top in paths:
        files = [top] if not os.path.isdir(top) else \
            [os.path.join(d, f) for d, _, names in os.walk(top) for f in names]
        for f in files:
            try:
                if not os.path.islink(f) and (os.stat(f).st_mode & 0o777) != mode:
                    os.chmod(f, mode)
            except OSError:
                pass


def directory_bytes(path: str) -> int:
    """Bytes of every file under `path` (a checkpoint's size on disk, as its files count it)."""
    total = 0
    for d, _, names in os.walk(path):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(d, name))
            except OSError:
                pass
    return total


def checksums(root: str, only: list[str] | None = None) -> dict:
    """{relative path: {size, sha256}} for every file under root (or the listed ones), hashed in
    parallel: hashlib releases the GIL, and checkpoints of 1B+ models are many GB."""
    if only is None:
        only = sorted(os.path.relpath(os.path.join(d, f), root)
                      for d, _, names in os.walk(root) for f in names)

    def one(rel):
        h = hashlib.sha256()
        with open(os.path.join(root, rel), "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
        return rel, {"size": os.path.getsize(os.path.join(root, rel)), "sha256": h.hexdigest()}

    with ThreadPoolExecutor(max_workers=min(8, max(1, len(only)))) as pool:
        return dict(pool.map(one, only))


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fsync_path(os.path.join(root, name), strict=True)
        fsync_path(root)


def fsync_path(path: str, strict: bool = False) -> None:
    """fsync a file, or a directory: that makes a rename inside it durable (on a power cut, not
    only a process crash); a directory that cannot be synced is passed over."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        if strict:
            raise
