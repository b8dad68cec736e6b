"""What reaches the user when something goes wrong: the errors fp8train reports in one line,
their exit codes, the one formatter, and the secrets kept out of every message and file.

Every entry point (train_fp8.py, run_sweep.py, the scripts) ends in `report(e)`: one `error:`
line on stderr, secrets redacted, and the exit code that the exception's class stands for.
Only the standard library is imported here: a config error comes back before torch loads.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Any, Iterable, Mapping, Optional

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

# --- secrets ----------------------------------------------------------------------------------
# Secrets in the environment never reach the run's files: what counts as one, and redaction.
#
# A variable is a secret when its name (upper-cased) contains TOKEN, SECRET, PASSWORD, PASSWD,
# API_KEY, APIKEY, PRIVATE_KEY or CREDENTIAL, or ends in _KEY (WANDB_API_KEY, HF_TOKEN,
# HUGGING_FACE_HUB_TOKEN, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, GITHUB_TOKEN, ...), or is
# named in FP8TRAIN_SECRET_VARS (comma-separated). Not: names ending in _PATH, _FILE or _DIR
# (where a secret is kept, not the secret; HF_TOKEN_PATH), nor TOKENIZER* names. Values shorter
# than MIN_LENGTH characters are ignored, so that redaction never mangles ordinary text ("true",
# "1", a short word).
#
# The values are read once per process (`secret_values()`); `redact` replaces each of them with
# "***" in a string, or in every string of nested dicts, lists and tuples (keys included).
# Standard library only: the one-line errors (error_line), config.yaml's
# text (config.yaml_files.dump_yaml) and the run's logger use it.

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
