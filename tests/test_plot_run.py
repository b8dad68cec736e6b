"""scripts/plot_run.py on real tiny runs (FP8 and fp32) and on broken inputs."""
import importlib.util
import json
import struct
import subprocess
import sys

import pytest

from conftest import ROOT, run_train, tiny_args

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
    base = tmp_path_factory.mktemp("plot_run")
    out = {}
    for name, fp8 in (("fp8", dict(use_fp8="true", fp8_backend="native")), ("fp32", {})):
        r = run_train(*tiny_args(base / name, **fp8))
        assert r.returncode == 0, r.stderr[-3000:]
        out[name] = base / name
    return out


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
    rows = [json.loads(line) for line in
            (runs["fp32"] / "metrics.jsonl").read_text().splitlines()]
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

    spec = importlib.util.spec_from_file_location("plot_run", ROOT / "scripts" / "plot_run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    loaded = mod.load_rows(str(run / "metrics.jsonl"))
    assert len(loaded) == len(rows) and [r["step"] for r in loaded] == sorted(
        r["step"] for r in loaded)
    first = [r for r in loaded if r["step"] == train[0]["step"] and "train/loss" in r]
    assert [r["train/loss"] for r in first] == [123.0]
    assert sum(r["step"] == evals[-1]["step"] for r in loaded) == 2


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
