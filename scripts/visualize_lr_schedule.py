#!/usr/bin/env python3
"""Plot the learning-rate schedule train_fp8.py will use, and print a few sampled values.

    python scripts/visualize_lr_schedule.py --warmup_steps 2000 --total_steps 20000 --max_lr 0.003
"""
import argparse
import sys

from fp8train.errors import EXIT_OK, BadInput, run_reported
from fp8train.train.schedule import lr_at


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup_steps", type=int, required=True)
    p.add_argument("--total_steps", type=int, required=True)
    p.add_argument("--max_lr", type=float, required=True)
    p.add_argument("--min_lr_ratio", type=float, default=0.1)
    p.add_argument("--output", default="lr_schedule.png", help="PNG file to write")
    a = p.parse_args(argv)
    if a.total_steps < 1 or a.max_lr <= 0 or not 0 <= a.min_lr_ratio <= 1:
        p.error("need total_steps >= 1, max_lr > 0 and 0 <= min_lr_ratio <= 1")
    if not 0 <= a.warmup_steps < a.total_steps:
        p.error(f"warmup_steps ({a.warmup_steps}) must be in [0, total_steps) "
                f"= [0, {a.total_steps})")
    return run_reported(lambda: plot_schedule(a))


def plot_schedule(a) -> int:
    """Print sampled values, then write the PNG; BadInput when it cannot be written."""
    kw = dict(max_lr=a.max_lr, warmup_steps=a.warmup_steps, total_steps=a.total_steps,
              min_lr_ratio=a.min_lr_ratio)
    steps = list(range(a.total_steps))
    lrs = [lr_at(s, **kw) for s in steps]

    samples = sorted({0, a.warmup_steps // 2, max(a.warmup_steps - 1, 0),
                      (a.warmup_steps + a.total_steps - 1) // 2, a.total_steps - 1})
    print(f"{'step':>10}  lr")
    for s in samples:
        print(f"{s:>10}  {lrs[s]:.6g}")

    try:
        import matplotlib
    except ImportError:
        raise BadInput("the plot needs matplotlib: pip install matplotlib "
                          "(or -e '.[dev]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, lrs)
    ax.axvline(a.warmup_steps, color="gray", linestyle=":", label="end of warmup")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.set_title(f"warmup {a.warmup_steps}, cosine to {a.min_lr_ratio:g} × {a.max_lr:g} "
                 f"at step {a.total_steps - 1}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(a.output, dpi=100)
    except OSError as e:
        raise BadInput(f"cannot write '{a.output}': {e.strerror or e}") from None
    print(f"wrote {a.output}")
    return EXIT_OK


if __name__ == "__main__":
    from fp8train.observe.console import run_main  # a closed stdout (| head): no traceback
    sys.exit(run_main(main))
