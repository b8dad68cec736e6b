"""The errors fp8train reports in one line, their exit codes, and the one formatter.

Every entry point (train_fp8.py, run_sweep.py, the scripts) ends in `report(e)`: one `error:`
line on stderr, secrets redacted, and the exit code that the exception's class stands for.
Only the standard library is imported here: a config error comes back before torch loads.
"""
from __future__ import annotations

import sys
from typing import Optional

EXIT_OK = 0          # done
EXIT_FAILED = 1      # the run (or tool) cannot go on: diverged, a required write failed, ...
EXIT_BAD_INPUT = 2   # bad config, file or argument: fix it and run again
EXIT_STOPPED = 3     # stopped by a signal after a checkpoint: resumable


class BadInput(Exception):
    """Bad config or bad input. Reported as one line on stderr; the process exits with 2."""


class RunFailed(Exception):
    """Training cannot go on (diverged, or a required checkpoint could not be written): one
    line on stderr, exit 1."""


class ToolFailed(Exception):
    """A script ran but its result is wrong (an export whose logits do not match): exit 1."""


class SweepError(BadInput):
    """A bad sweep file or bad command-line input to run_sweep.py: one line, exit 2."""


class ServerError(Exception):
    """W&B could not be reached or refused a sweep request: one line, exit 1."""


# Which exceptions are reported in one line, and with which exit code (first match wins).
_CODES = ((BadInput, EXIT_BAD_INPUT), (RunFailed, EXIT_FAILED),
          (ToolFailed, EXIT_FAILED), (ServerError, EXIT_FAILED))


def exit_code(e: BaseException) -> "int | None":
    """The exit code for an exception reported in one line; None for an unexpected one (a bug:
    let its traceback show)."""
    for kind, code in _CODES:
        if isinstance(e, kind):
            return code
    return None


def close_matches(word, choices, n: int = 1) -> list:
    """The `n` choices closest to `word` (difflib's similarity of at least 0.6), closest first:
    the one source of every "did you mean" hint in an error message."""
    import difflib
    return difflib.get_close_matches(str(word), [str(c) for c in choices], n=n, cutoff=0.6)


def did_you_mean(word, choices) -> Optional[str]:
    """The choice closest to `word`, or None when nothing is close (close_matches)."""
    close = close_matches(word, choices)
    return close[0] if close else None


def one_line(e: BaseException, limit: int = 300, with_type: bool = False,
             first_line: bool = False) -> str:
    """An exception from a library (torch, safetensors, pickle, OSError) as one short line:
    whitespace folded, cut at `limit` characters, the class name when the text is empty (or
    always, with `with_type`). `first_line`: only the message's first line (W&B's go on with
    retry notes). An OSError with a reason reads as its reason and file ("No such file or
    directory: 'x'"), without errno or class."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f": '{e.filename}'" if e.filename else "")
    text = str(e).strip()
    if first_line:
        text = text.partition("\n")[0]
    text = " ".join(text.split())[:limit]
    if with_type or not text:
        return f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text


# How an allocation failure reads when it does not come as torch.OutOfMemoryError: libraries
# with their own C++ (Transformer Engine registers no exception translator, so its errors are
# plain RuntimeErrors) report CUDA's and cuBLAS/cuDNN's messages. "out of memory" is
# cudaGetErrorString(cudaErrorMemoryAllocation); "the resource allocation failed" is
# cublasGetStatusString(CUBLAS_STATUS_ALLOC_FAILED), which torch reports by its enum name; "can't
# allocate memory" is torch's CPU allocator (DefaultCPUAllocator).
OOM_MESSAGES = ("out of memory", "cudaerrormemoryallocation", "cublas_status_alloc_failed",
                "the resource allocation failed", "cudnn_status_alloc_failed",
                "device_allocation_failed",   # cuDNN 9: ..._INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED
                "can't allocate memory")


def is_out_of_memory(error: BaseException) -> bool:
    """True when `error` says the device or the host ran out of memory, whatever raised it,
    including an error raised while handling (or from) one that does. By class name, so that
    this module needs no torch (torch.OutOfMemoryError is a RuntimeError)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, MemoryError) or any(
                c.__name__ == "OutOfMemoryError" for c in type(error).__mro__) or (
                isinstance(error, RuntimeError)
                and any(m in str(error).lower() for m in OOM_MESSAGES)):
            return True
        error = error.__cause__ or error.__context__
    return False


def report(e: BaseException, show: bool = True) -> int:
    """Print `error: <message>` (secrets redacted) unless `show` is false (a rank other than
    0), and return the exception's exit code. Re-raises an exception that is not ours."""
    code = exit_code(e)
    if code is None:
        raise e
    if show:
        print(error_line(e), file=sys.stderr, flush=True)
    return code


def error_line(e: BaseException) -> "str | None":
    """The line `report` prints for `e`; None for an exception that is not ours."""
    if exit_code(e) is None:
        return None
    from .observe.redaction import redact
    return f"error: {redact(str(e))}"


def run_reported(body, show: bool = True, memory_hint: str = "") -> int:
    """Run `body()` (returning an exit code); our exceptions become one line and their code. So
    does running out of memory (exit 1: the same config may fit another machine, or this one
    when less else runs on it), followed by `memory_hint`: which keys to lower."""
    try:
        return body()
    except (BadInput, RunFailed, ToolFailed, ServerError) as e:
        return report(e, show)
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        return report(as_reported(e, memory_hint), show)


def as_reported(e: BaseException, memory_hint: str = "") -> BaseException:
    """`e` as run_reported reports it: running out of memory becomes a RunFailed line (with
    `memory_hint`); anything else stays as it is."""
    if exit_code(e) is None and isinstance(e, Exception) and is_out_of_memory(e):
        return RunFailed(f"out of memory ({one_line(e, 200, first_line=True)})"
                         + (f"; {memory_hint}" if memory_hint else ""))
    return e
