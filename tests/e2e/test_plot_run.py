"""scripts/plot_run.py and scripts/compare_runs.py on real tiny runs (FP8, stopped and resumed;
fp32) and on broken inputs. The figures are checked by what they show (lines, labels, axis
ranges), built by the package's own functions (fp8train.analysis.plot) before they are saved."""


import json
import struct
import subprocess
import sys

import pytest
from support.plot_run_shared import figures, legend_texts
from support.runs import ROOT, run_train, tiny_args

from fp8train.observe.metrics_file import read_rows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


ALWAYS = ("loss.png", "lr.png", "throughput.png", "grad_norm.png")


def plot(*args):
    return subprocess.run([sys.executable, "scripts/plot_run.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def png_height(path) -> int:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and path.stat().st_size > 10_000, path
    return struct.unpack(">II", data[16:24])[1]


def has_gpu_memory(run_dir) -> bool:
    return "system/gpu_memory" in (run_dir / "metrics.jsonl").read_text()


def assert_one_clean_error_line(r, *needles):
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """fp8: stopped after its first step (max_hours), then resumed to the end; fp32: straight."""
    base = tmp_path_factory.mktemp("plot_run")
    fp8 = dict(use_fp8="true", fp8_backend="native", lr_decay_steps=12)
    for args in (tiny_args(base / "fp8", max_hours=1e-7, **fp8),
                 tiny_args(base / "fp8", **fp8) + ["--resume"],
                 tiny_args(base / "fp32")):
        r = run_train(*args)
        assert r.returncode == 0, r.stderr[-3000:]
    return {"fp8": base / "fp8", "fp32": base / "fp32"}


def labelled(ax, label):
    return [line for line in ax.get_lines() if line.get_label() == label]


def test_fp8_run_gets_every_plot_and_per_layer_scales_grow_the_figure(runs, tmp_path):
    run = runs["fp8"]
    r = plot(run, "--out", tmp_path / "agg")
    assert r.returncode == 0, r.stderr
    for name in ALWAYS + ("fp8_scales.png",):
        png_height(tmp_path / "agg" / name)
        assert str(tmp_path / "agg" / name) in r.stdout
    if has_gpu_memory(run):
        png_height(tmp_path / "agg" / "memory.png")
    else:
        assert "memory.png: skipped" in r.stdout and not (tmp_path / "agg" / "memory.png").exists()
    assert "fp8_scales.png: skipped" not in r.stdout and r.stderr == ""

    r = plot(run, "--out", tmp_path / "layers", "--layers", "--logy")
    assert r.returncode == 0, r.stderr
    assert (png_height(tmp_path / "layers" / "fp8_scales.png")
            > png_height(tmp_path / "agg" / "fp8_scales.png"))


def test_non_fp8_run_skips_the_fp8_plot_and_defaults_to_run_dir_plots(runs):
    run = runs["fp32"]
    r = plot(run, "--layers")
    assert r.returncode == 0, r.stderr
    assert "fp8_scales.png: skipped (no fp8/* metrics: not an FP8 run)" in r.stdout
    assert not (run / "plots" / "fp8_scales.png").exists()
    for name in ALWAYS:
        png_height(run / "plots" / name)
    assert str(run / "plots" / "loss.png") in r.stdout


def test_torn_last_line_and_resumed_steps(runs, tmp_path):
    run = tmp_path / "resumed"
    run.mkdir()
    rows = read_rows(runs["fp32"], strict=True)
    train = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "val/loss" in r]
    assert train and evals and train[-1]["step"] == evals[-1]["step"]  # train+eval share a step
    again = dict(train[0], **{"train/loss": 123.0})  # the same step logged again after a resume
    lines = [json.dumps(r) for r in rows + [again]] + ['{"step": 99, "tokens": 10']
    (run / "metrics.jsonl").write_text("\n".join(lines))
    r = plot(run)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    for name in ALWAYS:
        png_height(run / "plots" / name)

    from fp8train.analysis.metrics_reader import load_rows
    loaded = load_rows(str(run / "metrics.jsonl"))
    assert len(loaded) == len(rows) and [r["step"] for r in loaded] == sorted(
        r["step"] for r in loaded)
    first = [r for r in loaded if r["step"] == train[0]["step"] and "train/loss" in r]
    assert [r["train/loss"] for r in first] == [123.0]
    assert sum(r["step"] == evals[-1]["step"] and ("train/loss" in r or "val/loss" in r)
               for r in loaded) == 2


def test_missing_dir_no_metrics_and_empty_file_exit_2(tmp_path):
    assert_one_clean_error_line(plot(tmp_path / "nope"), str(tmp_path / "nope"), "does not exist")
    assert_one_clean_error_line(plot(tmp_path), "no metrics.jsonl", str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text("")
    assert_one_clean_error_line(plot(tmp_path), str(tmp_path / "metrics.jsonl"), "empty")
    assert not (tmp_path / "plots").exists()


def test_missing_matplotlib_exits_2_with_a_hint(runs):
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; "
            f"sys.argv = ['plot_run.py', {str(runs['fp32'])!r}]; "
            "runpy.run_path('scripts/plot_run.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert_one_clean_error_line(r, "plot_run.py needs matplotlib: pip install matplotlib")


def test_lr_plot_shows_the_whole_schedule_from_step_0_and_marks_the_resume(runs):
    from fp8train.optim.schedule import lr_at
    mod, plots = figures(runs["fp8"])
    assert plots.resumes == [1]           # train.log: "resumed from ... at step 1"
    ax = mod.Plots.lr(plots).axes[0]
    (sched,) = labelled(ax, mod.SCHEDULE_LABEL)
    xs, ys = list(sched.get_xdata()), list(sched.get_ydata())
    assert xs == list(range(13)) and ax.get_xlim()[0] == 0
    kw = dict(max_lr=0.003, warmup_steps=3, total_steps=12, min_lr_ratio=0.1)
    assert ys[0] == 0 and ys[1:] == pytest.approx([lr_at(s, **kw) for s in range(12)])
    (logged,) = labelled(ax, "train/lr (logged)")
    assert min(logged.get_xdata()) == 4   # the first logged step: the warmup is not in the log
    for x, y in zip(logged.get_xdata(), logged.get_ydata(), strict=True):
        assert y == pytest.approx(ys[xs.index(x)])   # each logged LR lies on the schedule
    (resume,) = labelled(ax, mod.RESUMED_LABEL)
    assert list(resume.get_xdata()) == [1, 1]
    for fig in (plots.simple("loss.png", "loss", ["train/loss"], ""), plots.throughput(),
                plots.fp8_scales(False)):
        assert all(labelled(a, mod.RESUMED_LABEL) for a in fig.axes if a.get_legend())

    r = plot(runs["fp8"], "--out", runs["fp8"] / "p")
    assert r.returncode == 0 and "resumed at step 1 (dashed lines)" in r.stdout, r.stderr
    _, straight = figures(runs["fp32"])
    assert straight.resumes == [] and not labelled(straight.lr().axes[0], mod.RESUMED_LABEL)


def test_per_layer_fp8_scales_are_named_in_a_legend(runs):
    mod, plots = figures(runs["fp8"])
    fig = plots.fp8_scales(True)
    layer_axes = [a for a in fig.axes if a.get_title().startswith("per layer: ")]
    assert sorted(a.get_title() for a in layer_axes) == [
        "per layer: bwd_scale_grad_output", "per layer: fwd_scale_input",
        "per layer: fwd_scale_weight"]
    names = [f"blocks.{i}.{m}" for i in range(2)
             for m in ("attn.proj", "attn.qkv", "mlp.fc", "mlp.proj")]
    for ax in layer_axes:
        assert legend_texts(ax) == names + [mod.RESUMED_LABEL]
        assert ax.get_legend().get_bbox_to_anchor().x0 > ax.bbox.x1 - 1   # beside the axes


def test_lr_without_config_yaml_says_so_and_keeps_the_logged_points(runs, tmp_path):
    run = tmp_path / "noconfig"
    run.mkdir()
    (run / "metrics.jsonl").write_text((runs["fp32"] / "metrics.jsonl").read_text())
    r = plot(run)
    assert r.returncode == 0, r.stderr
    assert "lr.png: the logged train/lr only (no readable config.yaml" in r.stdout
    png_height(run / "plots" / "lr.png")


def compare(*args):
    return subprocess.run([sys.executable, "scripts/compare_runs.py", *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_compare_shows_the_config_keys_that_differ(runs, tmp_path):
    r = compare(runs["fp8"], runs["fp32"], "--out", tmp_path / "c", "--no_plot")
    assert r.returncode == 0, r.stderr
    rows = {line.split(" | ")[0].lstrip("| "): line for line in r.stdout.splitlines()}
    assert rows["config: use_fp8"] == "| config: use_fp8 | true | false |"
    assert "config: lr_decay_steps" in rows and "config: seq_len" not in rows
    assert not any(k.startswith("config: output_dir") or k.startswith("config: resume")
                   for k in rows)
    assert rows["config: use_fp8"] in (tmp_path / "c" / "compare.md").read_text()

    # Two sweep trials: the same run but for the swept parameter.
    for name, weight in (("trial_001", 0.0), ("trial_002", 0.01)):
        d = tmp_path / "sweep" / name
        d.mkdir(parents=True)
        for f in ("metrics.jsonl", "summary.json"):
            (d / f).write_text((runs["fp32"] / f).read_text())
        (d / "config.yaml").write_text((runs["fp32"] / "config.yaml").read_text().replace(
            "penalty_weight: 0.0", f"penalty_weight: {weight}").replace(
            f"output_dir: {runs['fp32']}", f"output_dir: {d}"))
    r = compare(tmp_path / "sweep" / "trial_001", tmp_path / "sweep" / "trial_002",
                "--no_plot", "--out", tmp_path / "c2")
    assert r.returncode == 0, r.stderr
    config_rows = [line for line in r.stdout.splitlines() if line.startswith("| config: ")]
    assert config_rows == ["| config: penalty_weight | 0.0 | 0.01 |"]
