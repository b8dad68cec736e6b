"""The command line: `--config FILE` and `--key=value` / `--key value` overrides, the friendly
spellings the documentation shows (`--no_fp8`, `--dry_run`, a bare `--resume`), and one-line
errors for every slip (a stray argument, a missing value, an unknown option)."""
from __future__ import annotations

import os
from typing import Any, Optional

import yaml

from ..errors import BadInput
from .schema import KEYS, base_type, describe_accepted, is_optional
from .values import unknown_key
from .yaml_files import yaml_scalar

# Friendly spellings the documentation shows; each maps to (key, value).
FLAG_ALIASES = {"no_fp8": ("use_fp8", False), "no_wandb": ("use_wandb", False),
                "dry_run": ("plan_only", True)}
# Keys that may be given as a bare flag, and the value a bare flag means.
BARE_FLAG_VALUE = {"resume": "auto"}
_BOOL_WORDS = {"true": True, "false": False}


class HelpRequested(Exception):
    pass


def parse_cli(argv: list[str]) -> tuple[Optional[str], list[tuple[str, Any, str]]]:
    """Split argv into (config path, [(key, raw value, the option as typed), ...]) in order of
    appearance. A key given twice: the last one wins (a wrapper's defaults, then the user's)."""
    if "-h" in argv or "--help" in argv:
        raise HelpRequested()
    config_path, overrides, i, bare = None, [], 0, None
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise BadInput(_positional(arg, bare))
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        takes_next = not eq and nxt is not None and not nxt.startswith("--")
        bare = None
        if name == "config":
            if not eq:
                if not takes_next:
                    raise BadInput("option '--config' needs a file path")
                value, i = nxt, i + 1
            if not value:
                raise BadInput("option '--config' needs a file path")
            if config_path is not None:
                raise BadInput(f"option '--config' is given twice ('{config_path}', then "
                                  f"'{value}'): a run reads one config file; override its keys "
                                  "with --key=value")
            config_path = value
        elif name in FLAG_ALIASES or (name.startswith("no_") and name[3:] in KEYS):
            key, val = FLAG_ALIASES.get(name, (name[3:], False))
            if base_type(KEYS[key]) != "bool":
                raise BadInput(f"option '--{name}': '{key}' is not a boolean key; use "
                                  f"--{key}=VALUE ({describe_accepted(KEYS[key])})")
            if eq:
                raise BadInput(f"option '--{name}' takes no value; use --{key}=true or "
                                  f"--{key}=false")
            overrides.append((key, val, f"--{name}"))
            bare = f"--{name}"
        elif name in KEYS:
            f = KEYS[name]
            if eq:
                if value == "":
                    raise BadInput(f"option '--{name}=' has an empty value"
                                      + (f" (--{name}=null unsets it)" if is_optional(f)
                                         else f" ({describe_accepted(f)})"))
                overrides.append((name, _cli_value(f, value), f"--{name}={value}"))
            elif base_type(f) == "bool":
                if takes_next and nxt.lower() in _BOOL_WORDS:
                    overrides.append((name, _BOOL_WORDS[nxt.lower()], f"--{name}={nxt}"))
                    i += 1
                else:
                    overrides.append((name, True, f"--{name}"))
                    bare = f"--{name}"
            elif takes_next:
                overrides.append((name, _cli_value(f, nxt), f"--{name}={nxt}"))
                i += 1
            elif name in BARE_FLAG_VALUE:
                overrides.append((name, BARE_FLAG_VALUE[name], f"--{name}"))
            else:
                raise BadInput(f"option '--{name}' needs a value ({describe_accepted(f)})")
        else:
            raise unknown_key(name, "the command line", prefix="--")
        i += 1
    return config_path, overrides


def _positional(arg: str, bare: Optional[str]) -> str:
    msg = f"unexpected argument '{arg}' on the command line"
    if bare:
        return msg + f" ({bare} takes no value; booleans are --key=true or --key=false)"
    if arg.endswith((".yaml", ".yml")) or os.path.isfile(arg):
        return msg + f" (did you mean --config {arg}?)"
    return msg + " (options look like --key=value or --key value)"


def _cli_value(f, text: str) -> Any:
    """Command-line values are text; read them as YAML scalars so that '3e-4', 'null', 'true'
    and '[a, b]' mean what they mean in a config file."""
    if base_type(f) == "str":
        return None if text.lower() in ("null", "none") and is_optional(f) else text
    if base_type(f) == "bool" and text.lower() in _BOOL_WORDS:
        return _BOOL_WORDS[text.lower()]
    try:
        return yaml_scalar(text)
    except (yaml.YAMLError, ValueError):   # ValueError: `!!int abc`
        return text
