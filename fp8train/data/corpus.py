"""The text file behind a text dataset: tinyshakespeare under data_dir (downloaded once, its
checksum checked), or a file given by path. Standard library only."""
from __future__ import annotations

import hashlib
import os
import urllib.request

from ..errors import BadInput
from ..io import atomic_write
from ..hub import offline

TINYSHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt")
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


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
        how = "offline mode is set" if offline() else None
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
