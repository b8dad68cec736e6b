"""Reading a run's metrics.jsonl back (plots, run comparisons): tolerant of what a crash or a
resume leaves in it, and the run's train.log and config.yaml beside it. Only the standard
library (and PyYAML for config.yaml) is imported."""
from __future__ import annotations

import os
import re
import sys

from ..config.yaml_files import upgrade_saved
from ..observe.metrics_file import read_rows


def load_rows(path: str, warn=None) -> list:
    """The rows of metrics.jsonl sorted by step. Unreadable lines (a torn last line from a
    crash) are skipped; a step logged twice (a resumed run) keeps its last train row and its
    last eval row. Skipped lines other than the last are reported through `warn` (default: a
    `warning:` line on stderr). OSError / UnicodeDecodeError when the file cannot be read."""
    rows, skipped = {}, []
    for row in read_rows(path, skipped=skipped):
        if isinstance(row.get("step"), (int, float)):
            kind = next((p for p in ("val/", "train/") if any(k.startswith(p) for k in row)),
                        tuple(sorted(row)))  # eval, train or some other kind of row
            rows[(kind, row["step"])] = row
    if skipped:
        message = f"skipped {len(skipped)} unreadable line(s) in {path}"
        if warn is None:
            print(f"warning: {message}", file=sys.stderr)
        else:
            warn(message)
    return sorted(rows.values(), key=lambda r: r["step"])


# The line build.open_run writes to train.log when a run continues from a checkpoint.
_RESUMED = re.compile(r"resumed from .* at step ([\d,]+) \(")


def resume_steps(run_dir: str) -> list:
    """The steps at which the run in `run_dir` was resumed: from train.log's "resumed from ...
    at step N" lines; without train.log, from the rows of a metrics.jsonl that a resume did not
    truncate (a step lower than the one before it: the first row re-run, a step or a log
    interval after the checkpoint; checkpoint rows, logged when a background write ends, are
    left out). Nothing readable: []."""
    found = set()
    try:
        with open(os.path.join(run_dir, "train.log"), encoding="utf-8", errors="replace") as fh:
            for line in fh:
                m = _RESUMED.search(line)
                if m:
                    found.add(int(m.group(1).replace(",", "")))
        return sorted(found)
    except OSError:
        pass
    last = None
    try:
        rows = read_rows(run_dir)
    except (OSError, UnicodeDecodeError):
        rows = []
    for row in rows:
        step = row.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool) or \
                any(k.startswith("checkpoint/") for k in row):
            continue   # a background checkpoint's row comes after later steps' rows
        if last is not None and step < last:
            found.add(int(step))
        last = step
    return sorted(found)


def read_run_config(run_dir: str) -> dict:
    """The run's config.yaml as a mapping (its `derived` section included); {} when there is
    none or it cannot be read: a run's plots and comparisons do without."""
    import yaml
    path = os.path.join(run_dir, "config.yaml")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return upgrade_saved(data)   # read as a resume reads it (older fp8_recipe values) if isinstance(data, dict) else {}


def lr_schedule(config: dict):
    """(steps, lrs) of the whole LR schedule the run followed, from step 0, in the row
    convention of metrics.jsonl (the row of step N holds the LR of the N-th step: lr_at(N-1)),
    computed by the trainer's own schedule; None when config.yaml lacks what it needs. A run
    resumed with another length followed the earlier schedule before its resume: the
    config.yaml of the last start is the one drawn."""
    from ..optim.schedule import lr_at
    derived = config.get("derived") if isinstance(config.get("derived"), dict) else {}
    kw = dict(max_lr=derived.get("peak_learning_rate", config.get("learning_rate")),
              warmup_steps=config.get("warmup_steps"),
              total_steps=derived.get("lr_schedule_steps"),
              min_lr_ratio=config.get("min_lr_ratio"))
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in kw.values()) \
            or kw["total_steps"] < 1 or kw["warmup_steps"] < 0:
        return None
    # Runs from before lr_schedule followed the cosine.
    kw.update(schedule=config.get("lr_schedule", "cosine"),
              decay_fraction=config.get("lr_decay_fraction", 0.2),
              decay_shape=config.get("lr_decay_shape", "linear"))
    total = int(kw["total_steps"])
    stride = max(1, total // 20000)   # a long run's curve needs no more points than pixels
    steps = sorted(set(range(0, total + 1, stride)) | {total} |
                   set(range(0, min(total, int(kw["warmup_steps"])) + 2)))
    # Step 0 (before the first step) continues the warmup's line down to 0.
    return steps, [lr_at(s - 1, **kw) if s else 0.0 if kw["warmup_steps"] else kw["max_lr"]
                   for s in steps]


def val_points(rows: list, time_key: str = "time/train_s") -> "tuple[list, str]":
    """(points, why): the evaluations in `rows` (load_rows' order) as (step, val/loss, seconds)
    with seconds the row's `time_key` (training time: evaluation and checkpoints excluded), the
    non-finite losses left out; no points: `why` says what the rows lack."""
    import math
    evals = [r for r in rows if "val/loss" in r]
    if not evals:
        return [], "no val rows"
    finite = [r for r in evals if isinstance(r["val/loss"], (int, float))
              and math.isfinite(r["val/loss"])]
    if not finite:
        return [], "no finite val/loss"
    points = [(r["step"], float(r["val/loss"]), r[time_key]) for r in finite
              if isinstance(r.get(time_key), (int, float)) and not isinstance(r[time_key], bool)]
    if not points:
        return [], f"no {time_key} in its val rows (written by an older fp8train)"
    return points, ""


def first_reaching(points: list, loss: float):
    """The first (step, val/loss, seconds) at or below `loss`, nothing interpolated; None when
    no evaluation reached it."""
    return next((p for p in points if p[1] <= loss), None)
