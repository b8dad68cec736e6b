"""W&B sweeps of train_fp8.py (run_sweep.py): validate a sweep YAML, create the sweep on the W&B
server, run an agent (each trial one process, or one `accelerate launch` over several GPUs), or
run the same sweep locally, without a server, and tabulate the results.

A trial is the sweep's `command` with its macros filled in exactly as `wandb agent` fills them
(launch.build_command), run as a subprocess from the repository root; train_fp8.py reads every
parameter from its command line, on every rank.

    errors  SweepError (exit 2), ServerError (exit 1)
    spec    reading and validating a sweep YAML
    trials  grid and random parameter sets
    launch  a trial's command line, environment and process
    local   the local runner and its results.csv / results.md
    server  create, agent (everything that talks to W&B)
    cli     the argparse command line and main()

Only the standard library, PyYAML and fp8train.config are imported at import time; wandb is
imported where it is used, torch never.
"""
from .cli import main
from .errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, ServerError, SweepError
from .launch import (DEFAULT_INTERPRETER, PROGRAM, build_command, config_argv, interpreter_for,
                     run_command, trial_env)
from .local import best_index, read_run_metrics, run_local, write_results
from .server import AgentTrial, TrialFailed, agent, create
from .spec import METHODS, check_sweep, check_trial_config, metric_of, validate_sweep
from .trials import grid_trials, random_trials, sample_param

__all__ = [
    "main", "EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_OK", "ServerError", "SweepError",
    "DEFAULT_INTERPRETER", "PROGRAM", "build_command", "config_argv", "interpreter_for",
    "run_command", "trial_env", "best_index", "read_run_metrics", "run_local", "write_results",
    "AgentTrial", "TrialFailed", "agent", "create", "METHODS", "check_sweep",
    "check_trial_config", "metric_of", "validate_sweep", "grid_trials", "random_trials",
    "sample_param",
]
