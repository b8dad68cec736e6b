"""A trial's command line: the sweep's `command:` with its macros filled in as `wandb agent` fills
them, and the launcher that FP8TRAIN_LAUNCHER chooses.

W&B's agent (`wandb agent`, or `wandb.agent` without a function) builds every trial from the
sweep's `command:` in two steps: first each `${envvar:NAME}` (NAME in A-Z, 0-9, _) anywhere in an
item becomes the value of $NAME, or NAME itself when it is not set; then each item that is a
whole `${macro}` becomes its words: `${env}` /usr/bin/env, `${interpreter}` python, `${program}`
the program, `${args}` one `--key=value` per parameter (str() of the value), `${args_no_equals}`
`--key value`, `${args_no_boolean_flags}` `--key=value` with a true boolean as `--key` and a
false one left out. (The agent fills in `${envvar:...}` once, at its first trial, before it
sets that trial's WANDB_RUN_ID, and keeps the result.) The agent itself runs the trials of a
W&B sweep; `build_command` does the same for `local` (and for validation), and refuses what
train_fp8.py cannot read.

The launcher is chosen by FP8TRAIN_LAUNCHER through `-S${envvar:FP8TRAIN_LAUNCHER}` after
`${env}`: `/usr/bin/env -S` splits its value into words, so it may be `python` or
`accelerate launch --num_processes 8` (quoted as a POSIX shell would quote it).
"""
from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

from ..errors import SweepError

ROOT = Path(__file__).resolve().parents[2]  # trials run from the repository root
PROGRAM = "train_fp8.py"

LAUNCHER_VAR = "FP8TRAIN_LAUNCHER"
LAUNCHER_ITEM = "-S${envvar:" + LAUNCHER_VAR + "}"   # after ${env}: `/usr/bin/env -S<launcher>`
DEFAULT_LAUNCHER = ("python",)
# What a sweep file's command looks like: `-S` makes /usr/bin/env split the launcher into words.
EXAMPLE_COMMAND = ("${env}", LAUNCHER_ITEM, "${program}", "--config", "configs/test_fp8.yaml",
                   "${args}")
# W&B's command when a sweep has none.
DEFAULT_COMMAND = ("${env}", "${interpreter}", "${program}", "${args}")

# As wandb_agent.py expands it: the name is upper case, digits and _; an unset one stays its name.
ENVVAR = re.compile(r"\$\{envvar:([A-Z0-9_]*)\}")
# Macros whose words train_fp8.py reads: --key=value, --key value, --key / (omitted).
ARGS_MACROS = ("${args}", "${args_no_equals}", "${args_no_boolean_flags}")
PLAIN_MACROS = ("${env}", "${interpreter}", "${program}")
# W&B's other macros: JSON, key=value without hyphens, Hydra's +key / ++key.
UNREADABLE_MACROS = ("${args_no_hyphens}", "${args_json}", "${args_json_file}", "${args_dict}",
                     "${args_append_hydra}", "${args_override_hydra}")


def expand_envvars(item: str, environ: Mapping[str, str]) -> str:
    """`${envvar:NAME}` -> $NAME (NAME when unset), anywhere in the item."""
    return ENVVAR.sub(lambda m: environ.get(m.group(1), m.group(1)), item)


def macro_problem(item: str) -> Optional[str]:
    """Why `build_command` would refuse this command item, or None."""
    if item.startswith("${") and item.endswith("}") and not ENVVAR.fullmatch(item):
        if item in UNREADABLE_MACROS:
            return f"{item}: {PROGRAM} reads --key=value options; use ${{args}}"
        if item not in PLAIN_MACROS + ARGS_MACROS:
            return (f"unknown macro {item} (wandb agent would drop it); known: "
                    f"{', '.join(PLAIN_MACROS + ARGS_MACROS)}, ${{envvar:NAME}}")
        return None
    if "${" in ENVVAR.sub("", item):
        return (f"'{item}': a macro other than ${{envvar:NAME}} must be a whole list item "
                "(wandb agent leaves it as text otherwise)")
    return None


def _args(macro: str, params: Mapping) -> list[str]:
    out: list[str] = []
    for key, value in params.items():
        if macro == "${args}":
            out.append(f"--{key}={value}")
        elif macro == "${args_no_equals}":
            out += [f"--{key}", str(value)]
        elif isinstance(value, bool):  # ${args_no_boolean_flags}
            out += [f"--{key}"] if value else []
        else:
            out.append(f"--{key}={value}")
    return out


def build_command(command: Optional[Sequence], program: str, params: Mapping,
                  environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """The trial's command line for parameter values `params` ({key: value}), with `environ`
    (default os.environ) for `${envvar:...}`, as `wandb agent` would build it. SweepError (exit
    2) for a macro that wandb would drop or that train_fp8.py cannot read."""
    environ = os.environ if environ is None else environ
    out: list[str] = []
    for i, raw in enumerate(command or DEFAULT_COMMAND):
        problem = macro_problem(str(raw))
        if problem:
            raise SweepError(f"command[{i}]: {problem}")
        item = expand_envvars(str(raw), environ)
        if item == "${env}":
            out += [] if sys.platform == "win32" else ["/usr/bin/env"]
        elif item == "${interpreter}":
            out.append("python")
        elif item == "${program}":
            out.append(program)
        elif item in ARGS_MACROS:
            out += _args(item, params)
        else:
            out.append(item)
    return out


def has_launcher(command: Sequence) -> bool:
    """Whether the command takes its launcher from FP8TRAIN_LAUNCHER (`${env}` then
    `-S${envvar:FP8TRAIN_LAUNCHER}` at its start)."""
    return [str(c) for c in (command or [])[:2]] == ["${env}", LAUNCHER_ITEM]


def launcher_for(accelerate_config: Optional[str] = None,
                 num_processes: Optional[int] = None) -> list[str]:
    """The launcher's words: python, or accelerate for multi-GPU trials."""
    if accelerate_config:
        return ["accelerate", "launch", "--config_file", accelerate_config]
    if num_processes:
        return ["accelerate", "launch", "--num_processes", str(num_processes)]
    return list(DEFAULT_LAUNCHER)


def launcher_env(launcher: Sequence[str]) -> dict:
    """{FP8TRAIN_LAUNCHER: the launcher, quoted for /usr/bin/env -S}."""
    return {LAUNCHER_VAR: shlex.join(launcher)}


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
