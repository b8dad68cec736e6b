"""`local`: run a sweep's grid or random trials here, one process after another, without the
W&B server, and tabulate each trial's metrics.jsonl in results.csv and results.md."""
from __future__ import annotations

import csv
import json
import math
import os
import shlex
import statistics
import time
from typing import Callable, Optional, Sequence

from ..errors import EXIT_FAILED, EXIT_OK, BadInput, SweepError
from ..observe.logger import METRICS_NAME
from ..observe.metrics_file import read_rows
from ..train.preflight import load_checked
from .command import DEFAULT_LAUNCHER, ROOT, build_command, config_argv, launcher_env
from .process import run_command, trial_env
from .spec import (DEFAULT_METRIC, format_value, is_number, is_value, metric_of, repo_relative,
                   require_launcher, spec_distribution, strip_source, sweep_command, validate_sweep)
from .trials import LOCAL_DISTRIBUTIONS, grid_trials, random_trials


def read_run_metrics(run_dir: str, metric: str = DEFAULT_METRIC["name"]) -> dict:
    """From a run's metrics.jsonl: the last val/loss, the median train/tokens_per_sec, and the
    last value of `metric`. Unreadable lines (a run killed mid-write) are skipped."""
    out = {"val_loss": None, "tokens_per_sec": None, "metric": None}
    if not os.path.isfile(os.path.join(run_dir, METRICS_NAME)):
        return out
    tps = []
    for row in read_rows(run_dir):
        if is_value(row.get("val/loss")):  # NaN included: a diverged run shows as nan
            out["val_loss"] = float(row["val/loss"])
        if is_number(row.get("train/tokens_per_sec")):
            tps.append(float(row["train/tokens_per_sec"]))
        if is_value(row.get(metric)):
            out["metric"] = float(row[metric])
    out["tokens_per_sec"] = statistics.median(tps) if tps else None
    return out


def best_index(results: list[dict], goal: str) -> Optional[int]:
    """The best successful trial by the metric; failed or metric-less trials never are."""
    ok = [i for i, r in enumerate(results)
          if r["exit_code"] == 0 and r["metric"] is not None and math.isfinite(r["metric"])]
    if not ok:
        return None
    sign = 1 if goal == "minimize" else -1
    return min(ok, key=lambda i: (sign * results[i]["metric"], i))


def _num(v, fmt="{:.4f}") -> str:
    return "" if v is None else fmt.format(v)


def write_results(sweep_dir: str, source: str, cfg: dict, results: list[dict]) -> tuple[str, str]:
    """results.csv (trial order, every parameter) and results.md (best first, the parameters
    that vary). Run directories are relative to the sweep directory."""
    metric = metric_of(cfg)
    names = list(cfg["parameters"])
    best = best_index(results, metric["goal"])
    extra_metric = metric["name"] != "val/loss"
    csv_path = os.path.join(sweep_dir, "results.csv")
    header = ["trial", *names, "val_loss", "tokens_per_sec"] + \
        ([metric["name"]] if extra_metric else []) + ["exit_code", "best", "run_dir"]
    with open(csv_path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        for i, r in enumerate(results):
            w.writerow([r["trial"], *[format_value(r["params"][n]) for n in names],
                        "" if r["val_loss"] is None else repr(r["val_loss"]),
                        "" if r["tokens_per_sec"] is None else f"{r['tokens_per_sec']:.1f}"] +
                       (["" if r["metric"] is None else repr(r["metric"])] if extra_metric
                        else []) +
                       [r["exit_code"], int(i == best), r["run_dir"]])
    varying = [n for n in names if len({json.dumps(r["params"][n], default=str)
                                        for r in results}) > 1] or names
    sign = 1 if metric["goal"] == "minimize" else -1
    order = sorted(range(len(results)), key=lambda i: (
        i != best, results[i]["exit_code"] != 0 or results[i]["metric"] is None,
        sign * (results[i]["metric"] if results[i]["metric"] is not None else 0), i))
    lines = [f"# Sweep results: {repo_relative(source)}", "",
             f"method {cfg['method']}, metric {metric['name']} ({metric['goal']}), "
             f"{len(results)} trial{'s' if len(results) != 1 else ''}, best first. "
             "val/loss: the last evaluation; tokens/s: the median over logged steps; run dirs "
             "relative to this file.", ""]
    cols = ["", *varying, "val/loss", "tokens/s"] + ([metric["name"]] if extra_metric else []) + \
        ["exit", "run dir"]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for i in order:
        r = results[i]
        mark = "**best**" if i == best else ("failed" if r["exit_code"] != 0 else "")
        row = [mark, *[format_value(r["params"][n]) for n in varying], _num(r["val_loss"]),
               _num(r["tokens_per_sec"], "{:,.0f}")] + \
            ([_num(r["metric"])] if extra_metric else []) + [str(r["exit_code"]), r["run_dir"]]
        lines.append("| " + " | ".join(row) + " |")
    md_path = os.path.join(sweep_dir, "results.md")
    with open(md_path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    return csv_path, md_path


def _show_path(p: str) -> str:
    rel = os.path.relpath(p)
    return p if rel.startswith("..") else rel


def run_local(path: str, *, max_trials: Optional[int] = None, output_dir: Optional[str] = None,
              overrides: Sequence[str] = (), seed: int = 0,
              launcher: Sequence[str] = DEFAULT_LAUNCHER,
              runner: Callable[..., int] = run_command, out=print) -> int:
    """Validate the sweep, check every trial's command line, then run the trials one after
    another into <output_dir>/trial_NNN, each built from the sweep's command as W&B's agent
    builds it, with FP8TRAIN_LAUNCHER set to `launcher`; returns the exit code (1 if a trial
    failed)."""
    cfg = validate_sweep(path)
    trials, total = _choose_trials(cfg, path, max_trials, seed, out)
    stem = os.path.splitext(os.path.basename(path))[0]
    sweep_dir = os.path.abspath(output_dir) if output_dir else str(ROOT / "runs" / "sweeps" / stem)
    if os.path.isdir(sweep_dir) and any(
            e.startswith("trial_") or e.startswith("results.") for e in os.listdir(sweep_dir)):
        raise SweepError(f"{_show_path(sweep_dir)} already holds a sweep's trials; remove it or "
                         "pass --output_dir DIR")
    if list(launcher) != list(DEFAULT_LAUNCHER):
        require_launcher(cfg, path, "--accelerate_config / --num_processes")
    env = dict(trial_env(local=True), **launcher_env(launcher))
    planned = _plan_trials(cfg, path, trials, sweep_dir, overrides, env)
    os.makedirs(sweep_dir, exist_ok=True)
    params = cfg["parameters"]
    varying = [k for k in params if len({json.dumps(t[2][k], default=str)
                                         for t in planned}) > 1] or list(params)
    metric = metric_of(cfg)
    out(f"sweep {repo_relative(path)}: {cfg['method']}, {len(planned)} of {total} trials -> "
        f"{_show_path(sweep_dir)}  (metric {metric['name']}, {metric['goal']})")
    results = []
    for i, (name, run_dir, params_i, argv) in enumerate(planned, 1):
        shown = ", ".join(f"{k}={format_value(params_i[k])}" for k in varying)
        out(f"[trial {i}/{len(planned)}] {shown}")
        out(f"  $ {shlex.join(argv)}")
        t0 = time.time()
        rc = runner(argv, env=env, cwd=str(ROOT))
        m = read_run_metrics(run_dir, metric["name"])
        results.append(dict(trial=name, params=params_i, exit_code=rc, run_dir=name, **m))
        write_results(sweep_dir, path, cfg, results)   # kept as they come: a crash keeps them
        outcome = "ok" if rc == 0 else f"FAILED (exit code {rc})"
        shown_metric = "" if metric["name"] == "val/loss" else \
            f"{metric['name']} {_num(m['metric'])}, "
        out(f"[trial {i}/{len(planned)}] {outcome} in {time.time() - t0:.1f} s: {shown_metric}"
            f"val/loss {_num(m['val_loss']) or 'n/a'}, "
            f"{_num(m['tokens_per_sec'], '{:,.0f}') or 'n/a'} tokens/s")
    return _report(sweep_dir, path, cfg, results, varying, metric, out)


def _report(sweep_dir: str, path: str, cfg: dict, results: list, varying: list, metric: dict,
            out) -> int:
    csv_path, md_path = write_results(sweep_dir, path, cfg, results)
    b = best_index(results, metric["goal"])
    failed = sum(r["exit_code"] != 0 for r in results)
    out(f"results: {_show_path(csv_path)}, {_show_path(md_path)}")
    if b is not None:
        r = results[b]
        shown = ", ".join(f"{k}={format_value(r['params'][k])}" for k in varying)
        out(f"best: {r['trial']} ({shown}): {metric['name']} {_num(r['metric'])}")
    if failed:
        out(f"{failed} of {len(results)} trials failed")
        return EXIT_FAILED
    return EXIT_OK


def _choose_trials(cfg: dict, path: str, max_trials: Optional[int], seed: int, out):
    """The trials local runs (parameter values each) and how many the sweep has in all."""
    method = cfg["method"]
    if method == "bayes":
        raise SweepError(f"{path}: method: bayes needs the W&B server: use create + agent")
    for name, spec in cfg["parameters"].items():
        dist = spec_distribution(name, spec, path)
        if dist not in LOCAL_DISTRIBUTIONS:
            raise SweepError(f"{path}: parameters.{name}: distribution {dist} is not supported "
                             "by local; use create + agent")
    cap = cfg.get("run_cap")
    if method == "grid":
        trials = grid_trials(cfg)
        total = len(trials)
        trials = trials[:min(x for x in (total, max_trials, cap) if x is not None)]
    else:
        if max_trials is None and cap is None:
            raise SweepError(f"{path}: method random needs --max-trials N (or run_cap in the "
                             "sweep file)")
        total = min(x for x in (max_trials, cap) if x is not None)
        trials = random_trials(cfg, total, seed)
    if "early_terminate" in cfg:
        out("note: early_terminate needs the W&B server; local runs every trial to the end")
    return trials, total


def _plan_trials(cfg: dict, path: str, trials: list, sweep_dir: str, overrides: Sequence[str],
                 env: dict) -> list:
    """(name, run_dir, params, argv) per trial; every command line is checked before the
    first trial starts."""
    program, command = cfg["program"], sweep_command(cfg)
    width = max(3, len(str(len(trials))))
    planned = []
    for i, params_i in enumerate(trials, 1):
        name = f"trial_{i:0{width}d}"
        run_dir = os.path.join(sweep_dir, name)
        argv = build_command(command, program, params_i, environ=env)
        argv += list(overrides) + [f"--output_dir={run_dir}"]
        try:
            load_checked(config_argv(argv, program))
        except BadInput as e:
            shown = ", ".join(f"{k}={format_value(v)}" for k, v in params_i.items())
            raise SweepError(f"{path}: trial {i} ({shown}) with the overrides "
                             f"{' '.join(overrides) or '(none)'}: {strip_source(str(e))}")
        planned.append((name, run_dir, params_i, argv))
    return planned


