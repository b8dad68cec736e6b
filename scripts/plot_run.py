#!/usr/bin/env python3
"""Plot a run's metrics.jsonl as PNG curves (loss, lr, throughput, FP8 scales, ...), no W&B needed.

    python scripts/plot_run.py runs/demo              # writes runs/demo/plots/*.png
    python scripts/plot_run.py runs/demo --layers --out /tmp/demo_plots

The figures themselves: fp8train/analysis/plot.py. Exit 0: plotted; 2: bad input.
"""
import argparse
import sys

from fp8train.errors import run_reported
from fp8train.analysis.plot import plot_run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="run directory holding metrics.jsonl")
    p.add_argument("--out", help="folder for the PNGs (default: RUN_DIR/plots)")
    p.add_argument("--layers", action="store_true", help="add per-layer FP8 scales")
    p.add_argument("--logy", action="store_true", help="log scale on the loss axis")
    a = p.parse_args(argv)
    return run_reported(lambda: plot_run(a.run_dir, a.out, a.layers, a.logy))


if __name__ == "__main__":
    from fp8train.observe.console import run_main  # a closed stdout (| head): no traceback
    sys.exit(run_main(main))
