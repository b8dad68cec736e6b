"""The W&B client side of sweeps, on wandb's public API only: `create` a sweep (wandb.sweep), read
a sweep's config (wandb.Api().sweep(path).config), and `agent`, which runs W&B's own agent
(wandb.agent without a function, as `wandb agent` does): the agent builds every trial from the
sweep's `command:`, with FP8TRAIN_LAUNCHER set to the launcher."""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import tempfile
import threading
from typing import Optional, Sequence

from ..config.load import KEYS, Config
from ..errors import EXIT_FAILED, EXIT_OK, ServerError, SweepError, one_line
from .command import DEFAULT_LAUNCHER, LAUNCHER_VAR, ROOT, has_launcher, launcher_env
from .process import trial_env
from .spec import (check_sweep, check_trial_config, representative_params, require_launcher,
                   sweep_command, validate_sweep)


def _reason(e: BaseException) -> str:
    """An exception from wandb in one line: its class and its first line of text (wandb's
    messages go on with retry notes)."""
    return one_line(e, with_type=True, first_line=True)


def _wandb():
    """The wandb package; a SweepError (exit 2, one line) where it is not installed."""
    try:
        import wandb
    except ImportError:
        raise SweepError("create and agent talk to the W&B server through the wandb package, "
                         "which is not installed: pip install wandb (local needs no "
                         "server)") from None
    return wandb


def _base_config(cfg: dict) -> Config:
    """A trial's run config (the first value of each parameter), for the defaults of
    project / entity / use_wandb. `cfg` has been validated."""
    return check_trial_config(sweep_command(cfg), cfg["program"], representative_params(cfg))


def create(path: str, project: Optional[str] = None, entity: Optional[str] = None,
           out=print) -> str:
    """Validate the sweep YAML and create it on the W&B server; returns the sweep id. The
    project and entity default to the sweep file's, then to the base config's wandb_project /
    wandb_entity, so the sweep lives where its trials log."""
    cfg = validate_sweep(path)
    base = _base_config(cfg)
    project = project or cfg.get("project") or base.wandb_project
    entity = entity or cfg.get("entity") or base.wandb_entity
    wandb = _wandb()
    try:
        sweep_id = wandb.sweep(sweep=cfg, project=project, entity=entity)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # no key, no network, server refused the config
        raise ServerError(f"cannot create the sweep on W&B (project {project}"
                          f"{', entity ' + entity if entity else ''}): "
                          f"{_reason(e)}") from None
    full = "/".join(x for x in (entity, project, sweep_id) if x)
    out(f"sweep id: {sweep_id}")
    out("start a worker on each machine (trials run one after another):")
    if has_launcher(sweep_command(cfg)):
        out(f"  python run_sweep.py agent {full} [--count N] "
            "[--accelerate_config accelerate_configs/h200.yaml | --num_processes K]")
        out(f"  {LAUNCHER_VAR}=python wandb agent {full}    # W&B's own agent; {LAUNCHER_VAR} "
            "is the launcher")
    else:  # the command runs python itself, as W&B's agent runs it
        out(f"  wandb agent {full}")
    return sweep_id


def split_sweep_path(sweep_id: str, entity: Optional[str], project: Optional[str]):
    """SWEEP_ID, PROJECT/SWEEP_ID or ENTITY/PROJECT/SWEEP_ID -> (entity, project, id); the
    parts in the path win over `entity` and `project`."""
    parts = sweep_id.split("/")
    if len(parts) > 3 or not all(parts):
        raise SweepError(f"sweep id '{sweep_id}': expected SWEEP_ID, PROJECT/SWEEP_ID or "
                         "ENTITY/PROJECT/SWEEP_ID")
    name = parts[-1]
    project = parts[-2] if len(parts) >= 2 else project
    entity = parts[-3] if len(parts) == 3 else entity
    return entity, project, name


def fetch_sweep_config(sweep_id: str, project: Optional[str], entity: Optional[str]) -> dict:
    wandb = _wandb()

    entity, project, name = split_sweep_path(sweep_id, entity, project)
    path = "/".join(x for x in (entity, project, name) if x)
    try:
        overrides = {k: v for k, v in (("entity", entity), ("project", project)) if v}
        config = wandb.Api(overrides=overrides).sweep(path).config
    except KeyboardInterrupt:
        raise
    except Exception as e:
        raise ServerError(f"cannot read sweep {path} from W&B: "
                          f"{_reason(e)}") from None
    if not isinstance(config, dict):
        raise ServerError(f"sweep {path}: W&B returned no sweep config")
    return config


@contextlib.contextmanager
def _agent_process_state(env: dict, stops: list):
    """For the duration of W&B's agent: `env` added to os.environ (the agent passes its own
    environment to each trial), the repository root as working directory (trials' relative
    paths), and SIGINT/SIGTERM recorded in `stops` before they interrupt. Afterwards the
    environment, the directory and every signal handler are as they were (the agent sets
    WANDB_* variables and leaves its signal handlers installed)."""
    environ, cwd = dict(os.environ), os.getcwd()
    main_thread = threading.current_thread() is threading.main_thread()
    handlers = {s: signal.getsignal(s) for s in signal.valid_signals()} if main_thread else {}

    def stop(signum, frame):
        stops.append(signum)
        raise KeyboardInterrupt

    try:
        os.environ.update(env)
        os.chdir(ROOT)
        if main_thread:
            for name in ("SIGINT", "SIGTERM"):
                signal.signal(getattr(signal, name), stop)
        yield
    finally:
        for s, h in handlers.items():
            if h is not None:
                with contextlib.suppress(OSError, ValueError):
                    signal.signal(s, h)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)


def agent(sweep_id: str, *, count: Optional[int] = None, project: Optional[str] = None,
          entity: Optional[str] = None, launcher: Sequence[str] = DEFAULT_LAUNCHER,
          out=print) -> int:
    """Check the W&B sweep's config, then run W&B's agent here: it starts the sweep's trials one
    after another until the server stops sending them or `count` ran. Returns the exit code (1
    if a trial failed); a SIGINT or SIGTERM stops the running trial and raises
    KeyboardInterrupt once it has ended."""
    from .supervise import RESULTS_VAR, read_results

    project = project or os.environ.get("WANDB_PROJECT") or KEYS["wandb_project"].default
    entity = entity or os.environ.get("WANDB_ENTITY")
    entity, project, name = split_sweep_path(sweep_id, entity, project)
    config = fetch_sweep_config(name, project, entity)
    source = f"sweep {sweep_id}"
    check_sweep(config, source)
    require_launcher(config, source, "run_sweep.py agent (`wandb agent` runs the sweep as it "
                     "is)")
    swept = config["parameters"].get("use_wandb", {})
    if not _base_config(config).use_wandb and "values" not in swept:
        raise SweepError(f"{source}: parameters: the trials would not log to W&B (use_wandb is "
                         "false), so the sweep would never see its metric; add "
                         "use_wandb: {value: true}")
    stops: list = []
    with tempfile.TemporaryDirectory(prefix="fp8train-agent-") as tmp:
        results = os.path.join(tmp, "trials.jsonl")
        supervised = [sys.executable, "-m", "fp8train.sweep.supervise", *launcher]
        env = dict(launcher_env(supervised), **{RESULTS_VAR: results})
        path = trial_env().get("PATH")  # `python` is this interpreter when it can be
        if path is not None:
            env["PATH"] = path
        out(f"agent: {LAUNCHER_VAR}={shlex.join(launcher)}")
        wandb = _wandb()
        with _agent_process_state(env, stops):
            try:
                wandb.agent(name, entity=entity, project=project, count=count,
                            forward_signals=True)
            except KeyboardInterrupt:
                raise
            except Exception as e:
                raise ServerError(f"sweep agent for {sweep_id}: "
                                  f"{_reason(e)}") from None
        trials = read_results(results)
    failed = [str(t["run_id"]) for t in trials if t["exit_code"] != 0]
    out(f"agent: {len(trials)} trials run, {len(failed)} failed"
        + (f" ({', '.join(failed)})" if failed else ""))
    if stops:
        raise KeyboardInterrupt
    return EXIT_FAILED if failed else EXIT_OK

