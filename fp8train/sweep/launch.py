"""Starting a trial: its command line (built as `wandb agent` builds it), its environment, and
running its process group to the end."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]  # trials run from the repository root
PROGRAM = "train_fp8.py"
# What `wandb agent` puts in place of ${interpreter}.
DEFAULT_INTERPRETER = ("python",)


def agent_args(params: dict) -> dict:
    """{param: value} as the agent passes it: {param: {"value": value}}."""
    return {k: {"value": v} for k, v in params.items()}


def build_command(command: Optional[Sequence[str]], program: str, args: dict,
                  interpreter: Sequence[str] = DEFAULT_INTERPRETER,
                  args_json_file: Optional[str] = None) -> list[str]:
    """The trial command line, built as `wandb agent` builds it (wandb/wandb_agent.py,
    Agent._command_run): `${envvar:X}` substituted, `${env}` -> /usr/bin/env (not on Windows),
    `${interpreter}` -> `interpreter`, `${program}` -> program, `${args}` & co. from
    wandb's own create_sweep_command_args; unknown macros dropped. `args` is the agent's
    {param: {"value": v}}. With `${args_json_file}` in the command, the JSON is written to
    `args_json_file` as the agent does."""
    from wandb.sdk.launch.sweeps import utils as sweep_utils

    sweep_cmd = sweep_utils.create_sweep_command(
        list(command) if command else list(sweep_utils.DEFAULT_SWEEP_COMMAND))
    sweep_vars = sweep_utils.create_sweep_command_args({"args": args})
    if "${args_json_file}" in sweep_cmd:
        if args_json_file is None:
            raise ValueError("${args_json_file} in the command needs a file path")
        os.makedirs(os.path.dirname(os.path.abspath(args_json_file)), exist_ok=True)
        with open(args_json_file, "w") as fp:
            fp.write(sweep_vars["args_json"][0])
    sweep_vars["interpreter"] = list(interpreter)
    sweep_vars["program"] = [program]
    sweep_vars["args_json_file"] = [args_json_file]
    if sys.platform != "win32":
        sweep_vars["env"] = ["/usr/bin/env"]
    out: list[str] = []
    for c in sweep_cmd:
        c = str(c)
        if c.startswith("${") and c.endswith("}"):
            out += sweep_vars.get(c[2:-1]) or []
        else:
            out += [c]
    return out


def config_argv(command: list[str], program: str) -> list[str]:
    """The part of a built trial command that train_fp8.py parses (after the program), with
    --config made absolute so that it loads from anywhere."""
    idx = next((i for i, c in enumerate(command) if c == program or c.endswith(PROGRAM)), None)
    argv = list(command[idx + 1:]) if idx is not None else list(command)
    for i, c in enumerate(argv):
        if c == "--config" and i + 1 < len(argv) and not os.path.isabs(argv[i + 1]):
            argv[i + 1] = str(ROOT / argv[i + 1])
        elif c.startswith("--config=") and not os.path.isabs(c[9:]):
            argv[i] = "--config=" + str(ROOT / c[9:])
    return argv


def interpreter_for(accelerate_config: Optional[str] = None,
                    num_processes: Optional[int] = None) -> list[str]:
    """What replaces ${interpreter}: python, or an accelerate launcher for multi-GPU trials."""
    if accelerate_config:
        return ["accelerate", "launch", "--config_file", accelerate_config]
    if num_processes:
        return ["accelerate", "launch", "--num_processes", str(num_processes)]
    return list(DEFAULT_INTERPRETER)


def trial_env(base: Optional[dict] = None, *, local: bool = False) -> dict:
    """The environment a trial runs in: the inherited one, as `wandb agent` passes it, minus
    WANDB_SERVICE (the agent's own service connection; the CLI agent drops it too), with the
    directory of the running interpreter first on PATH when its `python` is this interpreter
    (so `${interpreter}` = python finds the environment run_sweep.py runs in). `local`
    trials get WANDB_MODE=offline unless set, and never a sweep's run id."""
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


def run_command(command: list[str], env: dict, cwd: str, grace: float = 60.0) -> int:
    """Run a trial to completion and return its exit code. Like `wandb agent`, the child gets
    its own process group and no stdin; if this thread is interrupted (Ctrl-C, SIGTERM, a W&B
    stop command) the whole group is terminated before the interruption propagates."""
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
            try:  # a timed wait runs Python code, so a W&B stop (async exception) lands here
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
    except BaseException:
        _terminate(proc, grace)
        raise
