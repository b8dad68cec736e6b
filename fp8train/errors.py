"""The errors fp8train reports in one line, their exit codes, and the one formatter.

Every entry point (train_fp8.py, run_sweep.py, the scripts) ends in `report(e)`: one `error:`
line on stderr, secrets redacted, and the exit code that the exception's class stands for.
Only the standard library is imported here: a config error comes back before torch loads.
"""
from __future__ import annotations

import sys

EXIT_OK = 0          # done
EXIT_FAILED = 1      # the run (or tool) cannot go on: diverged, a required write failed, ...
EXIT_BAD_INPUT = 2   # bad config, file or argument: fix it and run again
EXIT_STOPPED = 3     # stopped by a signal after a checkpoint: resumable


class ConfigError(Exception):
    """Bad config or bad input. Reported as one line on stderr; the process exits with 2."""


class RunFailed(Exception):
    """Training cannot go on (diverged, or a required checkpoint could not be written): one
    line on stderr, exit 1."""


class ToolFailed(Exception):
    """A script ran but its result is wrong (an export whose logits do not match): exit 1."""


class SweepError(ConfigError):
    """A bad sweep file or bad command-line input to run_sweep.py: one line, exit 2."""


class ServerError(Exception):
    """W&B could not be reached or refused a sweep request: one line, exit 1."""


# Which exceptions are reported in one line, and with which exit code (first match wins).
_CODES = ((ConfigError, EXIT_BAD_INPUT), (RunFailed, EXIT_FAILED), (ToolFailed, EXIT_FAILED),
          (ServerError, EXIT_FAILED))


def exit_code(e: BaseException) -> "int | None":
    """The exit code for an exception reported in one line; None for an unexpected one (a bug:
    let its traceback show)."""
    for kind, code in _CODES:
        if isinstance(e, kind):
            return code
    return None


def one_line(e: BaseException, limit: int = 300, with_type: bool = False,
             first_line: bool = False) -> str:
    """An exception from a library (torch, safetensors, pickle, OSError) as one short line:
    whitespace folded, cut at `limit` characters, the class name when the text is empty (or
    always, with `with_type`). `first_line`: only the message's first line (W&B's go on with
    retry notes)."""
    text = str(e).strip()
    if first_line:
        text = text.partition("\n")[0]
    text = " ".join(text.split())[:limit]
    if with_type or not text:
        return f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text


def report(e: BaseException, show: bool = True) -> int:
    """Print `error: <message>` (secrets redacted) unless `show` is false (a rank other than
    0), and return the exception's exit code. Re-raises an exception that is not ours."""
    code = exit_code(e)
    if code is None:
        raise e
    if show:
        from .redaction import redact
        print(f"error: {redact(str(e))}", file=sys.stderr, flush=True)
    return code


def run_reported(body, show: bool = True) -> int:
    """Run `body()` (returning an exit code); our exceptions become one line and their code."""
    try:
        return body()
    except (ConfigError, RunFailed, ToolFailed, ServerError) as e:
        return report(e, show)
