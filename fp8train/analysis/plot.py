"""A run's curves as PNGs from its metrics.jsonl, no W&B needed (scripts/plot_run.py), the LR
schedule as the trainer computes it (scripts/visualize_lr_schedule.py), and `pyplot`, the one
way every plot here gets matplotlib: imported when a figure is drawn, never at import time, so
that the commands' --help and their bad-input errors stay instant.
"""
from __future__ import annotations

import os
import re

from ..errors import EXIT_OK, BadInput
from ..optim.schedule import describe, lr_at, wsd_decay_steps
from .metrics_reader import load_rows, lr_schedule, read_run_config, resume_steps

LAYER_SCALE = re.compile(r"^fp8/(.+)/((?:fwd|bwd)_scale_\w+)$")
MAX_NAMED_LAYERS = 12       # more per-layer lines than this: the extremes are named
RESUMED_LABEL = "resumed"
SCHEDULE_LABEL = "schedule (config.yaml)"


def series(rows: list, key: str):
    pts = [(r["step"], r[key]) for r in rows
           if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [p[0] for p in pts], [p[1] for p in pts]


def pyplot(missing: str):
    """matplotlib.pyplot on the Agg backend (files only, no display); BadInput(`missing`), the
    command's own hint, when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise BadInput(missing) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def read_metrics(run_dir: str) -> list:
    """The run's metrics rows; BadInput when there are none to plot."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(run_dir):
        raise BadInput(f"run directory '{run_dir}' does not exist")
    if not os.path.isdir(run_dir):
        raise BadInput(f"'{run_dir}' is a file, not a run directory")
    if not os.path.isfile(path):
        raise BadInput(f"no metrics.jsonl in '{run_dir}' (expected '{path}')")
    try:
        rows = load_rows(path)
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read '{path}': {getattr(e, 'strerror', None) or e}") from None
    if not rows:
        raise BadInput(f"'{path}' is empty (no metrics rows with a step)")
    return rows


def _out_dir(out: str) -> str:
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise BadInput(f"cannot create '{out}': {e.strerror or e}") from None
    if not os.access(out, os.W_OK):
        raise BadInput(f"cannot write to '{out}'")
    return out


class Plots:
    """The figures of one run. Each method returns its figure (None, with the reason printed,
    when the run logged nothing for it); `save` writes it as OUT/<name>.png."""

    def __init__(self, plt, rows: list, run_name: str, resumes=(), schedule=None):
        """`resumes`: the steps where the run was resumed (a vertical line on every plot);
        `schedule`: (steps, lrs) of the whole LR schedule, or None."""
        self.plt, self.rows, self.run_name = plt, rows, run_name
        self.resumes, self.schedule = list(resumes), schedule
        self.keys = {k for r in rows for k in r}

    def save(self, fig, out: str, fname: str) -> None:
        fig.supxlabel("optimizer step", fontsize="medium")
        fig.suptitle(f"{self.run_name}: {fname[:-4].replace('_', ' ')}")
        fig.tight_layout()
        dest = os.path.join(out, fname)
        fig.savefig(dest, dpi=100, bbox_inches="tight")   # legends outside the axes included
        self.plt.close(fig)
        print(f"wrote {dest}")

    def mark_resumes(self, ax) -> None:
        for i, step in enumerate(self.resumes):
            ax.axvline(step, color="crimson", linestyle="--", linewidth=1,
                       label=RESUMED_LABEL if i == 0 else None)

    def simple(self, fname: str, ylabel: str, plot_keys, why: str, logy=False):
        present = [k for k in plot_keys if k in self.keys]
        if not present:
            print(f"{fname}: skipped ({why})")
            return None
        fig, ax = self.plt.subplots(figsize=(9, 4.5))
        for k in present:
            ax.plot(*series(self.rows, k), marker="o" if k.startswith("val/") else None,
                    markersize=3, label=k)
        if logy:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        self.mark_resumes(ax)
        ax.legend()
        return fig

    def lr(self):
        """The whole schedule from step 0 (warmup included, computed from config.yaml as the
        trainer computes it) with the logged train/lr on it."""
        logged = series(self.rows, "train/lr")
        if self.schedule is None and not logged[0]:
            print("lr.png: skipped (no train/lr, and no config.yaml to compute the schedule)")
            return None
        fig, ax = self.plt.subplots(figsize=(9, 4.5))
        if self.schedule is not None:
            ax.plot(*self.schedule, color="C0", label=SCHEDULE_LABEL)
        else:
            print("lr.png: the logged train/lr only (no readable config.yaml with the "
                  "schedule)")
        if logged[0]:
            ax.plot(*logged, linestyle="none", marker="o", markersize=3, color="C1",
                    label="train/lr (logged)")
        self.mark_resumes(ax)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("learning rate")
        ax.legend()
        return fig

    def throughput(self):
        if "train/tokens_per_sec" not in self.keys:
            print("throughput.png: skipped (no train/tokens_per_sec)")
            return None
        fig, ax = self.plt.subplots(figsize=(9, 4.5))
        ax.plot(*series(self.rows, "train/tokens_per_sec"), label="tokens/s")
        ax.set_ylabel("tokens/s (all devices)")
        self.mark_resumes(ax)
        handles = ax.get_lines()
        if "train/mfu" in self.keys:
            steps, mfu = series(self.rows, "train/mfu")
            ax2 = ax.twinx()
            ax2.grid(False)
            ax2.plot(steps, [100 * m for m in mfu], color="C1", label="MFU")
            ax2.set_ylabel("MFU (%)")
            handles = handles + ax2.get_lines()
        ax.legend(handles=handles)
        return fig

    def fp8_scales(self, layers: bool):
        keys = self.keys
        agg = [k for k in ("fp8/fwd_scale", "fp8/bwd_scale", "fp8/amax") if k in keys]
        frac = [k for k in ("fp8/saturated", "fp8/underflow") if k in keys]
        layer = sorted(k for k in keys if LAYER_SCALE.match(k)) if layers else []
        if not any(k.startswith("fp8/") for k in keys):
            print("fp8_scales.png: skipped (no fp8/* metrics: not an FP8 run)")
            return None
        if not agg + frac + layer:
            print("fp8_scales.png: skipped (no fp8 scale, amax or saturation metrics)")
            return None
        if layers and not layer:
            print("fp8_scales.png: no per-layer fp8/<layer>/*_scale_* metrics logged")
        roles = sorted({LAYER_SCALE.match(k).group(2) for k in layer})
        panels = [x for x in (agg, frac) if x] + roles
        fig, axes = self.plt.subplots(len(panels), 1, figsize=(9, 3.5 * len(panels)),
                                      sharex=True, squeeze=False)
        for ax, panel in zip(axes[:, 0], panels):
            if isinstance(panel, str):
                self._layer_panel(ax, panel, [k for k in layer
                                              if LAYER_SCALE.match(k).group(2) == panel])
                continue
            for k in panel:
                ax.plot(*series(self.rows, k), label=k)
            if panel is frac:
                ax.set_yscale("symlog", linthresh=1e-6)
                ax.set_ylim(bottom=0)
                ax.set_ylabel("fraction of elements")
            else:
                ax.set_yscale("log")
                ax.set_ylabel("scale / amax")
            self.mark_resumes(ax)
            ax.legend(fontsize="small")
        return fig

    def _layer_panel(self, ax, role: str, keys: list) -> None:
        """One line per layer for one tensor role, named in a legend beside the axes. With
        more layers than a legend can name readably, the ones that end highest and lowest
        are named and the rest drawn in grey."""
        last = {k: series(self.rows, k)[1][-1] for k in keys if series(self.rows, k)[1]}
        named = set(keys)
        if len(keys) > MAX_NAMED_LAYERS:
            ranked = sorted(last, key=last.get)
            half = MAX_NAMED_LAYERS // 2
            named = set(ranked[:half] + ranked[-half:])
        colour = iter(self.plt.get_cmap("tab20").colors)
        for k in keys:
            if k in named:
                ax.plot(*series(self.rows, k), lw=1, color=next(colour),
                        label=LAYER_SCALE.match(k).group(1))
            else:
                ax.plot(*series(self.rows, k), lw=0.6, color="0.6", alpha=0.6)
        if len(named) < len(keys):
            ax.plot([], [], lw=0.6, color="0.6",
                    label=f"{len(keys) - len(named)} other layers")
        self.mark_resumes(ax)
        ax.set_yscale("log")
        ax.set_ylabel(role)
        ax.set_title(f"per layer: {role}", fontsize="medium")
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  borderaxespad=0)


def plot_run(run_dir: str, out: "str | None" = None, layers: bool = False,
             logy: bool = False) -> int:
    """Every plot of the run in `run_dir`, written to `out` (default RUN_DIR/plots); `layers`:
    per-layer FP8 scales too, `logy`: a log scale on the loss axis. BadInput for bad input."""
    rows = read_metrics(run_dir)
    plt = pyplot("plot_run.py needs matplotlib: pip install matplotlib")
    plt.rcParams.update({"axes.grid": True, "grid.alpha": 0.3})
    out = _out_dir(out or os.path.join(run_dir, "plots"))
    plots = Plots(plt, rows, os.path.basename(os.path.abspath(run_dir)),
                  resumes=resume_steps(run_dir),
                  schedule=lr_schedule(read_run_config(run_dir)))
    loss_keys = ["train/loss", "val/loss"]
    if any(v != 0 for v in series(rows, "train/penalty")[1]):
        loss_keys.append("train/penalty")
    figures = [
        ("loss.png", plots.simple("loss.png", "loss (nats/token)", loss_keys,
                                  "no train/loss or val/loss", logy)),
        ("lr.png", plots.lr()),
        ("throughput.png", plots.throughput()),
        ("fp8_scales.png", plots.fp8_scales(layers)),
        ("grad_norm.png", plots.simple("grad_norm.png", "gradient norm (before clipping)",
                                       ["train/grad_norm"], "no train/grad_norm")),
        ("memory.png", plots.simple(
            "memory.png", "GPU memory (GB)",
            sorted(k for k in plots.keys if k.startswith("system/gpu_memory_")),
            "no system/gpu_memory_* metrics: not a CUDA run")),
    ]
    for fname, fig in figures:
        if fig is not None:
            plots.save(fig, out, fname)
    if plots.resumes:
        print(f"resumed at step {', '.join(f'{s:,}' for s in plots.resumes)} (dashed lines)")
    return EXIT_OK


# --- the LR schedule -------------------------------------------------------------------------

def lr_schedule_plot(warmup_steps: int, total_steps: int, max_lr: float, min_lr_ratio: float,
                     output: str, schedule: str = "cosine", decay_fraction: float = 0.2,
                     decay_shape: str = "linear") -> int:
    """The trainer's LR schedule (scripts/visualize_lr_schedule.py): a few sampled values
    printed, then the curve written to the PNG `output`; BadInput when it cannot be written."""
    kw = dict(max_lr=max_lr, warmup_steps=warmup_steps, total_steps=total_steps,
              min_lr_ratio=min_lr_ratio, schedule=schedule, decay_fraction=decay_fraction,
              decay_shape=decay_shape)
    steps = list(range(total_steps))
    lrs = [lr_at(s, **kw) for s in steps]

    samples = {0, warmup_steps // 2, max(warmup_steps - 1, 0),
               (warmup_steps + total_steps - 1) // 2, total_steps - 1}
    if schedule == "wsd":   # the last step at the peak and the decay's middle
        start = total_steps - wsd_decay_steps(warmup_steps, total_steps, decay_fraction)
        samples |= {max(start - 1, 0), (start + total_steps - 1) // 2}
    samples = sorted(samples)
    print(f"{'step':>10}  lr")
    for s in samples:
        print(f"{s:>10}  {lrs[s]:.6g}")

    plt = pyplot("the plot needs matplotlib: pip install matplotlib (pip install -e . installs it)")
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, lrs)
    ax.axvline(warmup_steps, color="gray", linestyle=":", label="end of warmup")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.set_title(f"warmup {warmup_steps}, "
                 f"{describe(schedule, min_lr_ratio, max_lr, decay_fraction, decay_shape)} "
                 f"at step {total_steps - 1}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(output, dpi=100)
    except OSError as e:
        raise BadInput(f"cannot write '{output}': {e.strerror or e}") from None
    print(f"wrote {output}")
    return EXIT_OK
