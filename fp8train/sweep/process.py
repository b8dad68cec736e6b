"""A trial's environment and its process: run to the end as one process group (every rank under
accelerate), stopped as a whole when run_sweep.py is interrupted."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any, Optional


def trial_env(base: Optional[dict] = None, *, local: bool = False) -> dict:
    """The environment a trial runs in: the inherited one, as `wandb agent` passes it, minus
    WANDB_SERVICE (the agent's own service connection; the CLI agent drops it too), with the
    directory of the running interpreter first on PATH when its `python` is this interpreter
    (so the launcher `python` finds the environment run_sweep.py runs in). `local` trials get
    WANDB_MODE=offline unless set, and never a sweep's run id."""
    env = dict(os.environ if base is None else base)
    env.pop("WANDB_SERVICE", None)
    bindir = os.path.dirname(sys.executable)
    py = os.path.join(bindir, "python")
    try:
        same = os.path.exists(py) and os.path.samefile(py, sys.executable)
    except OSError:
        same = False
    path = env.get("PATH", "")
    if same and path.split(os.pathsep)[0] != bindir:
        env["PATH"] = bindir + (os.pathsep + path if path else "")
    if local:
        env.setdefault("WANDB_MODE", "offline")
        for k in ("WANDB_SWEEP_ID", "WANDB_RUN_ID", "WANDB_SWEEP_PARAM_PATH"):
            env.pop(k, None)
    return env


def _terminate(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the trial's process group (all ranks under accelerate), SIGKILL after `grace`
    seconds (or at a second Ctrl-C)."""
    def signal_group(sig):
        try:
            if sys.platform != "win32":
                os.killpg(proc.pid, sig)
            elif sig == signal.SIGTERM:
                proc.terminate()
            else:
                proc.kill()
        except (ProcessLookupError, PermissionError):
            pass

    if proc.poll() is not None:
        return
    signal_group(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except (KeyboardInterrupt, Exception):  # the grace ran out, or a second interruption
        signal_group(getattr(signal, "SIGKILL", signal.SIGTERM))
        proc.wait()


def run_command(command: list[str], env: dict, cwd: str, grace: float = 60.0,
                raise_on_stop: bool = True) -> int:
    """Run a trial to completion and return its exit code. Like `wandb agent`, the child gets
    its own process group and no stdin; if this thread is interrupted (Ctrl-C, or SIGTERM made a
    KeyboardInterrupt) the whole group is terminated, then the interruption propagates (or,
    with `raise_on_stop` false, the trial's exit code is returned)."""
    kwargs: dict[str, Any] = {}
    if sys.platform == "win32":
        kwargs["creationflags"] = subprocess.CREATE_NEW_PROCESS_GROUP
    elif sys.version_info >= (3, 11):
        kwargs["process_group"] = 0
    else:
        kwargs["preexec_fn"] = os.setpgrp
    proc = subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, **kwargs)
    try:
        while True:
            try:  # a timed wait runs Python code, so an asynchronous exception lands here
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
    except KeyboardInterrupt:
        _terminate(proc, grace)
        if raise_on_stop:
            raise
        return proc.returncode
    except BaseException:
        _terminate(proc, grace)
        raise
