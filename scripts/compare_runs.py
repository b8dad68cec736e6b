#!/usr/bin/env python3
"""Compare runs side by side: a table of their end-of-run reports and a plot of val loss
against time.

    python scripts/compare_runs.py runs/fineweb_bf16 runs/fineweb_fp8
    python scripts/compare_runs.py runs/a runs/b runs/c --out runs/compare --x tokens

The table (markdown, printed, and written to OUT/compare.md) starts with the config keys whose
values differ between the runs (from each run's config.yaml: a sweep's parameters, for
instance), then each run's end-of-run report from its summary.json; a run without one (still
running, or killed) is read from its metrics.jsonl as far as it goes, and marked so. The PNG
(OUT/val_loss.png, default OUT: the current directory's compare/) plots each run's val/loss
against wall time (--x wall, the default), training time (--x train: evaluation and
checkpoints excluded) or tokens (--x tokens).
Exit 0: compared; 2: bad input.
"""
import argparse
import json
import os
import sys

from fp8train.errors import EXIT_OK, ConfigError, run_reported
from fp8train.metrics_reader import load_rows, read_run_config

# (label, summary key or function of the summary, format)
ROWS = [
    ("model", "model", "{}"),
    ("parameters", "n_params", "{:,}"),
    ("precision", lambda s: s["precision"] + (f" + FP8 {s['fp8']} ({s['fp8_layers_converted']} "
                                               "layers)" if s.get("fp8_layers_converted") else ""),
     "{}"),
    ("effective batch (seq)", lambda s: (s.get("batch") or {}).get("effective_batch_size"), "{:,}"),
    ("micro × accum × world", lambda s: "{micro_batch_size} × {gradient_accumulation_steps} × "
     "{world_size}".format(**s["batch"]) if s.get("batch") else None, "{}"),
    ("status", "status", "{}"),
    ("steps", lambda s: f"{s['steps']:,} / {s['total_steps']:,}" if s.get("total_steps")
     else s.get("steps"), "{}"),
    ("tokens", "tokens", "{:,}"),
    ("final val/loss", "final_val_loss", "{:.4f}"),
    ("best val/loss", lambda s: f"{s['best_val_loss']:.4f} (step {s['best_val_step']:,})"
     if s.get("best_val_loss") is not None else None, "{}"),
    ("target val/loss", "target_val_loss", "{:g}"),
    ("target met", lambda s: None if s.get("target_met") is None else
     ("yes" if s["target_met"] else f"no (gap {s['target_gap']:.4f})"
      if s.get("target_gap") is not None else "no"), "{}"),
    ("time to target", lambda s: _hms(s.get("time_to_target_s")), "{}"),
    ("tokens to target", "tokens_to_target", "{:,}"),
    ("wall time", lambda s: _hms(s.get("wall_time_s")), "{}"),
    ("training time", lambda s: _hms(s.get("train_time_s")), "{}"),
    ("tokens/s (steady)", "tokens_per_sec", "{:,.0f}"),
    ("MFU (steady)", lambda s: None if s.get("mfu") is None else f"{100 * s['mfu']:.1f}%", "{}"),
    ("peak memory (GB)", "peak_memory_gb", "{:.1f}"),
    ("skipped steps", "skipped_steps", "{:,}"),
    ("rollbacks", "rollbacks", "{:,}"),
    ("checkpoints written", "checkpoints_written", "{:,}"),
]
# Keys that name or locate a run rather than configure its training: never a difference.
NOT_COMPARED = ("output_dir", "resume", "plan_only", "derived")
X_AXES = {"wall": ("time/wall_s", "wall time (min)", 1 / 60),
          "train": ("time/train_s", "training time (min)", 1 / 60),
          "tokens": ("tokens", "tokens (millions)", 1e-6)}


def _hms(seconds):
    if seconds is None:
        return None
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def read_run(run_dir: str) -> tuple[dict, list]:
    """(summary, metrics rows). Without summary.json, a partial summary from the metrics."""
    if not os.path.exists(run_dir):
        raise ConfigError(f"run directory '{run_dir}' does not exist")
    if not os.path.isdir(run_dir):
        raise ConfigError(f"'{run_dir}' is a file, not a run directory")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    try:
        rows = load_rows(metrics) if os.path.isfile(metrics) else []
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read '{metrics}': {getattr(e, 'strerror', None) or e}") \
            from None
    path = os.path.join(run_dir, "summary.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as fh:
                summary = json.load(fh)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read '{path}': {e}") from None
        if not isinstance(summary, dict):
            raise ConfigError(f"'{path}' is not a summary (a JSON object)")
        return summary, rows
    if not rows:
        raise ConfigError(f"'{run_dir}' has neither summary.json nor metrics.jsonl: not a "
                          "run directory")
    evals = [r for r in rows if "val/loss" in r]
    summary = {"status": "no summary.json (unfinished?)", "steps": rows[-1]["step"],
               "tokens": rows[-1].get("tokens"),
               "final_val_loss": evals[-1]["val/loss"] if evals else None}
    if evals:
        best = min(evals, key=lambda r: r["val/loss"])
        summary.update(best_val_loss=best["val/loss"], best_val_step=best["step"])
    return summary, rows


def differing_keys(configs: list) -> list:
    """The config keys whose values differ between the runs that have a config.yaml."""
    known = [c for c in configs if c]
    keys = sorted({k for c in known for k in c if k not in NOT_COMPARED})
    return [k for k in keys if len({json.dumps(c.get(k), sort_keys=True, default=str)
                                    for c in known}) > 1] if len(known) > 1 else []


def _config_cell(config: dict, key: str) -> str:
    if not config:
        return "–"
    v = config.get(key)
    return v if isinstance(v, str) else json.dumps(v, default=str)   # as YAML: true, null


def table(names: list, summaries: list, configs: list = ()) -> str:
    """The markdown table: the differing config keys first (`config: KEY` rows), then the
    end-of-run report."""
    configs = list(configs) or [{} for _ in names]
    lines = ["| | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for key in differing_keys(configs):
        lines.append(f"| config: {key} | " + " | ".join(_config_cell(c, key) for c in configs)
                     + " |")
    for label, key, fmt in ROWS:
        cells = []
        for s in summaries:
            try:
                v = key(s) if callable(key) else s.get(key)
                cells.append("–" if v is None else fmt.format(v))
            except (KeyError, TypeError, ValueError):   # a summary.json edited or damaged
                cells.append("–")
        if any(c != "–" for c in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(names: list, all_rows: list, x: str, dest: str) -> str:
    """val/loss against the chosen x for every run; returns a note on runs left out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    key, label, scale = X_AXES[x]
    fig, ax = plt.subplots(figsize=(9, 5))
    missing = []
    for name, rows in zip(names, all_rows):
        pts = [(r[key] * scale, r["val/loss"]) for r in rows
               if "val/loss" in r and isinstance(r.get(key), (int, float))]
        if not pts:
            missing.append(name)
            continue
        ax.plot(*zip(*pts), marker="o", markersize=3, label=name)
    ax.set_xlabel(label)
    ax.set_ylabel("val/loss (nats/token)")
    ax.grid(True, alpha=0.3)
    if len(missing) < len(names):
        ax.legend()
    ax.set_title(f"val/loss against {label.split(' (')[0]}")
    fig.tight_layout()
    fig.savefig(dest, dpi=100)
    plt.close(fig)
    return (f"not in the plot (no {key} in its val rows, e.g. written by an older fp8train; "
            f"--x tokens works for any run): {', '.join(missing)}") if missing else ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dirs", nargs="+", help="run directories (output_dir of each run)")
    p.add_argument("--out", default="compare", help="folder for compare.md and val_loss.png "
                                                    "(default ./compare)")
    p.add_argument("--x", choices=sorted(X_AXES), default="wall",
                   help="x axis of the plot: wall time, training time or tokens")
    p.add_argument("--no_plot", action="store_true", help="the table only")
    a = p.parse_args(argv)
    return run_reported(lambda: compare(a))


def compare(a) -> int:
    """The table (printed and written) and the plot; ConfigError for bad input."""
    seen = {}
    for d in a.run_dirs:
        real = os.path.realpath(d)
        if real in seen:
            raise ConfigError(f"run directory '{d}' is given twice (as '{seen[real]}' too)")
        seen[real] = d
    runs = [read_run(d) for d in a.run_dirs]
    configs = [read_run_config(d) for d in a.run_dirs]
    names = [os.path.basename(os.path.normpath(d)) for d in a.run_dirs]
    if len(set(names)) < len(names):   # same leaf name: show the parent too
        names = [os.path.join(*os.path.normpath(d).split(os.sep)[-2:]) for d in a.run_dirs]
    md = table(names, [s for s, _ in runs], configs)
    try:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "compare.md"), "w", encoding="utf-8") as fh:
            fh.write(md + "\n")
    except OSError as e:
        raise ConfigError(f"cannot write to '{a.out}': {e.strerror or e}") from None
    print(md)
    if not a.no_plot:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            raise ConfigError("the plot needs matplotlib: pip install matplotlib (or --no_plot)")
        dest = os.path.join(a.out, "val_loss.png")
        note = plot(names, [r for _, r in runs], a.x, dest)
        print(f"\nwrote {os.path.join(a.out, 'compare.md')} and {dest}")
        if note:
            print(f"note: {note}")
    return EXIT_OK


if __name__ == "__main__":
    from fp8train.console import run_main   # a closed stdout (| head): no traceback
    sys.exit(run_main(main))
