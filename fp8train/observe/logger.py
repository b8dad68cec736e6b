"""The run's one logger: every message and every metric row leaves the trainer here.

    msg(text) / warn(text)   console (rank 0) + train.log
    log(row)                 metrics.jsonl + W&B + the progress line (for training rows)
    samples(step, rows)      samples.jsonl + a W&B table
    summary(report)          summary.json + the W&B run's summary

Secret values from the environment (fp8train/errors.py) are read once, here, and removed
from everything that goes out through this object, W&B's config and arguments included.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

from ..errors import BadInput
from ..io import atomic_write, atomic_write_json
from ..errors import redact, secret_values

METRICS_NAME, SAMPLES_NAME, LOG_NAME, SUMMARY_NAME = \
    "metrics.jsonl", "samples.jsonl", "train.log", "summary.json"


class Logger:
    def __init__(self, is_main: bool):
        self.is_main = is_main
        self._secrets = secret_values()   # read once: every line is checked against them
        self._file = None
        self.metrics: Optional[JsonLines] = None
        self.sample_rows: Optional[JsonLines] = None
        self.tracker = None               # W&B, once started (tracking.Tracker)
        self.progress: Optional[Progress] = None

    def clean(self, obj):
        """`obj` (a string, or nested dicts/lists of them) with secret values as "***"."""
        return redact(obj, self._secrets)

    # --- where the run writes ------------------------------------------------------------------
    def open(self, run_dir: str) -> None:
        """Start writing into the run directory (created and checked by the builder). Every rank
        calls it; BadInput on every rank when one of the run's files cannot be written (a
        directory in its place, no permission): found now, not as lost rows later."""
        from ..ranks import on_rank0
        on_rank0(lambda: self._open(run_dir) if self.is_main else None)
        self.metrics = JsonLines(os.path.join(run_dir, METRICS_NAME), self.is_main, self.warn)
        self.sample_rows = JsonLines(os.path.join(run_dir, SAMPLES_NAME), self.is_main,
                                     self.warn)

    def _open(self, run_dir: str) -> None:
        for name in (LOG_NAME, METRICS_NAME, SAMPLES_NAME, SUMMARY_NAME):
            path = os.path.join(run_dir, name)
            if os.path.isdir(path):
                raise BadInput(f"'{path}' is a directory: the run writes its {name} there; "
                                  "move it away or choose another output_dir")
        path = os.path.join(run_dir, LOG_NAME)
        try:
            self._file = open(path, "a", buffering=1, encoding="utf-8")
        except OSError as e:
            raise BadInput(f"cannot write '{path}' ({e.strerror or e}); choose another "
                              "output_dir") from None

    def attach(self, tracker) -> None:
        """Rows, samples and the summary go to W&B too from here on."""
        self.tracker = tracker

    def start_progress(self, total: int, initial: int, mfu_label: str = "") -> None:
        self.progress = Progress(self, total, initial, mfu_label)

    # --- messages --------------------------------------------------------------------------------
    def msg(self, text: str) -> None:
        if self.is_main:
            text = self.clean(text)
            if self.progress is not None and self.progress.bar is not None:
                self.progress.bar.write(text)   # above the bar, not through it
            else:
                print(text, flush=True)
            self._write_file(text)

    def warn(self, text: str) -> None:
        if self.is_main:
            text = self.clean(text)
            print(f"WARNING: {text}", file=sys.stderr, flush=True)
            self._write_file(f"WARNING: {text}")

    def fatal(self, e: BaseException) -> None:
        """What ends the run, into train.log as the console shows it: the `error:` line of one
        of our errors (errors.report prints it), or an unexpected exception's traceback."""
        import traceback

        from ..errors import error_line
        self.file_only(error_line(e) or "".join(
            traceback.format_exception(type(e), e, e.__traceback__)).rstrip())

    def file_only(self, text: str) -> None:
        if self.is_main:
            self._write_file(self.clean(text))

    def _write_file(self, text: str) -> None:
        if self._file is not None:
            try:
                self._file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
            except OSError as e:   # disk full: the console still has everything
                self._file = None
                print(f"WARNING: cannot write {LOG_NAME} any more ({e.strerror or e}); "
                      "console only from here", file=sys.stderr, flush=True)

    # --- metrics -------------------------------------------------------------------------------
    def log(self, row: dict) -> None:
        """One metrics row (it has `step`): metrics.jsonl, W&B, and the progress line when it
        is a training row."""
        row = self.clean(row)
        self.metrics.write(row)
        if self.tracker is not None:
            self.tracker.log(row)
        if self.progress is not None and "train/loss" in row:
            self.progress.update(row["step"], row)

    def samples(self, step: int, rows: list) -> None:
        rows = self.clean(rows)
        for r in rows:
            self.sample_rows.write(r)
        if self.tracker is not None:
            self.tracker.log_samples(step, rows)

    def preempting(self) -> None:
        """The run stops on a signal, to be resumed (W&B sweeps: preempted, not failed)."""
        if self.tracker is not None:
            self.tracker.preempting()

    def truncate_after(self, step: int) -> "tuple[int, int]":
        """Drop the rows logged after `step` (a resume or a rollback re-runs those steps);
        returns how many metrics and samples rows were dropped. Every rank calls it: a file
        that is not the run's own is a BadInput on all of them."""
        from ..ranks import on_rank0
        return on_rank0(lambda: (self.metrics.truncate_after(step),
                                 self.sample_rows.truncate_after(step)))

    def summary(self, run_dir: str, report: dict) -> None:
        """The end-of-run report: summary.json (replaced atomically) and W&B's run summary."""
        report = self.clean(report)
        if self.is_main:
            path = os.path.join(run_dir, SUMMARY_NAME)
            try:
                atomic_write_json(path, report, indent=1)
            except OSError as e:
                self.warn(f"{SUMMARY_NAME} could not be written ({e})")
        if self.tracker is not None:
            self.tracker.summary(report)

    def finish(self, failed: bool = False) -> None:
        """The run is over: close W&B (marked failed when training raised), then the files."""
        if self.tracker is not None:
            self.tracker.finish(failed=failed)
            self.tracker = None
        self.close()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if self._file is not None:
            self._file.close()
            self._file = None


def parse_row(line: str) -> "dict | None":
    """One line of metrics.jsonl as the row it holds; None for a line that holds none (torn by
    a crash, or damaged)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


class JsonLines:
    """One JSON object per line in a run-directory file (metrics.jsonl, samples.jsonl), written
    by the main process only."""

    def __init__(self, path: str, enabled: bool, warn=None):
        self.path, self.enabled = path, enabled
        self.warn = warn or (lambda msg: None)
        self.lost = 0   # rows that could not be written (disk full): said once, then counted

    def truncate_after(self, step: int) -> int:
        """Drop rows logged after `step`: those steps are re-run and would otherwise appear
        twice. Returns how many rows were dropped."""
        if not self.enabled or not os.path.isfile(self.path):
            return 0
        with open(self.path, encoding="utf-8", errors="replace") as fh:
            lines = fh.readlines()
        keep = []
        for i, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            row = parse_row(line)
            if i == len(lines) and not line.endswith("\n") and row is None:
                continue   # a last line torn by a crash in the middle of its write
            if not isinstance(row, dict) or not isinstance(row.get("step", 0), (int, float)):
                raise BadInput(f"'{self.path}' line {i} is not a row this trainer writes "
                                  f"({line.strip()[:60]!r}); move the file away or choose "
                                  "another output_dir")
            if row.get("step", 0) <= step:
                keep.append(line)
        if len(keep) != len(lines):
            atomic_write(self.path, "".join(keep))
        return len(lines) - len(keep)

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        try:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")
        except OSError as e:
            if not self.lost:
                self.warn(f"cannot write {self.path} ({e.strerror or e}); its rows are lost "
                          "until it can be written again (training goes on)")
            self.lost += 1


class Progress:
    """A tqdm bar on an interactive terminal; plain log lines otherwise (files, CI, SLURM). The
    first line comes after the first step; the ETA is measured from there, in this process, so
    that start-up, compilation and warm-up (and a resume's short first interval) do not count
    as the speed of the steps to come."""

    def __init__(self, log: Logger, total: int, initial: int, mfu_label: str = "",
                 clock=time.time):
        """`clock()`: seconds (time.time), for the ETA."""
        self.log, self.total, self.initial, self.clock = log, total, initial, clock
        self.mfu_label = mfu_label   # under FP8 the MFU is against the bf16 peak: said here
        self.bar = None
        self.t_first = None     # when this process's first step ended
        self.prev = initial     # the step of the last line
        self.counted = 0        # steps trained since the first step (re-runs after a rollback
        #                         are not counted: the ETA is then briefly high, never low)

    def first_step(self, step: int, seconds: float, next_row: "int | None") -> None:
        """The first step of this process is done, in `seconds` (with start-up and warm-up);
        `next_row`: the step of the first row, or None when this step is one."""
        self.t_first, self.prev = self.clock(), step
        if self.log.is_main and sys.stdout.isatty():
            from tqdm.auto import tqdm
            self.bar = tqdm(total=self.total, initial=step, unit="step", dynamic_ncols=True)
        if next_row is None:
            return
        line = (f"step {step:,}/{self.total:,} | first step {seconds:.1f} s (start-up and "
                f"warm-up included) | loss from step {next_row:,}")
        if self.bar is not None:
            self.log.file_only(line)
        else:
            self.log.msg(line)

    def update(self, step: int, row: dict) -> None:
        stats = (f"loss {row['train/loss']:.4f} | lr {row['train/lr']:.2e} | "
                 f"grad {row['train/grad_norm']:.2f} | {row['train/tokens_per_sec']:,.0f} tok/s | "
                 f"{row['train/step_time'] * 1000:.0f} ms/step"
                 + (f" | mfu {row['train/mfu']:.1%}{self.mfu_label}" if "train/mfu" in row
                    else ""))
        self.counted += max(0, step - self.prev)
        self.prev = step
        eta = "?"   # no step timed after the first one yet
        if self.t_first is not None and self.counted:
            eta = hms((self.clock() - self.t_first) / self.counted * (self.total - step))
        line = f"step {step:,}/{self.total:,} | {stats} | ETA {eta}"
        if self.bar is not None:  # the bar shows step, total and ETA itself
            self.bar.n = step
            self.bar.set_postfix_str(stats, refresh=True)
            self.log.file_only(line)
        else:
            self.log.msg(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
