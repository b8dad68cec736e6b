#!/usr/bin/env python3
"""Plot a run's metrics.jsonl as PNG curves (loss, lr, throughput, FP8 scales, ...), no W&B needed.

    python scripts/plot_run.py runs/demo              # writes runs/demo/plots/*.png
    python scripts/plot_run.py runs/demo --layers --out /tmp/demo_plots
"""
import argparse
import os
import re
import sys

from fp8train.errors import EXIT_OK, ConfigError, run_reported
from fp8train.metrics_reader import load_rows

LAYER_SCALE = re.compile(r"^fp8/(.+)/((?:fwd|bwd)_scale_\w+)$")


def series(rows: list, key: str):
    pts = [(r["step"], r[key]) for r in rows
           if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [p[0] for p in pts], [p[1] for p in pts]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="run directory holding metrics.jsonl")
    p.add_argument("--out", help="folder for the PNGs (default: RUN_DIR/plots)")
    p.add_argument("--layers", action="store_true", help="add per-layer FP8 scales")
    p.add_argument("--logy", action="store_true", help="log scale on the loss axis")
    a = p.parse_args(argv)
    return run_reported(lambda: plot_run(a))


def read_metrics(run_dir: str) -> list:
    """The run's metrics rows; ConfigError when there are none to plot."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isdir(run_dir):
        raise ConfigError(f"run directory '{run_dir}' does not exist")
    if not os.path.isfile(path):
        raise ConfigError(f"no metrics.jsonl in '{run_dir}' (expected '{path}')")
    try:
        rows = load_rows(path)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read '{path}': {getattr(e, 'strerror', None) or e}") from None
    if not rows:
        raise ConfigError(f"'{path}' is empty (no metrics rows with a step)")
    return rows


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plot_run.py needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"axes.grid": True, "grid.alpha": 0.3})
    return plt


def _out_dir(a) -> str:
    out = a.out or os.path.join(a.run_dir, "plots")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create '{out}': {e.strerror or e}") from None
    if not os.access(out, os.W_OK):
        raise ConfigError(f"cannot write to '{out}'")
    return out


class Plots:
    """The figures of one run, each saved as OUT/<name>.png and announced on stdout."""

    def __init__(self, plt, rows: list, out: str, run_name: str):
        self.plt, self.rows, self.out, self.run_name = plt, rows, out, run_name
        self.keys = {k for r in rows for k in r}

    def save(self, fig, fname: str) -> None:
        fig.supxlabel("optimizer step", fontsize="medium")
        fig.suptitle(f"{self.run_name}: {fname[:-4].replace('_', ' ')}")
        fig.tight_layout()
        dest = os.path.join(self.out, fname)
        fig.savefig(dest, dpi=100)
        self.plt.close(fig)
        print(f"wrote {dest}")

    def simple(self, fname: str, ylabel: str, plot_keys, why: str, logy=False) -> None:
        present = [k for k in plot_keys if k in self.keys]
        if not present:
            print(f"{fname}: skipped ({why})")
            return
        fig, ax = self.plt.subplots(figsize=(9, 4.5))
        for k in present:
            ax.plot(*series(self.rows, k), marker="o" if k.startswith("val/") else None,
                    markersize=3, label=k)
        if logy:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.legend()
        self.save(fig, fname)

    def throughput(self) -> None:
        if "train/tokens_per_sec" not in self.keys:
            print("throughput.png: skipped (no train/tokens_per_sec)")
            return
        fig, ax = self.plt.subplots(figsize=(9, 4.5))
        ax.plot(*series(self.rows, "train/tokens_per_sec"), label="tokens/s")
        ax.set_ylabel("tokens/s (all devices)")
        if "train/mfu" in self.keys:
            steps, mfu = series(self.rows, "train/mfu")
            ax2 = ax.twinx()
            ax2.grid(False)
            ax2.plot(steps, [100 * m for m in mfu], color="C1", label="MFU")
            ax2.set_ylabel("MFU (%)")
            ax.legend(handles=ax.get_lines() + ax2.get_lines())
        self.save(fig, "throughput.png")

    def fp8_scales(self, layers: bool) -> None:
        keys = self.keys
        agg = [k for k in ("fp8/fwd_scale", "fp8/bwd_scale", "fp8/amax") if k in keys]
        frac = [k for k in ("fp8/saturated", "fp8/underflow") if k in keys]
        layer = sorted(k for k in keys if LAYER_SCALE.match(k)) if layers else []
        if not any(k.startswith("fp8/") for k in keys):
            print("fp8_scales.png: skipped (no fp8/* metrics: not an FP8 run)")
            return
        if not agg + frac + layer:
            print("fp8_scales.png: skipped (no fp8 scale, amax or saturation metrics)")
            return
        if layers and not layer:
            print("fp8_scales.png: no per-layer fp8/<layer>/*_scale_* metrics logged")
        panels = [x for x in (agg, frac, layer) if x]
        fig, axes = self.plt.subplots(len(panels), 1, figsize=(9, 3.5 * len(panels)),
                                      sharex=True, squeeze=False)
        for ax, keys_ in zip(axes[:, 0], panels):
            if keys_ is layer:
                self._layer_panel(ax, layer)
            else:
                for k in keys_:
                    ax.plot(*series(self.rows, k), label=k)
                if keys_ is frac:
                    ax.set_yscale("symlog", linthresh=1e-6)
                    ax.set_ylim(bottom=0)
                    ax.set_ylabel("fraction of elements")
                else:
                    ax.set_yscale("log")
                    ax.set_ylabel("scale / amax")
            ax.legend(fontsize="small")
        self.save(fig, "fp8_scales.png")

    def _layer_panel(self, ax, layer: list) -> None:
        """One thin line per layer, coloured by tensor role."""
        roles = sorted({LAYER_SCALE.match(k).group(2) for k in layer})
        for k in layer:
            i = roles.index(LAYER_SCALE.match(k).group(2))
            ax.plot(*series(self.rows, k), color=f"C{i}", lw=0.8, alpha=0.6)
        for i, role in enumerate(roles):
            ax.plot([], [], color=f"C{i}", label=f"per layer: {role}")
        ax.set_yscale("log")
        ax.set_ylabel("per-layer scale")


def plot_run(a) -> int:
    """Every plot of the run a.run_dir; ConfigError for bad input."""
    rows = read_metrics(a.run_dir)
    plt = _pyplot()
    plots = Plots(plt, rows, _out_dir(a), os.path.basename(os.path.abspath(a.run_dir)))
    loss_keys = ["train/loss", "val/loss"]
    if any(v != 0 for v in series(rows, "train/penalty")[1]):
        loss_keys.append("train/penalty")
    plots.simple("loss.png", "loss (nats/token)", loss_keys, "no train/loss or val/loss", a.logy)
    plots.simple("lr.png", "learning rate", ["train/lr"], "no train/lr")
    plots.throughput()
    plots.fp8_scales(a.layers)
    plots.simple("grad_norm.png", "gradient norm (before clipping)", ["train/grad_norm"],
                 "no train/grad_norm")
    plots.simple("memory.png", "GPU memory (GB)",
                 sorted(k for k in plots.keys if k.startswith("system/gpu_memory_")),
                 "no system/gpu_memory_* metrics: not a CUDA run")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
