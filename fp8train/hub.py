"""The HuggingFace hub: offline mode (FP8TRAIN_OFFLINE and the HuggingFace variables), whether
the hub answers, and loading a tokenizer, a model's config or its weights by hub name or local
directory with one clear line when that cannot be done. Standard library only (the loading
class is handed in)."""
from __future__ import annotations

import os
import urllib.error
import urllib.request

from .errors import one_line

OFFLINE_VARIABLES = ("FP8TRAIN_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                     "TRANSFORMERS_OFFLINE")


def offline_variable() -> "str | None":
    """The first variable that sets offline mode ("0", "false", "no", "off" do not)."""
    for v in OFFLINE_VARIABLES:
        if os.environ.get(v, "").strip().lower() not in ("", "0", "false", "no", "off"):
            return f"{v}={os.environ[v]}"
    return None


def offline() -> bool:
    return offline_variable() is not None


def hub_unreachable(timeout: float = 10.0) -> "str | None":
    """Why the HuggingFace hub (HF_ENDPOINT) cannot be reached, or None when it answers one
    HEAD request, through the same proxy variables its client reads. Any HTTP answer, even an
    error status, means it is reachable."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or timeout)
    except ValueError:
        pass  # not a number: the default
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"),
                               timeout=timeout).close()
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as e:  # URLError, refused, timed out, a malformed endpoint
        return f"{endpoint}: {one_line(getattr(e, 'reason', None) or e, 150)}"
    return None


def load_pretrained(auto, name: str, what: str, thing: str, **kwargs):
    """`auto.from_pretrained(name, **kwargs)` (a transformers Auto class) for `thing` ("tokenizer",
    "model config", ...). A directory or a cached hub name loads without any network request.
    Otherwise the hub is asked only when it is allowed (not offline) and answers a single quick
    request: its client retries a dead connection for about a minute per file. BadInput naming
    `what` (the key or option) when it cannot load."""
    from .errors import BadInput

    def fail(why: str):
        return BadInput(f"{what}: cannot load {thing} '{name}' ({why})")
    try:
        return auto.from_pretrained(name, local_files_only=True, **kwargs)
    except Exception as e:  # not cached, not such a directory, no such path
        local_error = one_line(e, 200, first_line=True)
    if os.path.exists(name) or is_path(name):
        raise fail(local_error)  # a path, not a hub name: the hub cannot help
    fix = f"download it once with network access, or use a local {thing} directory"
    if offline():
        raise fail(f"not in the local HuggingFace cache, and offline mode is set "
                   f"({offline_variable()}); {fix}")
    unreachable = hub_unreachable()
    if unreachable:
        raise fail(f"not in the local HuggingFace cache, and the hub cannot be reached: "
                   f"{unreachable}; {fix}")
    try:
        return auto.from_pretrained(name, **kwargs)
    except Exception as e:  # no such repository, not that kind of file, a failed download
        raise fail(one_line(e, 200, first_line=True)) from None


def is_path(name: str) -> bool:
    """Spelled as a path: a hub name is "name" or "org/name"."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and \
        os.sep in name
