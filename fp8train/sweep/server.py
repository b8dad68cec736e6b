"""Everything that talks to the W&B server: `create` a sweep, fetch its config, and `agent`,
which runs the server's trials here one after another (AgentTrial)."""
from __future__ import annotations

import os
import shlex
from typing import Callable, Optional, Sequence

from ..config import KEYS, Config
from .errors import EXIT_FAILED, EXIT_OK, ServerError, SweepError
from .launch import (DEFAULT_INTERPRETER, PROGRAM, ROOT, agent_args, build_command, run_command,
                     trial_env)
from .spec import (check_sweep, check_trial_config, representative_params, sweep_command,
                   validate_sweep)


class TrialFailed(Exception):
    """A trial's process exited non-zero (raised inside the agent so W&B counts the failure)."""


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


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
    import wandb
    try:
        sweep_id = wandb.sweep(sweep=cfg, project=project, entity=entity)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # no key, no network, server refused the config
        raise ServerError(f"cannot create the sweep on W&B (project {project}"
                          f"{', entity ' + entity if entity else ''}): {_one_line(e)}") from None
    full = "/".join(x for x in (entity, project, sweep_id) if x)
    out(f"sweep id: {sweep_id}")
    out("start a worker on each machine (trials run one after another):")
    out(f"  python run_sweep.py agent {full} [--count N] "
        "[--accelerate_config accelerate_configs/h200.yaml | --num_processes K]")
    out(f"  wandb agent {full}        # the same trials, single-process")
    return sweep_id


class AgentTrial:
    """The function `wandb.agent` calls once per trial. wandb has set WANDB_RUN_ID,
    WANDB_SWEEP_ID and WANDB_SWEEP_PARAM_PATH (a YAML of {param: {value: v}}) in os.environ
    before the call (wandb/agents/pyagent.py, Agent._run_job); this builds the command line
    `wandb agent` would build from the sweep's command and runs it with the inherited
    environment, so that train_fp8.py's wandb.init (rank 0) attaches to the sweep's run and
    writes its run directory as <output_dir>/<WANDB_RUN_ID>."""

    def __init__(self, sweep_config: dict, interpreter: Sequence[str] = DEFAULT_INTERPRETER,
                 runner: Callable[..., int] = run_command, cwd: Optional[str] = None,
                 out=print):
        self.config = sweep_config
        self.interpreter = list(interpreter)
        self.runner = runner
        self.cwd = cwd or str(ROOT)
        self.out = out
        self.results: list[tuple[str, int]] = []

    def command(self, environ: Optional[dict] = None) -> list[str]:
        """This trial's command line, from the agent's environment."""
        from wandb.sdk.lib import config_util

        environ = os.environ if environ is None else environ
        run_id, sweep_id = environ["WANDB_RUN_ID"], environ.get("WANDB_SWEEP_ID")
        # read as wandb.init reads it ({param: value}), then in the agent's {param: {value: v}}
        values = config_util.dict_from_config_file(environ["WANDB_SWEEP_PARAM_PATH"],
                                                   must_exist=True) or {}
        args = agent_args(values)
        json_file = os.path.join(environ.get("WANDB_DIR", ""), "wandb", f"sweep-{sweep_id}",
                                 f"config-{run_id}.json")
        return build_command(self.config.get("command"), self.config["program"], args,
                             interpreter=self.interpreter, args_json_file=json_file)

    def __call__(self) -> None:
        run_id = os.environ.get("WANDB_RUN_ID", "?")
        command = self.command()
        self.out(f"trial {run_id}: {shlex.join(command)}")
        rc = self.runner(command, env=trial_env(), cwd=self.cwd)
        self.results.append((run_id, rc))
        if rc != 0:  # the agent marks the run failed and counts it (flapping, max failures)
            raise TrialFailed(f"trial {run_id}: {PROGRAM} exited with code {rc}")


def fetch_sweep_config(sweep_id: str, project: Optional[str], entity: Optional[str]) -> dict:
    import wandb
    from wandb.sdk.launch.sweeps import utils as sweep_utils

    parts = dict(entity=entity, project=project, name=sweep_id)
    err = sweep_utils.parse_sweep_id(parts)
    if err:
        raise SweepError(f"sweep id '{sweep_id}': {err}")
    entity, project = parts["entity"] or entity, parts["project"] or project
    path = "/".join(x for x in (entity, project, parts["name"]) if x)
    try:
        overrides = {k: v for k, v in (("entity", entity), ("project", project)) if v}
        config = wandb.Api(overrides=overrides).sweep(path).config
    except KeyboardInterrupt:
        raise
    except Exception as e:
        raise ServerError(f"cannot read sweep {path} from W&B: {_one_line(e)}") from None
    if not isinstance(config, dict):
        raise ServerError(f"sweep {path}: W&B returned no sweep config")
    return config


def agent(sweep_id: str, *, count: Optional[int] = None, project: Optional[str] = None,
          entity: Optional[str] = None, interpreter: Sequence[str] = DEFAULT_INTERPRETER,
          out=print) -> int:
    """Run the W&B sweep's trials here, one after another, until the server stops sending them
    or `count` ran; returns the exit code (1 if a trial failed)."""
    project = project or os.environ.get("WANDB_PROJECT") or KEYS["wandb_project"].default
    entity = entity or os.environ.get("WANDB_ENTITY")
    config = fetch_sweep_config(sweep_id, project, entity)
    source = f"sweep {sweep_id}"
    check_sweep(config, source)
    if "${interpreter}" not in sweep_command(config) and list(interpreter) != \
            list(DEFAULT_INTERPRETER):
        raise SweepError(f"{source}: command: has no ${{interpreter}} for --accelerate_config / "
                         "--num_processes to replace")
    swept = config["parameters"].get("use_wandb", {})
    if not _base_config(config).use_wandb and "values" not in swept:
        raise SweepError(f"{source}: parameters: the trials would not log to W&B (use_wandb is "
                         "false), so the sweep would never see its metric; add "
                         "use_wandb: {value: true}")
    trial = AgentTrial(config, interpreter=interpreter, out=out)
    import wandb
    try:
        wandb.agent(sweep_id, function=trial, count=count, project=project, entity=entity)
    except KeyboardInterrupt:
        raise
    except Exception as e:
        raise ServerError(f"sweep agent for {sweep_id}: {_one_line(e)}") from None
    failed = [r for r, rc in trial.results if rc != 0]
    out(f"agent: {len(trial.results)} trials run, {len(failed)} failed"
        + (f" ({', '.join(failed)})" if failed else ""))
    return EXIT_FAILED if failed else EXIT_OK

