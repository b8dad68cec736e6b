"""`python -m fp8train.sweep.supervise LAUNCHER... PROGRAM ARGS...`: one trial of `run_sweep.py
agent`, as W&B's agent starts it (run_sweep.py puts this module in front of the launcher in
FP8TRAIN_LAUNCHER).

It runs the rest of its command line as one process group and waits for it. A stop from the
agent (SIGTERM for a W&B stop or early termination, SIGINT/SIGTERM passed on when the agent is
stopped) reaches every process of the trial, all ranks under accelerate, SIGKILL following after
60 s. The trial's exit code is appended to $FP8TRAIN_SWEEP_RESULTS, as a JSON line with the
W&B run id, for the agent's summary, and is this process's exit code.
"""
from __future__ import annotations

import json
import os
import signal
import sys
from typing import Optional

RESULTS_VAR = "FP8TRAIN_SWEEP_RESULTS"
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")


def _stop(signum, frame):
    raise KeyboardInterrupt


def record(path: str, run_id: Optional[str], exit_code: int) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"run_id": run_id, "exit_code": exit_code}) + "\n")


def read_results(path: str) -> list[dict]:
    """The trials recorded in `path`, in the order they ended."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def main(argv: Optional[list[str]] = None) -> int:
    from .process import run_command

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m fp8train.sweep.supervise COMMAND...", file=sys.stderr)
        return 2
    for name in STOP_SIGNALS:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), _stop)
    try:
        rc = run_command(argv, env=dict(os.environ), cwd=os.getcwd(), raise_on_stop=False)
    except KeyboardInterrupt:  # stopped before the trial started
        rc = 130
    rc = 128 - rc if rc < 0 else rc  # killed by a signal: as a shell reports it
    if os.environ.get(RESULTS_VAR):
        record(os.environ[RESULTS_VAR], os.environ.get("WANDB_RUN_ID"), rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
