"""metrics.jsonl read back: the one reader of the rows the logger writes (logger.py), for
everything that reads a run afterwards (plots and comparisons, the sweep runner's results,
evaluate.py, benchmarks, the tests). Standard library only."""
from __future__ import annotations

import os
from typing import Optional

from .logger import METRICS_NAME, parse_row


def read_rows(run: str, strict: bool = False, skipped: Optional[list] = None) -> list:
    """The rows of `run` (a run directory, or its metrics.jsonl) in the order they were written.
    A line that is not a JSON object (the torn last line of a crash, or damage) is skipped, and
    its number appended to `skipped` unless it is the last line (a crash in the middle of a
    write leaves one). `strict`: a ValueError naming the line instead. OSError and
    UnicodeDecodeError when the file cannot be read."""
    path = os.path.join(run, METRICS_NAME) if os.path.isdir(run) else run
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    rows = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        row = parse_row(line)
        if row is not None:
            rows.append(row)
        elif strict:
            raise ValueError(f"{path} line {i} is not a metrics row: {line[:80]!r}")
        elif skipped is not None and i < len(lines):
            skipped.append(i)
    return rows
