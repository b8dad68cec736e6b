"""Command-line entry: parse and validate the config (no torch import), then train.

Exit codes: 0 done, 2 bad config or input (one line on stderr), 3 stopped by a signal after a
checkpoint, 1 anything else (a run that cannot go on says why in one line).
"""
from __future__ import annotations

import os
import sys

from .config import ConfigError, HelpRequested, help_text, load_config
from .redaction import redact

EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT, EXIT_STOPPED = 0, 1, 2, 3


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = load_config(argv)
    except HelpRequested:
        print(help_text())
        return EXIT_OK
    except ConfigError as e:
        if _is_rank0():
            print(f"error: {redact(str(e))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # Must be set before torch initialises CUDA: fewer fragmentation OOMs on long runs.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from .trainer import RunFailed, train  # heavy imports only once the config is good
    try:
        return train(cfg)
    except ConfigError as e:
        if _is_rank0():
            print(f"error: {redact(str(e))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RunFailed as e:
        if _is_rank0():
            print(f"error: {redact(str(e))}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        _close_process_group()


def _close_process_group() -> None:
    """Leave the process group explicitly: a rank that exits with it still open can abort at
    interpreter shutdown and turn a clean exit code into SIGABRT."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class ToolFailed(Exception):
    """A script ran but its result is wrong (an export whose logits do not match): exit 1."""


def run_tool(body) -> int:
    """Run a script's body (a function returning an exit code): bad input is one `error:` line
    and exit 2, a failed result one line and exit 1, never a traceback for either."""
    try:
        return body()
    except ConfigError as e:
        print(f"error: {redact(str(e))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ToolFailed as e:
        print(f"error: {redact(str(e))}", file=sys.stderr)
        return EXIT_ERROR
