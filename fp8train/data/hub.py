"""Network access for data: offline mode (FP8TRAIN_OFFLINE and the HuggingFace variables) and
whether the HuggingFace hub answers. Standard library only."""
from __future__ import annotations

import os
import urllib.error
import urllib.request

from ..errors import one_line

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
