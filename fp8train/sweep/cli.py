"""The run_sweep.py command line: argparse for create / agent / local / validate, and main(),
which reports a SweepError (exit 2) or ServerError (exit 1) as one line and returns the exit
code."""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
from typing import Optional

from ..errors import EXIT_OK, ServerError, SweepError, report
from .command import DEFAULT_LAUNCHER, LAUNCHER_VAR, launcher_for
from .local import run_local
from .process import trial_env
from .spec import validate_sweep
from .wandb_client import agent, create


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run_sweep.py",
        description="W&B sweeps of train_fp8.py: create a sweep, run an agent, or run the "
        "sweep locally without a server.",
        epilog="Exit codes: 0 done, 1 a trial failed or W&B could not be reached, 2 bad sweep "
        "file or arguments (one line naming the file and key).")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{create,agent,local,validate}")

    def launcher_options(sp):
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--accelerate_config", "--accelerate-config", metavar="FILE",
                       help="run each trial as `accelerate launch --config_file FILE` "
                       f"(the launcher, ${LAUNCHER_VAR} in the sweep's command; default python)")
        g.add_argument("--num_processes", "--num-processes", type=int, metavar="K",
                       help="run each trial as `accelerate launch --num_processes K`")

    c = sub.add_parser("create", allow_abbrev=False, help="validate a sweep YAML and create the "
                       "sweep on W&B; prints its id")
    c.add_argument("sweep_yaml")
    c.add_argument("--project", help="W&B project (default: the sweep file's, else the base "
                   "config's wandb_project)")
    c.add_argument("--entity", help="W&B entity (default: the sweep file's, else the base "
                   "config's wandb_entity, else your default)")

    a = sub.add_parser("agent", allow_abbrev=False, help="run trials of a W&B sweep on this "
                       "machine, one after another")
    a.add_argument("sweep_id", help="SWEEP_ID, PROJECT/SWEEP_ID or ENTITY/PROJECT/SWEEP_ID")
    a.add_argument("--count", type=int, help="stop after this many trials")
    a.add_argument("--project", help="W&B project (default: from the sweep id, $WANDB_PROJECT, "
                   "else fp8train)")
    a.add_argument("--entity", help="W&B entity (default: from the sweep id, else yours)")
    launcher_options(a)

    lo = sub.add_parser("local", allow_abbrev=False,
                        help="run the sweep here without W&B (grid or random) and tabulate the "
                        "results", description="Extra --key=value arguments (or everything "
                        "after --) are appended to every trial's command line.")
    lo.add_argument("sweep_yaml")
    lo.add_argument("--max-trials", "--max_trials", type=int, dest="max_trials",
                    help="run at most this many trials (random: required unless run_cap)")
    lo.add_argument("--output_dir", "--output-dir", dest="output_dir", metavar="DIR",
                    help="sweep directory (default runs/sweeps/<sweep file name>)")
    lo.add_argument("--sweep-seed", "--sweep_seed", type=int, default=0, dest="sweep_seed",
                    help="seed of the random method's draws (default 0)")
    launcher_options(lo)

    v = sub.add_parser("validate", allow_abbrev=False, help="check sweep YAMLs and exit")
    v.add_argument("sweep_yaml", nargs="+")
    return p


def _launcher(args) -> list[str]:
    """The launcher from the command line; paths made absolute (trials run from the repository
    root)."""
    if args.accelerate_config is None and args.num_processes is None:
        return list(DEFAULT_LAUNCHER)
    if args.accelerate_config is not None and not os.path.isfile(args.accelerate_config):
        raise SweepError(f"--accelerate_config: file '{args.accelerate_config}' not found")
    if args.num_processes is not None and args.num_processes < 1:
        raise SweepError(f"--num_processes must be >= 1, got {args.num_processes}")
    if shutil.which("accelerate", path=trial_env().get("PATH")) is None:
        raise SweepError("--accelerate_config / --num_processes: the accelerate command is not "
                         "on PATH (pip install accelerate)")
    if args.accelerate_config is not None:
        return launcher_for(accelerate_config=os.path.abspath(args.accelerate_config))
    return launcher_for(num_processes=args.num_processes)


def _run(args, overrides: list[str]) -> int:
    if args.cmd == "agent":
        if args.count is not None and args.count < 1:
            raise SweepError(f"--count must be >= 1, got {args.count}")
        return agent(args.sweep_id, count=args.count, project=args.project,
                     entity=args.entity, launcher=_launcher(args))
    if args.max_trials is not None and args.max_trials < 1:
        raise SweepError(f"--max-trials must be >= 1, got {args.max_trials}")
    return run_local(args.sweep_yaml, max_trials=args.max_trials, output_dir=args.output_dir,
                     overrides=overrides, seed=args.sweep_seed, launcher=_launcher(args))


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    after = []
    if "--" in argv:
        i = argv.index("--")
        argv, after = argv[:i], argv[i + 1:]
    args, unknown = _parser().parse_known_args(argv)
    previous = None
    try:
        if args.cmd != "local" and (unknown or after):
            raise SweepError(f"unexpected arguments for {args.cmd}: {' '.join(unknown + after)}")
        for a in unknown:
            if a.startswith("-") and not a.startswith("--"):
                raise SweepError(f"unexpected argument '{a}' (overrides look like --key=value)")
        if args.cmd == "validate":
            for path in args.sweep_yaml:
                validate_sweep(path)
                print(f"{path}: ok")
            return EXIT_OK
        if args.cmd == "create":
            create(args.sweep_yaml, project=args.project, entity=args.entity)
            return EXIT_OK
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (a scheduler's preemption) stops the running trial too, like Ctrl-C
            previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            return _run(args, unknown + after)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    except (SweepError, ServerError) as e:
        return report(e)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
