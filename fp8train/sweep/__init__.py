"""W&B sweeps of train_fp8.py (run_sweep.py): validate a sweep YAML, create the sweep on the W&B
server, run W&B's agent (each trial one process, or one `accelerate launch` over several GPUs),
or run the same sweep locally, without a server, and tabulate the results.

A trial is the sweep's `command:` with its macros filled in by W&B's agent, run from the
repository root: `[${env}, -S${envvar:FP8TRAIN_LAUNCHER}, ${program}, --config, <base config>,
${args}]`, the launcher coming from FP8TRAIN_LAUNCHER. `local` fills them in itself, the same
way (command.build_command). train_fp8.py reads every parameter from its command line, on
every rank.

    command       a trial's command line from the sweep's command, and the launcher
    spec          reading and validating a sweep YAML
    trials        grid and random parameter sets
    process       a trial's environment and process group
    local         the local runner and its results.csv / results.md
    wandb_client  create, agent: everything that talks to W&B (its public API)
    supervise     `python -m fp8train.sweep.supervise`: one agent trial, its stop and exit code
    cli           the argparse command line and main()

Only the standard library, PyYAML, the config package and its preflight are imported at import
time; wandb is imported where it is used, torch never. The errors are fp8train.errors' SweepError (exit 2) and
ServerError (exit 1).
"""
from ..errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, ServerError, SweepError
from .cli import main
from .command import (DEFAULT_LAUNCHER, LAUNCHER_ITEM, LAUNCHER_VAR, PROGRAM, build_command,
                      config_argv, launcher_env, launcher_for)
from .local import best_index, read_run_metrics, run_local, write_results
from .process import run_command, trial_env
from .spec import METHODS, check_sweep, check_trial_config, metric_of, validate_sweep
from .trials import grid_trials, random_trials, sample_param
from .wandb_client import agent, create, fetch_sweep_config, split_sweep_path

__all__ = [
    "main", "EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_OK", "ServerError", "SweepError",
    "DEFAULT_LAUNCHER", "LAUNCHER_ITEM", "LAUNCHER_VAR", "PROGRAM", "build_command",
    "config_argv", "launcher_env", "launcher_for", "run_command", "trial_env", "best_index",
    "read_run_metrics", "run_local", "write_results", "agent", "create", "fetch_sweep_config",
    "split_sweep_path", "METHODS", "check_sweep", "check_trial_config", "metric_of",
    "validate_sweep", "grid_trials", "random_trials", "sample_param",
]
