"""Running one check: a dict of details, or why it failed, never an exception."""
from __future__ import annotations

import sys

from ..errors import one_line


class CheckFailed(Exception):
    """A check ran and gave the wrong answer (as opposed to raising inside a library)."""


def describe(e: BaseException) -> str:
    """An exception as it appears in the report: its class and its message, in one line."""
    return one_line(e, limit=240, with_type=True)


def run_check(fn, *args) -> dict:
    """fn(*args) -> dict of details; {"ok": True, ...details} or {"ok": False, "error": ...}.
    Every exception is caught: one failing check must not hide the others."""
    try:
        result = {"ok": True, **fn(*args)}
    except Exception as e:
        result = {"ok": False, "error": describe(e)}
    finally:
        _free_cuda_memory()
    return result


def _free_cuda_memory() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
