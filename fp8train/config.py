"""The run config: read from YAML, overridden from the command line, validated once at start.
The keys themselves (types, defaults, bounds, docs, sections) are in schema.py.

Only the standard library and PyYAML are imported here, so `--help` and every config error
come back instantly, before torch is loaded.
"""
from __future__ import annotations

import difflib
import math
import os
import re
from typing import Any, Optional

import yaml

from .errors import ConfigError  # noqa: F401  (raised here, imported from here by many)
from .redaction import redact
from .schema import (DERIVED_SECTION, GROUPS, KEYS, KNOWN_DATASETS, MODEL_PRESETS,
                     RESUME_FREE, SECTIONS, Config, _base_type, _describe, _is_optional,
                     help_text, key_fields, section, to_dict)

# The schema's names are read from here too (config.Config, config.KEYS, ...).
__all__ = ["Config", "ConfigError", "HelpRequested", "load_config", "validate", "coerce",
           "read_yaml", "apply_mapping", "parse_cli", "dump_yaml", "DERIVED_SECTION", "GROUPS",
           "KEYS", "KNOWN_DATASETS", "MODEL_PRESETS", "RESUME_FREE", "SECTIONS", "help_text",
           "key_fields", "section", "to_dict"]

_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def coerce(f, value: Any, source: str) -> Any:
    """Check one value against its key's type and bounds; return it in canonical form."""
    name, base = f.name, _base_type(f)

    def bad(why=None):
        got = repr(value) if not isinstance(value, str) else f"'{value}'"
        raise ConfigError(f"{source}: key '{name}' must be {_describe(f)}, got {got}"
                          + (f" ({why})" if why else ""))

    if value is None:
        if _is_optional(f):
            return None
        bad()
    if base == "bool":
        if not isinstance(value, bool):
            bad()
    elif base == "int":
        if isinstance(value, bool):
            bad()
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            bad()
    elif base == "float":
        # PyYAML reads 3e-3 (no dot) as a string; accept any plain float literal.
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            bad()
        value = float(value)
        if not math.isfinite(value):
            bad()
    elif base == "str":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value:
            bad()
    elif base == "list":
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            bad()
        value = [str(v) for v in value]
    m = f.metadata
    if m.get("choices") and value not in m["choices"]:
        bad()
    if base in ("int", "float"):
        if m.get("gt") is not None and not value > m["gt"]:
            bad()
        if m.get("min") is not None and value < m["min"]:
            bad()
        if m.get("max") is not None and value > m["max"]:
            bad()
    return value


def _unknown_key(key: str, source: str, prefix: str = "") -> ConfigError:
    close = difflib.get_close_matches(key, list(KEYS), n=1, cutoff=0.6)
    hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
    what = "option" if prefix else "key"
    return ConfigError(f"unknown {what} '{prefix}{key}' in {source}{hint}")


def read_yaml(path: str, what: str = "config file",
              expected: str = "a mapping of key: value") -> dict:
    """Read a YAML mapping from `path`, with one-line errors for every way a file can be
    wrong. `what` and `expected` name the kind of file in those errors."""
    if not os.path.exists(path):
        raise ConfigError(f"{what} '{path}' not found")
    if os.path.isdir(path):
        raise ConfigError(f"{what} '{path}' is a directory, expected a YAML file")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {what} '{path}': {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    if data is None:
        raise ConfigError(f"{path}: file is empty, expected {expected}")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected {expected}, got a {type(data).__name__}")
    return data


def apply_mapping(values: dict, data: dict, source: str) -> None:
    for key, value in data.items():
        if key == DERIVED_SECTION:
            continue
        if not isinstance(key, str) or key not in KEYS:
            raise _unknown_key(str(key), source)
        if isinstance(value, dict):
            raise ConfigError(f"{source}: key '{key}' must be {_describe(KEYS[key])}, got a "
                              f"mapping (keys are flat: no nesting)")
        values[key] = coerce(KEYS[key], value, source)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

# Friendly spellings the documentation shows; each maps to (key, value).
FLAG_ALIASES = {"no_fp8": ("use_fp8", False), "no_wandb": ("use_wandb", False),
                "dry_run": ("plan_only", True)}
# Keys that may be given as a bare flag, and the value a bare flag means.
BARE_FLAG_VALUE = {"resume": "auto"}
_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False,
               "on": True, "off": False}


class HelpRequested(Exception):
    pass


def parse_cli(argv: list[str]) -> tuple[Optional[str], list[tuple[str, Any]]]:
    """Split argv into (config path, [(key, raw value), ...]) in order of appearance."""
    config_path, overrides, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            raise HelpRequested()
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument '{arg}' on the command line "
                              f"(options look like --key=value or --key value)")
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        takes_next = not eq and nxt is not None and not nxt.startswith("--")
        if name == "config":
            if not eq:
                if not takes_next:
                    raise ConfigError("option '--config' needs a file path")
                value, i = nxt, i + 1
            config_path = value
        elif name in FLAG_ALIASES and not eq:
            overrides.append(FLAG_ALIASES[name])
        elif name.startswith("no_") and name[3:] in KEYS and _base_type(KEYS[name[3:]]) == "bool" \
                and not eq:
            overrides.append((name[3:], False))
        elif name in KEYS:
            f = KEYS[name]
            if eq:
                overrides.append((name, _cli_value(f, value)))
            elif _base_type(f) == "bool":
                if takes_next and nxt.lower() in _BOOL_WORDS:
                    overrides.append((name, _BOOL_WORDS[nxt.lower()]))
                    i += 1
                else:
                    overrides.append((name, True))
            elif takes_next:
                overrides.append((name, _cli_value(f, nxt)))
                i += 1
            elif name in BARE_FLAG_VALUE:
                overrides.append((name, BARE_FLAG_VALUE[name]))
            else:
                raise ConfigError(f"option '--{name}' needs a value ({_describe(f)})")
        else:
            raise _unknown_key(name, "the command line", prefix="--")
        i += 1
    return config_path, overrides


def _cli_value(f, text: str) -> Any:
    """Command-line values are text; read them as YAML scalars so that '3e-4', 'null', 'true'
    and '[a, b]' mean what they mean in a config file."""
    if _base_type(f) == "str":
        return None if text.lower() in ("null", "none") and _is_optional(f) else text
    if _base_type(f) == "bool" and text.lower() in _BOOL_WORDS:
        return _BOOL_WORDS[text.lower()]
    try:
        return yaml.safe_load(text) if text != "" else None
    except yaml.YAMLError:
        return text


def load_config(argv: list[str]) -> Config:
    """Defaults, then the YAML file, then command-line overrides; then validate."""
    config_path, overrides = parse_cli(argv)
    values: dict[str, Any] = {}
    source = "<defaults>"
    if config_path is not None:
        apply_mapping(values, read_yaml(config_path), config_path)
        source = config_path
    for key, value in overrides:
        values[key] = coerce(KEYS[key], value, "the command line")
    if values.get("output_dir") is None:
        stem = os.path.splitext(os.path.basename(config_path))[0] if config_path else "default"
        values["output_dir"] = os.path.join("runs", stem)
    if values.get("data_dir") is None:
        values["data_dir"] = os.environ.get("FP8TRAIN_DATA_DIR") or "data"
    cfg = Config(**values, source=source)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Checks that involve more than one key. Single-key types and bounds are checked when a
    value is read."""
    src = cfg.source

    def err(msg):
        raise ConfigError(f"{src}: {msg}")

    if cfg.num_epochs is None and cfg.max_steps is None:
        err("keys 'num_epochs' and 'max_steps' are both null; set one (max_hours alone gives "
            "the LR schedule no length)")
    schedule = cfg.lr_decay_steps or cfg.max_steps
    if schedule is not None and cfg.warmup_steps >= schedule:
        which = "lr_decay_steps" if cfg.lr_decay_steps else "max_steps"
        err(f"key 'warmup_steps' ({cfg.warmup_steps}) must be smaller than {which} "
            f"({schedule}): the LR would never decay")
    if cfg.penalty_weight > 0 and cfg.penalty_type == "none":
        err(f"key 'penalty_weight' is {cfg.penalty_weight} but penalty_type is 'none'; "
            f"choose z_loss or logit_l2")
    if cfg.auto_batch_size and cfg.target_effective_batch_size is None:
        err("key 'auto_batch_size' needs target_effective_batch_size")
    if cfg.auto_batch_size and cfg.gradient_accumulation_steps is not None:
        err("key 'gradient_accumulation_steps' is derived when auto_batch_size is true; remove "
            "it (or set auto_batch_size: false)")
    if cfg.lr_scaling != "none" and cfg.lr_reference_batch_size is None:
        err(f"key 'lr_scaling' is '{cfg.lr_scaling}' but lr_reference_batch_size is not set")
    if cfg.n_kv_head is not None and cfg.n_head is not None and cfg.n_head % cfg.n_kv_head:
        err(f"key 'n_kv_head' ({cfg.n_kv_head}) must divide n_head ({cfg.n_head})")
    if cfg.n_embd is not None and cfg.n_head is not None and cfg.n_embd % cfg.n_head:
        err(f"key 'n_embd' ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
    if os.path.isdir(cfg.dataset):
        if not os.path.isfile(os.path.join(cfg.dataset, "meta.json")):
            err(f"key 'dataset': directory '{cfg.dataset}' has no meta.json: not a dataset "
                "prepared with scripts/prepare_data.py (or its preparation did not finish)")
    elif cfg.dataset not in KNOWN_DATASETS and not os.path.isfile(cfg.dataset):
        looks_like_path = cfg.dataset.endswith(".txt") or os.path.sep in cfg.dataset
        err(f"key 'dataset': file '{cfg.dataset}' not found" if looks_like_path else
            f"key 'dataset': '{cfg.dataset}' is neither a known dataset "
            f"({', '.join(KNOWN_DATASETS)}) nor a path to a .txt file")
    if cfg.use_fp8 and cfg.seq_len % 16:
        err(f"key 'seq_len' ({cfg.seq_len}) must be a multiple of 16 with use_fp8: FP8 GEMMs "
            "need the token dimension divisible by 16")
    if cfg.fp8_min_layer_size and cfg.fp8_layers != "min_size":
        err(f"key 'fp8_min_layer_size' ({cfg.fp8_min_layer_size}) applies only with fp8_layers: "
            f"min_size, but fp8_layers is '{cfg.fp8_layers}'; set fp8_layers: min_size or "
            "remove fp8_min_layer_size")
    if cfg.batch_cache_dir is not None and os.path.exists(cfg.batch_cache_dir) and \
            not os.path.isdir(cfg.batch_cache_dir):
        err(f"key 'batch_cache_dir': '{cfg.batch_cache_dir}' is not a directory")
    if cfg.resume not in ("never", "auto") and not os.path.exists(cfg.resume):
        err(f"key 'resume': checkpoint '{cfg.resume}' not found (use auto, never or a path)")


def dump_yaml(cfg: Config, derived: Optional[dict] = None) -> str:
    """The resolved config as YAML, grouped as in --help, with derived values at the end.
    Secret values from the environment (fp8train/redaction.py) are "***" in it: they are
    replaced before YAML quotes or folds them, and once more in the text."""
    lines = [f"# resolved config (from {redact(cfg.source)}); feed it back with --config"]
    by_group = {g: [f for f in key_fields() if f.metadata["group"] == g] for g in GROUPS}
    for group, fs in by_group.items():
        lines.append(f"# {group}")
        for f in fs:
            lines.append(yaml.safe_dump({f.name: redact(getattr(cfg, f.name))},
                                        default_flow_style=True, width=1000).strip()
                         .removeprefix("{").removesuffix("}"))
    text = "\n".join(lines) + "\n"
    if derived:
        text += "# written by the trainer; ignored when this file is loaded\n"
        text += yaml.safe_dump({DERIVED_SECTION: redact(derived)}, sort_keys=False)
    return redact(text)
