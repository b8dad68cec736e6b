#!/usr/bin/env python3
"""Plot the learning-rate schedule train_fp8.py will use, and print a few sampled values.

    python scripts/visualize_lr_schedule.py --warmup_steps 2000 --total_steps 20000 --max_lr 0.003
    python scripts/visualize_lr_schedule.py --warmup_steps 200 --total_steps 5000 --max_lr 0.003 \
        --schedule wsd --decay_fraction 0.2 --decay_shape 1-sqrt
"""
import argparse
import sys

from fp8train.errors import run_reported
from fp8train.analysis.plot import lr_schedule_plot
from fp8train.optim.schedule import DECAY_SHAPES, SCHEDULES


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup_steps", type=int, required=True)
    p.add_argument("--total_steps", type=int, required=True)
    p.add_argument("--max_lr", type=float, required=True)
    p.add_argument("--min_lr_ratio", type=float, default=0.1)
    p.add_argument("--schedule", choices=SCHEDULES, default="cosine",
                   help="the run's lr_schedule (default cosine)")
    p.add_argument("--decay_fraction", type=float, default=0.2,
                   help="wsd: the run's lr_decay_fraction (default 0.2)")
    p.add_argument("--decay_shape", choices=DECAY_SHAPES, default="linear",
                   help="wsd: the run's lr_decay_shape (default linear)")
    p.add_argument("--output", default="lr_schedule.png", help="PNG file to write")
    a = p.parse_args(argv)
    if a.total_steps < 1 or a.max_lr <= 0 or not 0 <= a.min_lr_ratio <= 1:
        p.error("need total_steps >= 1, max_lr > 0 and 0 <= min_lr_ratio <= 1")
    if not 0 < a.decay_fraction <= 1:
        p.error(f"decay_fraction ({a.decay_fraction:g}) must be in (0, 1]")
    if not 0 <= a.warmup_steps < a.total_steps:
        p.error(f"warmup_steps ({a.warmup_steps}) must be in [0, total_steps) "
                f"= [0, {a.total_steps})")
    return run_reported(lambda: lr_schedule_plot(
        a.warmup_steps, a.total_steps, a.max_lr, a.min_lr_ratio, a.output, a.schedule,
        a.decay_fraction, a.decay_shape))


if __name__ == "__main__":
    from fp8train.observe.console import run_main  # a closed stdout (| head): no traceback
    sys.exit(run_main(main))
