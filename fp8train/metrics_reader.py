"""Reading a run's metrics.jsonl back (plots, run comparisons): tolerant of what a crash or a
resume leaves in it. Only the standard library is imported."""
from __future__ import annotations

import json
import sys


def load_rows(path: str, warn=None) -> list:
    """The rows of metrics.jsonl sorted by step. Unreadable lines (a torn last line from a
    crash) are skipped; a step logged twice (a resumed run) keeps its last train row and its
    last eval row. Skipped lines other than the last are reported through `warn` (default: a
    `warning:` line on stderr). OSError / UnicodeDecodeError when the file cannot be read."""
    rows, bad = {}, 0
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += i < len(lines) - 1  # a torn *last* line is expected after a crash
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            kind = next((p for p in ("val/", "train/") if any(k.startswith(p) for k in row)),
                        tuple(sorted(row)))  # eval, train or some other kind of row
            rows[(kind, row["step"])] = row
    if bad:
        message = f"skipped {bad} unreadable line(s) in {path}"
        if warn is None:
            print(f"warning: {message}", file=sys.stderr)
        else:
            warn(message)
    return sorted(rows.values(), key=lambda r: r["step"])
