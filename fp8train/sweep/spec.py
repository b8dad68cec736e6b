"""Reading and validating a sweep YAML: the checks `create`, `agent` and `local` share, so
that a bad file or parameter is one line naming the file and key (SweepError)."""
from __future__ import annotations

import itertools
import json
import math
import os
import re
from typing import Any

from ..config.load import KEYS, Config, read_yaml
from ..errors import BadInput, SweepError, did_you_mean
from ..train.preflight import load_checked
from .command import (ARGS_MACROS, DEFAULT_COMMAND, EXAMPLE_COMMAND, LAUNCHER_ITEM, LAUNCHER_VAR,
                      PROGRAM, ROOT, build_command, config_argv, has_launcher, macro_problem)

METHODS = ("grid", "random", "bayes")
GOALS = ("minimize", "maximize")
DEFAULT_METRIC = {"name": "val/loss", "goal": "minimize"}
# The top-level keys of a W&B sweep config (anything else is a typo).
TOP_LEVEL_KEYS = ("program", "method", "metric", "parameters", "command", "name", "description",
                  "project", "entity", "early_terminate", "run_cap", "controller", "job",
                  "image_uri", "apiVersion")

# distribution -> the keys it needs
DISTRIBUTIONS = {
    "constant": ("value",), "categorical": ("values",),
    "int_uniform": ("min", "max"), "uniform": ("min", "max"), "q_uniform": ("min", "max"),
    "log_uniform": ("min", "max"), "log_uniform_values": ("min", "max"),
    "q_log_uniform": ("min", "max"), "q_log_uniform_values": ("min", "max"),
    "inv_log_uniform": ("min", "max"), "inv_log_uniform_values": ("min", "max"),
    "normal": (), "q_normal": (), "log_normal": (), "q_log_normal": (),
    "beta": (), "q_beta": (),
}
PARAM_KEYS = ("value", "values", "probabilities", "distribution", "min", "max", "mu", "sigma",
              "q", "a", "b")
GRID_PRODUCT_CHECK_LIMIT = 1024  # sweeps of up to this many combinations are checked one by one


def is_value(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_number(x) -> bool:
    return is_value(x) and math.isfinite(x)


def repo_relative(text: str) -> str:
    """Error messages name files relative to the repository root."""
    return text.replace(str(ROOT) + os.sep, "")


def read_sweep_yaml(path: str) -> dict:
    try:
        return read_yaml(path, "sweep file", "a W&B sweep config (a mapping with program, "
                         "method, parameters, ...)")
    except BadInput as e:
        raise SweepError(str(e)) from None


def validate_sweep(path: str) -> dict:
    """Read and validate a sweep YAML; return it as a dict. Raises SweepError naming the file
    and the key."""
    cfg = read_sweep_yaml(path)
    check_sweep(cfg, path)
    return cfg


def _fail(source: str, where: str, msg: str):
    raise SweepError(repo_relative(f"{source}: {where}: {msg}"))


def sweep_command(cfg: dict) -> list[str]:
    """The sweep's command as strings (W&B's default when it has none)."""
    command = cfg.get("command")
    return [str(c) for c in command] if command else list(DEFAULT_COMMAND)


def require_launcher(cfg: dict, source: str, what: str) -> None:
    """SweepError unless the sweep's command takes its launcher from FP8TRAIN_LAUNCHER, which
    `what` needs."""
    if not has_launcher(sweep_command(cfg)):
        _fail(source, "command", f"must start with ${{env}}, {LAUNCHER_ITEM} (the launcher) "
              f"for {what}, e.g. [{', '.join(EXAMPLE_COMMAND)}]")


def metric_of(cfg: dict) -> dict:
    m = cfg.get("metric") or {}
    return {"name": m.get("name", DEFAULT_METRIC["name"]),
            "goal": m.get("goal", DEFAULT_METRIC["goal"])}


def _check_metric(cfg: dict, source: str) -> None:
    if "metric" not in cfg:
        if cfg.get("method") == "bayes":
            _fail(source, "metric", "method bayes needs a metric: {name: val/loss, goal: "
                  "minimize}")
        return
    m = cfg["metric"]
    if not isinstance(m, dict):
        _fail(source, "metric", f"expected a mapping {{name: ..., goal: minimize|maximize}}, "
              f"got {m!r}")
    for k in m:
        if k not in ("name", "goal", "target"):
            _fail(source, f"metric.{k}", "unknown key (metric has name, goal, target)")
    if not isinstance(m.get("name"), str) or not m["name"]:
        _fail(source, "metric.name", "missing: the logged metric to optimise, e.g. val/loss")
    if "goal" in m and m["goal"] not in GOALS:
        _fail(source, "metric.goal", f"must be minimize or maximize, got {m['goal']!r}")
    if "target" in m and not is_number(m["target"]):
        _fail(source, "metric.target", f"must be a number, got {m['target']!r}")


def _check_program_and_command(cfg: dict, source: str) -> tuple[str, list[str]]:
    """Returns (program, command)."""
    program = cfg.get("program")
    if program is None:
        _fail(source, "program", f"missing: set program: {PROGRAM}")
    if not isinstance(program, str) or not program:
        _fail(source, "program", f"must be a file name, got {program!r}")
    if os.path.isabs(program) or not (ROOT / program).is_file():
        _fail(source, "program", f"'{program}' is not a file in the repository root "
              f"(expected {PROGRAM})")
    if os.path.basename(program) != PROGRAM:
        _fail(source, "program", f"this launcher sweeps {PROGRAM}, got '{program}'")
    shown = "[" + ", ".join(EXAMPLE_COMMAND) + "]"
    if "command" not in cfg:
        return program, list(DEFAULT_COMMAND)
    raw = cfg["command"]
    if not isinstance(raw, list) or not raw or \
            not all(isinstance(c, (str, int, float)) and not isinstance(c, bool) for c in raw):
        _fail(source, "command", f"must be a list of strings, e.g. {shown}")
    command = [str(c) for c in raw]
    for i, c in enumerate(command):
        problem = macro_problem(c)
        if problem:
            _fail(source, f"command[{i}]", problem)
    if any(LAUNCHER_VAR in c for c in command) and not has_launcher(command):
        _fail(source, "command", f"{LAUNCHER_ITEM} goes right after ${{env}}, at the start "
              f"(/usr/bin/env -S splits the launcher into words): {shown}")
    if "${program}" not in command and not any(c.endswith(PROGRAM) for c in command):
        _fail(source, "command", f"does not run the program: add ${{program}} (or {PROGRAM})")
    found = [c for c in command if c in ARGS_MACROS]
    if len(found) != 1:
        _fail(source, "command", "needs exactly one ${args} (or ${args_no_equals}, "
              "${args_no_boolean_flags}) for the swept parameters" +
              (f", got {', '.join(found)}" if found else ""))
    config_path = None
    for i, c in enumerate(command):
        if c == "--config":
            if i + 1 >= len(command) or command[i + 1].startswith("$"):
                _fail(source, "command", "'--config' needs a file path after it")
            config_path = command[i + 1]
        elif c.startswith("--config="):
            config_path = c.partition("=")[2]
    if config_path is None:
        _fail(source, "command", "needs --config FILE (the base run config the parameters "
              "override), e.g. --config configs/test_fp8.yaml")
    if "${envvar:" not in config_path:
        resolved = config_path if os.path.isabs(config_path) else str(ROOT / config_path)
        if not os.path.isfile(resolved):
            _fail(source, "command", f"--config {config_path}: file not found (paths are "
                  "relative to the repository root)")
        try:
            load_checked(["--config", resolved])
        except BadInput as e:
            _fail(source, "command", f"--config {config_path}: {e}")
    return program, command


def spec_distribution(name: str, spec: dict, source: str) -> str:
    """The W&B distribution a parameter spec means (as wandb infers it)."""
    where = f"parameters.{name}"
    if "distribution" in spec:
        d = spec["distribution"]
        if d not in DISTRIBUTIONS:
            close = did_you_mean(d, DISTRIBUTIONS)
            _fail(source, f"{where}.distribution", f"unknown distribution {d!r}" +
                  (f" (did you mean {close}?)" if close else ""))
        return d
    if "value" in spec:
        return "constant"
    if "values" in spec:
        return "categorical"
    if "min" in spec and "max" in spec:
        lo, hi = spec["min"], spec["max"]
        for k, v in (("min", lo), ("max", hi)):
            if not is_number(v):
                _number_error(source, f"{where}.{k}", v)
        if isinstance(lo, int) and isinstance(hi, int):
            return "int_uniform"
        if isinstance(lo, float) and isinstance(hi, float):
            return "uniform"
        _fail(source, where, "min and max must both be integers (int_uniform) or both floats "
              "(uniform), as wandb requires; or set distribution")
    _fail(source, where, "needs value, values, or a distribution (min/max, ...)")


def _number_error(source, where, v):
    hint = (f" (YAML reads {v} as text: write it with a dot, e.g. 1.0e-4)"
            if isinstance(v, str) else "")
    _fail(source, where, f"must be a number, got {v!r}{hint}")


def _check_param_spec(name: str, spec: Any, method: str, source: str) -> str:
    where = f"parameters.{name}"
    if not isinstance(spec, dict):
        _fail(source, where, f"expected a mapping like {{values: [...]}} or {{value: x}}, got "
              f"{spec!r}")
    if "parameters" in spec:
        _fail(source, where, "nested parameters are not supported: config keys are flat")
    for k in spec:
        if k not in PARAM_KEYS:
            close = did_you_mean(k, PARAM_KEYS)
            _fail(source, f"{where}.{k}", "unknown key" +
                  (f" (did you mean {close}?)" if close else
                   f" (a parameter has {', '.join(PARAM_KEYS)})"))
    dist = spec_distribution(name, spec, source)
    for k in DISTRIBUTIONS[dist]:
        if k not in spec:
            _fail(source, where, f"distribution {dist} needs {k}")
    if "value" in spec and isinstance(spec["value"], dict):
        _fail(source, f"{where}.value", "must be a value, got a mapping")
    if "values" in spec:
        vals = spec["values"]
        if not isinstance(vals, list) or not vals:
            _fail(source, f"{where}.values", f"must be a non-empty list, got {vals!r}")
        if any(isinstance(v, dict) for v in vals):
            _fail(source, f"{where}.values", "items must be values, not mappings")
        if "probabilities" in spec:
            p = spec["probabilities"]
            if not isinstance(p, list) or len(p) != len(vals) or \
                    not all(is_number(x) and x >= 0 for x in p):
                _fail(source, f"{where}.probabilities", f"must be {len(vals)} numbers >= 0 "
                      "(one per value)")
            if abs(sum(p) - 1.0) > 1e-6:
                _fail(source, f"{where}.probabilities", f"must sum to 1, got {sum(p):g}")
    elif "probabilities" in spec:
        _fail(source, f"{where}.probabilities", "only goes with values")
    for k in ("min", "max", "mu", "sigma", "q", "a", "b"):
        if k in spec and not is_number(spec[k]):
            _number_error(source, f"{where}.{k}", spec[k])
    if "min" in spec and "max" in spec and not spec["min"] < spec["max"]:
        _fail(source, where, f"min ({spec['min']}) must be smaller than max ({spec['max']})")
    if dist == "int_uniform" and not all(isinstance(spec[k], int) for k in ("min", "max")):
        _fail(source, where, "int_uniform needs integer min and max")
    if dist in ("log_uniform_values", "q_log_uniform_values", "inv_log_uniform_values") and \
            spec["min"] <= 0:
        _fail(source, f"{where}.min", f"{dist} needs min > 0, got {spec['min']}")
    for k in ("sigma", "q", "a", "b"):
        if k in spec and spec[k] <= 0:
            _fail(source, f"{where}.{k}", f"must be > 0, got {spec[k]}")
    if method == "grid" and dist not in ("constant", "categorical", "int_uniform"):
        _fail(source, where, f"grid search needs value, values or int_uniform; {dist} cannot be "
              "enumerated (use method random or bayes)")
    return dist


def quantize(x: float, q) -> float:
    return round(x / q) * q


def _support_points(spec: dict, dist: str) -> list:
    """The values a parameter can take (grid: all of them) or representative ones of its
    distribution (its bounds and middle), to be validated against the config."""
    if dist == "constant":
        return [spec["value"]]
    if dist == "categorical":
        return list(spec["values"])
    lo, hi = spec.get("min"), spec.get("max")
    q = spec.get("q", 1)
    if dist == "int_uniform":
        return list(range(lo, hi + 1)) if hi - lo < 64 else [lo, (lo + hi) // 2, hi]
    if dist == "uniform":
        return [lo, (lo + hi) / 2, hi]
    if dist == "q_uniform":
        pts = [quantize(lo, q), quantize((lo + hi) / 2, q), quantize(hi, q)]
        return [int(p) for p in pts] if all(isinstance(x, int) for x in (lo, hi, q)) else pts
    if dist in ("log_uniform", "inv_log_uniform"):
        pts = [math.exp(lo), math.exp((lo + hi) / 2), math.exp(hi)]
        return [1 / p for p in pts] if dist.startswith("inv") else pts
    if dist == "q_log_uniform":
        return [quantize(math.exp(x), q) for x in (lo, (lo + hi) / 2, hi)]
    if dist in ("log_uniform_values", "inv_log_uniform_values"):
        return [lo, math.sqrt(lo * hi), hi]
    if dist == "q_log_uniform_values":
        pts = [quantize(x, q) for x in (lo, math.sqrt(lo * hi), hi)]
        return [int(p) for p in pts] if all(isinstance(x, int) for x in (lo, hi, q)) else pts
    if dist in ("normal", "q_normal"):
        return [spec.get("mu", 0.0)]
    if dist in ("log_normal", "q_log_normal"):
        return [math.exp(spec.get("mu", 0.0))]
    return [0.5]  # beta: in (0, 1)


def representative_params(cfg: dict) -> dict:
    """One valid-looking value per parameter: its fixed value, first value or lower bound."""
    return {name: _support_points(spec, spec_distribution(name, spec, "<sweep>"))[0]
            for name, spec in cfg["parameters"].items()}


def check_trial_config(command: list[str], program: str, params: dict) -> Config:
    """The run config train_fp8.py reads from this trial's command line; BadInput if it
    would reject it."""
    built = build_command(command, program, params)
    return load_checked(config_argv(built, program))


def strip_source(msg: str) -> str:
    """A config error as part of a sweep error: without the base config's file name."""
    # "--key=value on the command line: key 'x' ...", "--key=value, base.yaml: key 'x' ...":
    # where the values came from goes; the sweep error names the parameter.
    msg = re.sub(r"^.*?: (?=keys? ')", "", repo_relative(msg), count=1)
    msg = msg.replace("the command line: ", "")
    head, sep, rest = msg.partition(": ")
    if sep and (head.endswith(".yaml") or head.endswith(".yml")):
        msg = rest
    return msg


def format_value(v) -> str:
    return json.dumps(v) if isinstance(v, (bool, type(None))) else str(v)


def check_sweep(cfg: dict, source: str) -> None:
    """Every check `create`, `agent` and `local` share. Raises SweepError."""
    for k in cfg:
        if k not in TOP_LEVEL_KEYS:
            close = did_you_mean(k, TOP_LEVEL_KEYS)
            _fail(source, str(k), "unknown sweep key" +
                  (f" (did you mean {close}?)" if close else ""))
    method = cfg.get("method")
    if method is None:
        _fail(source, "method", "missing: grid, random or bayes")
    if method not in METHODS:
        _fail(source, "method", f"must be grid, random or bayes, got {method!r}")
    _check_metric(cfg, source)
    if "run_cap" in cfg and (not isinstance(cfg["run_cap"], int) or
                             isinstance(cfg["run_cap"], bool) or cfg["run_cap"] < 1):
        _fail(source, "run_cap", f"must be an integer >= 1, got {cfg['run_cap']!r}")
    if "early_terminate" in cfg and not (isinstance(cfg["early_terminate"], dict)
                                         and "type" in cfg["early_terminate"]):
        _fail(source, "early_terminate", "expected a mapping like {type: hyperband, min_iter: 3}")
    program, command = _check_program_and_command(cfg, source)

    params = cfg.get("parameters")
    if not isinstance(params, dict) or not params:
        _fail(source, "parameters", "missing or empty: a mapping of config key -> {values: "
              "[...]} / {value: x} / {distribution: ..., min: ..., max: ...}")
    dists = {}
    for name, spec in params.items():
        if not isinstance(name, str) or name not in KEYS:
            close = did_you_mean(name, KEYS)
            _fail(source, f"parameters.{name}", "not a config key" +
                  (f" (did you mean {close}?)" if close else
                   " (python train_fp8.py --help lists them)"))
        if name in ("config", "output_dir"):
            _fail(source, f"parameters.{name}", "set by the launcher per trial; not a sweep "
                  "parameter")
        dists[name] = _check_param_spec(name, spec, method, source)

    points = {n: _support_points(params[n], d) for n, d in dists.items()}
    base = {n: pts[0] for n, pts in points.items()}  # = representative_params(cfg)
    try:
        check_trial_config(command, program, base)
    except BadInput as e:
        msg = strip_source(str(e))
        named = re.match(r"key '(\w+)'", msg)
        if named and named.group(1) in params:
            key = named.group(1)
            _fail(source, f"parameters.{key}",
                  f"value {format_value(base[key])} is not valid: {msg}")
        shown = ", ".join(f"{k}={format_value(v)}" for k, v in base.items())
        _fail(source, "parameters", f"with {shown}: {msg}")
    for name, pts in points.items():
        for v in pts[1:]:
            try:
                check_trial_config(command, program, dict(base, **{name: v}))
            except BadInput as e:
                what = "value" if dists[name] in ("constant", "categorical") else \
                    f"{dists[name]} point"
                _fail(source, f"parameters.{name}", f"{what} {format_value(v)} is not valid: "
                      f"{strip_source(str(e))}")
    # Combinations: a grid's trials, or the points a random or bayes trial may draw (a key that
    # applies only with another's value, e.g. muon_lr beside optimizer: [adamw, muon], fails
    # here rather than in the trials that draw it).
    names = list(points)
    total = math.prod(len(points[n]) for n in names)
    if total <= GRID_PRODUCT_CHECK_LIMIT:
        for combo in itertools.product(*(points[n] for n in names)):
            trial = dict(zip(names, combo))
            try:
                check_trial_config(command, program, trial)
            except BadInput as e:
                shown = ", ".join(f"{k}={format_value(v)}" for k, v in trial.items()
                                  if len(points[k]) > 1)
                drawn = "" if method == "grid" else " (which a trial may draw)"
                _fail(source, "parameters", f"combination {shown}{drawn} is not valid: "
                      f"{strip_source(str(e))}")
