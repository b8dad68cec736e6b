"""The run config: read from YAML, overridden from the command line, validated once at start.
The keys themselves (types, defaults, bounds, docs, sections) are in schema.py.

Only the standard library and PyYAML are imported here, so `--help` and every config error
come back instantly, before torch is loaded.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, Optional

import yaml

from ..data.sources import dataset_error, resolved_dataset
from ..errors import BadInput, did_you_mean, one_line
from ..observe.redaction import redact
from .schema import (DELAYED_SCALING_KEYS, DERIVED_SECTION, FP8_RECIPES, GROUPS, KEYS,
                     KNOWN_DATASETS, MODEL_PRESETS, RESUME_FREE, SECTIONS, Config, _base_type,
                     _describe, _is_optional, help_text, key_fields, section, to_dict)

# The schema's names are read from here too (config.Config, config.KEYS, ...).
__all__ = ["Config", "BadInput", "HelpRequested", "load_config", "validate", "coerce",
           "read_yaml", "apply_mapping", "parse_cli", "dump_yaml", "DERIVED_SECTION", "GROUPS",
           "KEYS", "KNOWN_DATASETS", "MODEL_PRESETS", "RESUME_FREE", "SECTIONS", "help_text",
           "key_fields", "section", "to_dict"]

# --- YAML, strictly -----------------------------------------------------------------------------
# PyYAML follows YAML 1.1, where `yes`, `no`, `on`, `off` are booleans, `010` is 8, `1:30` is 90,
# `2024-01-01` is a date and `3e-3` is a string. Config files (and command-line values, read as
# YAML scalars) use the YAML 1.2 core schema instead: true/false, null, decimal (or 0x/0o)
# integers, and floats with or without a dot; everything else is a string.

class ConfigSlip(yaml.YAMLError):
    """Valid YAML that a config file must not contain (a key given twice, a merge key)."""

    def __init__(self, problem: str, mark):
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader with the YAML 1.2 core schema's scalars, and mappings whose keys are
    unique (PyYAML keeps the last of two, silently) and not merge keys."""

    def construct_mapping(self, node, deep=False):
        lines: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise ConfigSlip("merge keys (<<) are not supported: write each key",
                                 key_node.start_mark)
            key = self.construct_object(key_node, deep=True)
            try:
                if key in lines:
                    raise ConfigSlip(f"key '{key}' is given twice (first on line {lines[key]})",
                                     key_node.start_mark)
                lines[key] = key_node.start_mark.line + 1
            except TypeError:       # an unhashable key: PyYAML's own error says which
                break
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text.lstrip("+"))
        base = 16 if digits[:2] == "0x" else 8 if digits[:2] == "0o" else 10
        return sign * int(digits[2:] if base != 10 else digits, base)

    def construct_yaml_float(self, node):
        text = self.construct_scalar(node).lower()
        if text.endswith(("inf", "nan")):
            return float(text.replace(".", ""))
        return float(text)


StrictLoader.yaml_implicit_resolvers = {}
for _tag, _pattern, _first in (
        ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
        ("null", r"^(?:~|null|Null|NULL|)$", "~nN"),
        ("int", r"^[-+]?[0-9]+$|^0o[0-7]+$|^0x[0-9a-fA-F]+$", "-+0123456789"),
        ("float", r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$"
                  r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$", "-+.0123456789"),
        ("merge", r"^<<$", "<")):
    StrictLoader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_pattern),
                                       list(_first) + ([""] if _tag == "null" else []))
StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)


def yaml_scalar(text: str) -> Any:
    """A command-line value read as a YAML scalar, as in a config file."""
    return yaml.load(text, Loader=StrictLoader)


class StrictDumper(yaml.SafeDumper):
    """Writes what StrictLoader reads back the same: PyYAML's dumper quotes by YAML 1.1, so it
    would leave `3e-4` or `0o7` plain, and the loader above would read a number."""


def _represent_str(dumper, value: str):
    try:
        plain_is_text = isinstance(yaml_scalar(value), str)
    except yaml.YAMLError:
        plain_is_text = True     # not a plain scalar at all: the dumper quotes it by itself
    return dumper.represent_scalar("tag:yaml.org,2002:str", value,
                                   style=None if plain_is_text else "'")


StrictDumper.add_representer(str, _represent_str)


# --- one value ----------------------------------------------------------------------------------

def coerce(f, value: Any, source: str) -> Any:
    """Check one value against its key's type and bounds; return it in canonical form."""
    name, base = f.name, _base_type(f)

    def bad(why=None):
        got = repr(value) if not isinstance(value, str) else f"'{value}'"
        raise BadInput(f"{source}: key '{name}' must be {_describe(f)}, got {got}"
                          + (f" ({why})" if why else ""))

    if value is None:
        if _is_optional(f):
            return None
        bad()
    if base == "bool":
        if not isinstance(value, bool):
            bad()
    elif base == "int":
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)      # 1e6, 3.0: integral, so the integer that was meant
        if isinstance(value, bool) or not isinstance(value, int):
            bad("not a whole number" if isinstance(value, float) else None)
    elif base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            bad()
        value = float(value) + 0.0      # + 0.0: -0.0 becomes 0.0
        if not math.isfinite(value):
            bad()
    elif base == "str":
        if isinstance(value, (bool, int, float)):
            bad("YAML read a number or true/false: quote it to mean text")
        if not isinstance(value, str) or not value:
            bad()
        if value != value.strip():
            bad("leading or trailing whitespace")
    elif base == "tuple":    # a pair of step numbers: [5, 8] in YAML, --key=5,8 or [5,8]
        if isinstance(value, str):
            value = [v.strip() for v in value.strip("[]").split(",")]
            value = [int(v) if re.fullmatch(r"\d+", v) else v for v in value]
        if not isinstance(value, list) or len(value) != 2 or \
                not all(isinstance(v, int) and not isinstance(v, bool) for v in value) or \
                not 1 <= value[0] <= value[1]:
            bad()
        value = list(value)
    elif base == "list":
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or \
                not all(isinstance(v, str) and v and v == v.strip() for v in value):
            bad("each item a non-empty string; quote numbers and true/false")
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


def _suggest(key: str) -> Optional[str]:
    spelled = key.strip().lower().replace("-", "_")
    if spelled in KEYS:
        return spelled
    return did_you_mean(spelled, KEYS)


def _unknown_key(key: str, source: str, prefix: str = "") -> BadInput:
    close = _suggest(key)
    hint = f" (did you mean '{prefix}{close}'?)" if close else ""
    what = "option" if prefix else "key"
    return BadInput(f"unknown {what} '{prefix}{key}' in {source}{hint}")


def read_yaml(path: str, what: str = "config file",
              expected: str = "a mapping of key: value") -> dict:
    """Read a YAML mapping from `path`, with one-line errors for every way a file can be
    wrong. `what` and `expected` name the kind of file in those errors."""
    if not path:
        raise BadInput(f"{what}: empty path")
    if not os.path.exists(path):
        raise BadInput(f"{what} '{path}' not found")
    if os.path.isdir(path):
        raise BadInput(f"{what} '{path}' is a directory, expected a YAML file")
    try:
        with open(path, encoding="utf-8-sig") as fh:     # -sig: a byte-order mark is fine
            text = fh.read()
    except UnicodeDecodeError as e:
        raise BadInput(f"cannot read {what} '{path}': not UTF-8 text (byte "
                          f"0x{e.object[e.start]:02x} at offset {e.start})") from None
    except OSError as e:
        raise BadInput(f"cannot read {what} '{path}': {e.strerror or e}") from None
    try:
        data = yaml.load(text, Loader=StrictLoader)
    except ConfigSlip as e:
        raise BadInput(f"{path}: line {e.problem_mark.line + 1}: {e.problem}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if isinstance(e, yaml.composer.ComposerError) and e.context:
            problem = f"{e.context}, {problem}"     # "expected a single document, but ..."
        if "'\\t'" in problem:
            problem += " (YAML indents with spaces, never tabs)"
        raise BadInput(f"{path}: not valid YAML{where}: {problem}") from None
    except ValueError as e:   # an explicit tag on a value it cannot hold: `!!int abc`
        raise BadInput(f"{path}: not valid YAML: {one_line(e, 200)}") from None
    if data is None:
        raise BadInput(f"{path}: file is empty, expected {expected}")
    if not isinstance(data, dict):
        raise BadInput(f"{path}: expected {expected}, got a {type(data).__name__}")
    return data


def apply_mapping(values: dict, data: dict, source: str,
                  origins: Optional[dict] = None) -> None:
    """Check the keys and values of a YAML mapping into `values`; `origins` (when given)
    records `source` as where each key came from."""
    for key, value in data.items():
        if key == DERIVED_SECTION:
            continue
        if not isinstance(key, str) or key not in KEYS:
            raise _unknown_key(str(key), source)
        if isinstance(value, dict):
            raise BadInput(f"{source}: key '{key}' must be {_describe(KEYS[key])}, got a "
                              f"mapping (keys are flat: no nesting)")
        values[key] = coerce(KEYS[key], value, source)
        if origins is not None:
            origins[key] = source


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

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
            if _base_type(KEYS[key]) != "bool":
                raise BadInput(f"option '--{name}': '{key}' is not a boolean key; use "
                                  f"--{key}=VALUE ({_describe(KEYS[key])})")
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
                                      + (f" (--{name}=null unsets it)" if _is_optional(f)
                                         else f" ({_describe(f)})"))
                overrides.append((name, _cli_value(f, value), f"--{name}={value}"))
            elif _base_type(f) == "bool":
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
                raise BadInput(f"option '--{name}' needs a value ({_describe(f)})")
        else:
            raise _unknown_key(name, "the command line", prefix="--")
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
    if _base_type(f) == "str":
        return None if text.lower() in ("null", "none") and _is_optional(f) else text
    if _base_type(f) == "bool" and text.lower() in _BOOL_WORDS:
        return _BOOL_WORDS[text.lower()]
    try:
        return yaml_scalar(text)
    except (yaml.YAMLError, ValueError):   # ValueError: `!!int abc`
        return text


def load_config(argv: list[str]) -> Config:
    """Defaults, then the YAML file, then command-line overrides; then validate."""
    config_path, overrides = parse_cli(argv)
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}      # key -> the file or the option its value came from
    source = "<defaults>"
    if config_path is not None:
        apply_mapping(values, read_yaml(config_path), config_path, origins)
        source = config_path
    for key, value, typed in overrides:
        values[key] = coerce(KEYS[key], value, f"{typed} on the command line")
        origins[key] = typed
    if values.get("output_dir") is None:
        stem = os.path.splitext(os.path.basename(config_path))[0] if config_path else "default"
        values["output_dir"] = os.path.join("runs", stem)
    if values.get("data_dir") is None:
        values["data_dir"] = os.environ.get("FP8TRAIN_DATA_DIR") or "data"
    # A name under data_dir becomes its path here, so config.yaml records what was read.
    values["dataset"] = resolved_dataset(values.get("dataset", KEYS["dataset"].default),
                                         values["data_dir"])
    cfg = Config(**values, source=source, origins=origins)
    validate(cfg)
    return cfg


def origin_layer(cfg: Config, key: str) -> int:
    """How late the key's value was set: 0 default, 1 config file, 2 command line."""
    origin = cfg.origins.get(key)
    return 0 if origin is None else 2 if origin.startswith("--") else 1


def validate(cfg: Config) -> None:
    """Checks that involve more than one key. Single-key types and bounds are checked when a
    value is read."""
    def err(msg, *keys):
        raise BadInput(f"{cfg.where(*keys)}: {msg}")

    if cfg.num_epochs is None and cfg.max_steps is None:
        err("keys 'num_epochs' and 'max_steps' are both null; set one (max_hours alone gives "
            "the LR schedule no length)", "num_epochs", "max_steps")
    # A warmup not shorter than the schedule is shortened once the run's length is known
    # (planning.run_length): a short run of a longer config means that. Only a length set in
    # the same place as the warmup, or before it, contradicts it.
    which = "lr_decay_steps" if cfg.lr_decay_steps else "max_steps" if cfg.max_steps else None
    if which and cfg.warmup_steps >= getattr(cfg, which) and \
            origin_layer(cfg, "warmup_steps") >= origin_layer(cfg, which):
        err(f"key 'warmup_steps' ({cfg.warmup_steps}) must be smaller than {which} "
            f"({getattr(cfg, which)}): the LR would never decay", "warmup_steps", which)
    if cfg.penalty_weight > 0 and cfg.penalty_type == "none":
        err(f"key 'penalty_weight' is {cfg.penalty_weight} but penalty_type is 'none'; "
            f"choose z_loss or logit_l2", "penalty_weight", "penalty_type")
    if cfg.auto_batch_size and cfg.target_effective_batch_size is None:
        err("key 'auto_batch_size' needs target_effective_batch_size", "auto_batch_size")
    if cfg.auto_batch_size and cfg.gradient_accumulation_steps is not None:
        err("key 'gradient_accumulation_steps' is derived when auto_batch_size is true; remove "
            "it (or set auto_batch_size: false)", "gradient_accumulation_steps",
            "auto_batch_size")
    if cfg.lr_scaling != "none" and cfg.lr_reference_batch_size is None:
        err(f"key 'lr_scaling' is '{cfg.lr_scaling}' but lr_reference_batch_size is not set",
            "lr_scaling")
    if cfg.n_kv_head is not None and cfg.n_head is not None and cfg.n_head % cfg.n_kv_head:
        err(f"key 'n_kv_head' ({cfg.n_kv_head}) must divide n_head ({cfg.n_head})",
            "n_kv_head", "n_head")
    if cfg.n_embd is not None and cfg.n_head is not None and cfg.n_embd % cfg.n_head:
        err(f"key 'n_embd' ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})",
            "n_embd", "n_head")
    bad_dataset = dataset_error(cfg.dataset, cfg.data_dir, cfg.tokenizer)
    if bad_dataset:
        err(bad_dataset, "dataset", "data_dir", "tokenizer")
    if cfg.use_fp8 and cfg.seq_len % 16:
        err(f"key 'seq_len' ({cfg.seq_len}) must be a multiple of 16 with use_fp8: FP8 GEMMs "
            "need the token dimension divisible by 16", "seq_len", "use_fp8")
    if cfg.use_fp8:
        _check_fp8_recipe(cfg, err)
    if cfg.fp8_min_layer_size and cfg.fp8_layers != "min_size":
        err(f"key 'fp8_min_layer_size' ({cfg.fp8_min_layer_size}) applies only with fp8_layers: "
            f"min_size, but fp8_layers is '{cfg.fp8_layers}'; set fp8_layers: min_size or "
            "remove fp8_min_layer_size", "fp8_min_layer_size", "fp8_layers")
    if cfg.batch_cache_dir is not None and os.path.exists(cfg.batch_cache_dir) and \
            not os.path.isdir(cfg.batch_cache_dir):
        err(f"key 'batch_cache_dir': '{cfg.batch_cache_dir}' is not a directory",
            "batch_cache_dir")
    if cfg.resume not in ("never", "auto"):
        from ..checkpoint.manager import path_problem  # directory listings only: no torch here
        problem = path_problem(cfg.resume)
        if problem:
            err(f"key 'resume': {problem}"
                + ("; resume is auto, never or a path" if "not found" in problem else ""),
                "resume")


def _check_fp8_recipe(cfg: Config, err) -> None:
    backend, recipe = cfg.fp8_backend, cfg.fp8_recipe
    accepted = FP8_RECIPES[backend]
    if recipe not in accepted:
        legacy = " (a config.yaml written by an older fp8train recorded torchao's default " \
            "here, where it meant delayed scaling: remove the line)" \
            if recipe == "tensorwise" else ""
        err(f"key 'fp8_recipe' is '{recipe}', which fp8_backend '{backend}' does not have; "
            f"{backend} accepts {' | '.join(accepted)}{legacy}", "fp8_recipe", "fp8_backend")
    if recipe in ("current", "block"):
        for key in DELAYED_SCALING_KEYS:
            if key in cfg.origins:
                err(f"key '{key}' applies to delayed scaling only, but fp8_recipe is '{recipe}' "
                    "(each tensor scaled from its own amax at every step: no margin, no "
                    "history); remove it", key, "fp8_recipe")
    if cfg.fp8_fsdp_all_gather and (backend, recipe) != ("torchao", "tensorwise"):
        err(f"key 'fp8_fsdp_all_gather' needs fp8_backend torchao with fp8_recipe tensorwise "
            f"(here {backend} / {recipe}); remove it", "fp8_fsdp_all_gather", "fp8_backend",
            "fp8_recipe")


def dump_yaml(cfg: Config, derived: Optional[dict] = None) -> str:
    """The resolved config as YAML, grouped as in --help, with derived values at the end.
    Secret values from the environment (fp8train/observe/redaction.py) are "***" in it: they are
    replaced before YAML quotes or folds them, and once more in the text."""
    lines = [f"# resolved config (from {redact(cfg.source)}); feed it back with --config"]
    by_group = {g: [f for f in key_fields() if f.metadata["group"] == g] for g in GROUPS}
    for group, fs in by_group.items():
        lines.append(f"# {group}")
        for f in fs:
            lines.append(yaml.dump({f.name: redact(getattr(cfg, f.name))}, Dumper=StrictDumper,
                                   default_flow_style=True, width=1000).strip()
                         .removeprefix("{").removesuffix("}"))
    text = "\n".join(lines) + "\n"
    if derived:
        text += "# written by the trainer; ignored when this file is loaded\n"
        text += yaml.dump({DERIVED_SECTION: redact(derived)}, Dumper=StrictDumper,
                          sort_keys=False)
    return redact(text)
