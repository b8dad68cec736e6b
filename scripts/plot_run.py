#!/usr/bin/env python3
"""Plot a run's metrics.jsonl as PNG curves (loss, lr, throughput, FP8 scales, ...), no W&B needed.

    python scripts/plot_run.py runs/demo              # writes runs/demo/plots/*.png
    python scripts/plot_run.py runs/demo --layers --out /tmp/demo_plots
"""
import argparse
import json
import os
import re
import sys

LAYER_SCALE = re.compile(r"^fp8/(.+)/((?:fwd|bwd)_scale_\w+)$")


def load_rows(path: str) -> list:
    """The rows of metrics.jsonl sorted by step. Unreadable lines (a torn last line from a
    crash) are skipped; a step logged twice (a resumed run) keeps its last train row and its
    last eval row."""
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
        print(f"warning: skipped {bad} unreadable line(s) in {path}", file=sys.stderr)
    return sorted(rows.values(), key=lambda r: r["step"])


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

    path = os.path.join(a.run_dir, "metrics.jsonl")
    if not os.path.isdir(a.run_dir):
        return _fail(f"run directory '{a.run_dir}' does not exist")
    if not os.path.isfile(path):
        return _fail(f"no metrics.jsonl in '{a.run_dir}' (expected '{path}')")
    try:
        rows = load_rows(path)
    except (OSError, UnicodeDecodeError) as e:
        return _fail(f"cannot read '{path}': {getattr(e, 'strerror', None) or e}")
    if not rows:
        return _fail(f"'{path}' is empty (no metrics rows with a step)")
    keys = {k for r in rows for k in r}

    try:
        import matplotlib
    except ImportError:
        return _fail("plot_run.py needs matplotlib: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"axes.grid": True, "grid.alpha": 0.3})

    out = a.out or os.path.join(a.run_dir, "plots")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        return _fail(f"cannot create '{out}': {e.strerror or e}")
    if not os.access(out, os.W_OK):
        return _fail(f"cannot write to '{out}'")
    name = os.path.basename(os.path.abspath(a.run_dir))

    def save(fig, fname: str) -> None:
        fig.supxlabel("optimizer step", fontsize="medium")
        fig.suptitle(f"{name}: {fname[:-4].replace('_', ' ')}")
        fig.tight_layout()
        dest = os.path.join(out, fname)
        fig.savefig(dest, dpi=100)
        plt.close(fig)
        print(f"wrote {dest}")

    def simple(fname: str, ylabel: str, plot_keys, why: str, logy=False) -> None:
        present = [k for k in plot_keys if k in keys]
        if not present:
            print(f"{fname}: skipped ({why})")
            return
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for k in present:
            ax.plot(*series(rows, k), marker="o" if k.startswith("val/") else None,
                    markersize=3, label=k)
        if logy:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.legend()
        save(fig, fname)

    loss_keys = ["train/loss", "val/loss"]
    if any(v != 0 for v in series(rows, "train/penalty")[1]):
        loss_keys.append("train/penalty")
    simple("loss.png", "loss (nats/token)", loss_keys, "no train/loss or val/loss", a.logy)
    simple("lr.png", "learning rate", ["train/lr"], "no train/lr")

    if "train/tokens_per_sec" not in keys:
        print("throughput.png: skipped (no train/tokens_per_sec)")
    else:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        ax.plot(*series(rows, "train/tokens_per_sec"), label="tokens/s")
        ax.set_ylabel("tokens/s (all devices)")
        if "train/mfu" in keys:
            steps, mfu = series(rows, "train/mfu")
            ax2 = ax.twinx()
            ax2.grid(False)
            ax2.plot(steps, [100 * m for m in mfu], color="C1", label="MFU")
            ax2.set_ylabel("MFU (%)")
            ax.legend(handles=ax.get_lines() + ax2.get_lines())
        save(fig, "throughput.png")

    agg = [k for k in ("fp8/fwd_scale", "fp8/bwd_scale", "fp8/amax") if k in keys]
    frac = [k for k in ("fp8/saturated", "fp8/underflow") if k in keys]
    layer = sorted(k for k in keys if LAYER_SCALE.match(k)) if a.layers else []
    if not any(k.startswith("fp8/") for k in keys):
        print("fp8_scales.png: skipped (no fp8/* metrics: not an FP8 run)")
    elif not agg + frac + layer:
        print("fp8_scales.png: skipped (no fp8 scale, amax or saturation metrics)")
    else:
        if a.layers and not layer:
            print("fp8_scales.png: no per-layer fp8/<layer>/*_scale_* metrics logged")
        panels = [x for x in (agg, frac, layer) if x]
        fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.5 * len(panels)),
                                 sharex=True, squeeze=False)
        for ax, keys_ in zip(axes[:, 0], panels):
            if keys_ is layer:  # one thin line per layer, coloured by tensor role
                roles = sorted({LAYER_SCALE.match(k).group(2) for k in layer})
                for k in layer:
                    i = roles.index(LAYER_SCALE.match(k).group(2))
                    ax.plot(*series(rows, k), color=f"C{i}", lw=0.8, alpha=0.6)
                for i, role in enumerate(roles):
                    ax.plot([], [], color=f"C{i}", label=f"per layer: {role}")
                ax.set_yscale("log")
                ax.set_ylabel("per-layer scale")
            else:
                for k in keys_:
                    ax.plot(*series(rows, k), label=k)
                if keys_ is frac:
                    ax.set_yscale("symlog", linthresh=1e-6)
                    ax.set_ylim(bottom=0)
                    ax.set_ylabel("fraction of elements")
                else:
                    ax.set_yscale("log")
                    ax.set_ylabel("scale / amax")
            ax.legend(fontsize="small")
        save(fig, "fp8_scales.png")

    simple("grad_norm.png", "gradient norm (before clipping)", ["train/grad_norm"],
           "no train/grad_norm")
    simple("memory.png", "GPU memory (GB)",
           sorted(k for k in keys if k.startswith("system/gpu_memory_")),
           "no system/gpu_memory_* metrics: not a CUDA run")
    return 0


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
