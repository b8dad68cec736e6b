#!/usr/bin/env python3
"""Compare runs side by side: a table of their end-of-run reports and a plot of val loss
against time.

    python scripts/compare_runs.py runs/fineweb_bf16 runs/fineweb_fp8
    python scripts/compare_runs.py runs/a runs/b runs/c --out runs/compare_abc --x tokens

The table (printed, and written to OUT/compare.md; OUT is runs/compare unless --out says
otherwise, and an earlier comparison there is kept unless --overwrite) starts with the config
keys that differ between the runs, then each run's end-of-run report (summary.json, else as far
as its metrics.jsonl goes); each FP8 run is set against its twin without FP8. OUT/val_loss.png
plots val/loss against wall time (--x wall), training time (--x train) or tokens (--x tokens).
What each row means: fp8train/analysis/compare.py. Exit 0: compared; 2: bad input.
"""
import argparse
import sys

from fp8train.errors import run_reported
from fp8train.analysis.compare import DEFAULT_OUT, X_AXES, compare


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dirs", nargs="+", help="run directories (output_dir of each run)")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for compare.md and val_loss.png "
                                                      f"(default {DEFAULT_OUT}); an earlier "
                                                      "comparison there is kept unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the compare.md and val_loss.png already in --out")
    p.add_argument("--x", choices=sorted(X_AXES), default="wall",
                   help="x axis of the plot: wall time, training time or tokens")
    p.add_argument("--no_plot", action="store_true", help="the table only")
    a = p.parse_args(argv)
    return run_reported(lambda: compare(a.run_dirs, a.out, a.x, a.no_plot, a.overwrite))


if __name__ == "__main__":
    from fp8train.observe.console import run_main  # a closed stdout (| head): no traceback
    sys.exit(run_main(main))
