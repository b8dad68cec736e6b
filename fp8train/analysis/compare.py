"""Runs side by side (scripts/compare_runs.py): a table of their end-of-run reports and a plot
of val/loss against time.

The table (markdown, printed, and written to OUT/compare.md) starts with the config keys whose
values differ between the runs (from each run's config.yaml: a sweep's parameters, for
instance), then each run's end-of-run report from its summary.json; a run without one (still
running, or killed) is read from its metrics.jsonl as far as it goes, and marked so. The PNG
(OUT/val_loss.png) plots each run's val/loss against wall time (x "wall"), training time
("train": evaluation and checkpoints excluded) or tokens ("tokens"). OUT is runs/compare by
default, and one that holds an earlier comparison is refused unless `overwrite`.

FP8 against its twin: each run with use_fp8 is compared with a run without it, the only such run
given, else the one whose config differs from it only in precision, fp8 and wandb keys. Rows
added in the FP8 run's column: tokens/s FP8 / twin (summary.json's steady-state tokens/s), the
val/loss both runs reached (the worse of their two best val/loss), each run's training time to
its first evaluation at or below it (from metrics.jsonl, nothing interpolated) and the ratio of
those times, and what the run's own FP8 verdict says. A value that cannot be had says why.

Only the standard library (and PyYAML) is imported here; matplotlib when the plot is drawn.
"""
from __future__ import annotations

import dataclasses
import json
import os

from ..config.schema import Config
from ..errors import EXIT_OK, BadInput
from .metrics_reader import first_reaching, load_rows, read_run_config, val_points
from .plot import pyplot

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
    ("HellaSwag acc / acc_norm", lambda s: "{acc:.4f} / {acc_norm:.4f} ({examples:,} "
     "examples, step {step:,})".format(**s["hellaswag"]) if s.get("hellaswag") else None, "{}"),
    ("peak memory (GB)", "peak_memory_gb", "{:.1f}"),
    ("skipped steps", "skipped_steps", "{:,}"),
    ("rollbacks", "rollbacks", "{:,}"),
    ("checkpoints written", "checkpoints_written", "{:,}"),
]
# Keys that name or locate a run rather than configure its training: never a difference.
NOT_COMPARED = ("output_dir", "resume", "plan_only", "derived")
# Config groups an FP8 run and its twin may differ in (schema.py's groups).
TWIN_GROUPS = ("precision", "fp8", "wandb")
X_AXES = {"wall": ("time/wall_s", "wall time (min)", 1 / 60),
          "train": ("time/train_s", "training time (min)", 1 / 60),
          "tokens": ("tokens", "tokens (millions)", 1e-6)}


def _hms(seconds):
    if seconds is None:
        return None
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _seconds(seconds: float) -> str:
    """A time to a loss: short runs (tests, demos) need the decimals that _hms drops."""
    return f"{seconds:.1f} s" if seconds < 60 else _hms(seconds)


def read_run(run_dir: str) -> tuple[dict, list]:
    """(summary, metrics rows). Without summary.json, a partial summary from the metrics."""
    if not os.path.exists(run_dir):
        raise BadInput(f"run directory '{run_dir}' does not exist")
    if not os.path.isdir(run_dir):
        raise BadInput(f"'{run_dir}' is a file, not a run directory")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    try:
        rows = load_rows(metrics) if os.path.isfile(metrics) else []
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read '{metrics}': {getattr(e, 'strerror', None) or e}") \
            from None
    path = os.path.join(run_dir, "summary.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as fh:
                summary = json.load(fh)
        except (OSError, ValueError) as e:
            raise BadInput(f"cannot read '{path}': {e}") from None
        if not isinstance(summary, dict):
            raise BadInput(f"'{path}' is not a summary (a JSON object)")
        return summary, rows
    if not rows:
        raise BadInput(f"'{run_dir}' has neither summary.json nor metrics.jsonl: not a "
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


# --- FP8 against its twin ----------------------------------------------------------------------

def is_fp8(config: dict, summary: dict) -> bool:
    """The run asked for FP8: its config.yaml's use_fp8, else (no config.yaml) its summary."""
    if isinstance(config.get("use_fp8"), bool):
        return config["use_fp8"]
    return summary.get("fp8_verdict") is not None or bool(summary.get("fp8_layers_converted"))


def only_precision_differs(a: dict, b: dict) -> bool:
    """The two configs differ only in keys of TWIN_GROUPS (and keys that name the run)."""
    if not a or not b:
        return False
    group = {f.name: f.metadata.get("group") for f in dataclasses.fields(Config)}
    keys = ({*a} | {*b}) - set(NOT_COMPARED)
    return all(group.get(k) in TWIN_GROUPS for k in keys
               if json.dumps(a.get(k), sort_keys=True, default=str)
               != json.dumps(b.get(k), sort_keys=True, default=str))


def twins(names: list, summaries: list, configs: list) -> "tuple[dict, list]":
    """({FP8 run's index: its twin's index}, notes on FP8 runs left without a twin)."""
    fp8 = [is_fp8(c, s) for c, s in zip(configs, summaries)]
    plain = [j for j, f in enumerate(fp8) if not f]
    found, notes = {}, []
    for i in (i for i, f in enumerate(fp8) if f):
        match = plain if len(plain) == 1 else \
            [j for j in plain if only_precision_differs(configs[i], configs[j])]
        if len(match) == 1:
            found[i] = match[0]
        elif plain:
            notes.append(f"{names[i]}: no single run without FP8 whose config differs from it "
                         f"only in {', '.join(TWIN_GROUPS)} keys ({len(match)} found): not "
                         "compared with a twin")
    return found, notes


def time_to_shared_loss(name_a: str, rows_a: list, name_b: str, rows_b: list) -> dict:
    """The val/loss both runs reached (the worse of their two best), each run's first
    evaluation at or below it as (step, val/loss, training seconds), and the ratio a / b of
    those times; `why` instead when a run has no usable val rows."""
    points = {}
    for name, rows in ((name_a, rows_a), (name_b, rows_b)):
        pts, why = val_points(rows)
        if not pts:
            return {"why": f"{name}: {why}"}
        points[name] = pts
    shared = max(min(p[1] for p in pts) for pts in points.values())
    a, b = (first_reaching(points[n], shared) for n in (name_a, name_b))
    return {"loss": shared, "a": a, "b": b, "ratio": a[2] / b[2] if b[2] > 0 else None}


def ratio_text(r: float) -> str:
    return f"{r:.3f}×"


def twin_rows(names: list, summaries: list, all_rows: list, pairs: dict) -> list:
    """(label, cells) rows for the table: each FP8 run against its twin, in the FP8 run's
    column ("twin of ..." in the twin's)."""
    labels = ("twin without FP8", "tokens/s FP8 / twin", "val/loss both reached",
              "training time to it (FP8 / twin)", "time to it FP8 / twin",
              "FP8 verdict (this run's own)")
    cells = {label: ["–"] * len(names) for label in labels}
    for i, j in pairs.items():
        fast = ("tokens/s FP8 / twin", tokens_ratio(names, summaries, i, j))
        t = time_to_shared_loss(names[i], all_rows[i], names[j], all_rows[j])
        if "why" in t:
            loss = timing = ratio = f"n/a ({t['why']})"
        else:
            loss = f"{t['loss']:.4f}"
            timing = " / ".join(f"{_seconds(p[2])} (step {p[0]:,})" for p in (t["a"], t["b"]))
            ratio = ratio_text(t["ratio"]) if t["ratio"] is not None else \
                f"n/a ({names[j]} reached it at 0 s of training)"
        for label, value in (("twin without FP8", names[j]), fast,
                             ("val/loss both reached", loss),
                             ("training time to it (FP8 / twin)", timing),
                             ("time to it FP8 / twin", ratio),
                             ("FP8 verdict (this run's own)", verdict_text(summaries[i]))):
            cells[label][i] = value
        twin_of = [names[k] for k, twin in pairs.items() if twin == j]
        cells["twin without FP8"][j] = "twin of " + ", ".join(twin_of)
    return [(label, cells[label]) for label in labels]


def tokens_ratio(names: list, summaries: list, i: int, j: int) -> str:
    for k in (i, j):
        tok = summaries[k].get("tokens_per_sec")
        if not isinstance(tok, (int, float)) or tok <= 0:
            why = "no summary.json" if "total_steps" not in summaries[k] else \
                "no steady-state tokens/s (too short)"
            return f"n/a ({names[k]}: {why})"
    return ratio_text(summaries[i]["tokens_per_sec"] / summaries[j]["tokens_per_sec"])


def verdict_text(summary: dict) -> str:
    """The FP8 run's own verdict in a few words (summary.json's fp8_verdict)."""
    v = summary.get("fp8_verdict")
    if not isinstance(v, dict):
        return "–"
    step = v.get("step") if isinstance(v.get("step"), dict) else {}
    if v.get("status") == "fp8" and isinstance(step.get("expected_speedup"), (int, float)):
        return f"≈{step['expected_speedup']:.2f}× expected (estimate)"
    return {"emulated": "emulated on CPU: no speed-up", "fallback": "FP8 did not run (fallback)",
            "switched_off": "FP8 switched off by a recovery",
            "no_layers": "no layer converted"}.get(v.get("status"), "no estimate")


def table(names: list, summaries: list, configs: list = (), extra: list = ()) -> str:
    """The markdown table: the differing config keys first (`config: KEY` rows), then the
    end-of-run report, then `extra` (label, cells) rows (FP8 against its twin)."""
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
    for label, cells in extra:
        if any(c != "–" for c in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_val_loss(plt, names: list, all_rows: list, x: str, dest: str) -> str:
    """val/loss against the chosen x for every run, drawn with pyplot `plt`; returns a note on
    runs left out."""
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


DEFAULT_OUT = os.path.join("runs", "compare")
OUTPUTS = ("compare.md", "val_loss.png")


def compare(run_dirs: list, out: str = DEFAULT_OUT, x: str = "wall", no_plot: bool = False,
            overwrite: bool = False) -> int:
    """The table (printed, and written to OUT/compare.md) and, unless `no_plot`, the plot of
    val/loss against `x` (a key of X_AXES) in OUT/val_loss.png; BadInput for bad input, and
    for an OUT that holds an earlier comparison unless `overwrite`."""
    seen = {}
    for d in run_dirs:
        real = os.path.realpath(d)
        if real in seen:
            raise BadInput(f"run directory '{d}' is given twice (as '{seen[real]}' too)")
        seen[real] = d
    runs = [read_run(d) for d in run_dirs]
    configs = [read_run_config(d) for d in run_dirs]
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    if len(set(names)) < len(names):   # same leaf name: show the parent too
        names = [os.path.join(*os.path.normpath(d).split(os.sep)[-2:]) for d in run_dirs]
    summaries, all_rows = [s for s, _ in runs], [r for _, r in runs]
    pairs, notes = twins(names, summaries, configs)
    md = table(names, summaries, configs, twin_rows(names, summaries, all_rows, pairs))
    earlier = [f for f in OUTPUTS if os.path.exists(os.path.join(out, f))]
    if earlier and not overwrite:
        raise BadInput(f"'{out}' holds an earlier comparison ({', '.join(earlier)}); pass "
                       "--overwrite to replace it, or --out another folder")
    try:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "compare.md"), "w", encoding="utf-8") as fh:
            fh.write(md + "\n")
        if no_plot and "val_loss.png" in earlier:   # --overwrite: no plot of other runs stays
            os.remove(os.path.join(out, "val_loss.png"))
    except OSError as e:
        raise BadInput(f"cannot write to '{out}': {e.strerror or e}") from None
    print(md)
    for note in notes:
        print(f"note: {note}")
    if not no_plot:
        plt = pyplot("the plot needs matplotlib: pip install matplotlib (or --no_plot)")
        dest = os.path.join(out, "val_loss.png")
        note = plot_val_loss(plt, names, [r for _, r in runs], x, dest)
        print(f"\nwrote {os.path.join(out, 'compare.md')} and {dest}")
        if note:
            print(f"note: {note}")
    return EXIT_OK
