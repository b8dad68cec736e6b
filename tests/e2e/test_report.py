"""Time-to-target and the end-of-run report (summary.json), on real runs of train_fp8.py."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from support.runs import ROOT, run_train, tiny_args

from fp8train.observe.metrics_file import read_rows

ARGS = dict(batch_size=8, gradient_accumulation_steps=1, max_steps=40, eval_interval=10,
            log_interval=5, checkpoint_interval=20, eval_samples=0)
SUMMARY_KEYS = {
    "status", "exit_code", "steps", "total_steps", "tokens", "final_val_loss", "final_val_step",
    "best_val_loss", "best_val_step", "target_val_loss", "target_met", "time_to_target_s",
    "tokens_to_target", "step_at_target", "target_gap", "wall_time_s", "train_time_s",
    "tokens_per_sec", "mfu", "steady_state_tokens", "peak_memory_gb", "batch", "precision",
    "fp8", "fp8_layers_converted", "model", "n_params", "skipped_steps", "rollbacks",
    "checkpoints_written", "latest_checkpoint", "fp8_verdict", "tokens_fp8", "tokens_after_fp8",
    "fp8_loss_gap", "fp8_choice", "first_step_s", "hellaswag"}


def _rows(run):
    return read_rows(run, strict=True)


def _summary(run):
    return json.loads((run / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """fp32 with a target it reaches early (byte-level tinyshakespeare: the unigram entropy is
    3.31 nats; 3.4 is passed within the first evaluations, long before max_steps), and native
    FP8 with a target it cannot reach."""
    root = tmp_path_factory.mktemp("report")
    out = {}
    for name, kw in (("fp32", dict(target_val_loss=3.4)),
                     ("fp8", dict(target_val_loss=0.5, use_fp8="true"))):
        r = run_train(*tiny_args(root / name, **kw, **ARGS))
        assert r.returncode == 0, r.stderr[-3000:]
        out[name] = (root / name, r)
    return out


def test_a_target_reached_stops_the_run_with_a_checkpoint(runs, tmp_path):
    run, r = runs["fp32"]
    s = _summary(run)
    assert s["status"] == "target reached" and s["target_met"] is True
    step = s["step_at_target"]
    assert step < 40 and s["steps"] == step and step % 10 == 0
    evals = [row for row in _rows(run) if "val/loss" in row]
    first = next(row for row in evals if row["val/loss"] <= 3.4)
    assert first["step"] == step and all(row["val/loss"] > 3.4 for row in evals[:-1])
    target_row = next(row for row in _rows(run) if "val/time_to_target_s" in row)
    assert target_row["step"] == step and target_row["val/tokens_to_target"] == step * 8 * 64
    assert 0 < s["time_to_target_s"] == target_row["val/time_to_target_s"] <= s["train_time_s"]
    assert os.path.isdir(run / "checkpoints" / f"step_{step:07d}")
    assert s["latest_checkpoint"].endswith(f"step_{step:07d}")
    assert f"target val/loss 3.4 MET at step {step}" in r.stdout

    # Resuming a run that reached its target has nothing to do ...
    run = tmp_path / "copy"
    shutil.copytree(runs["fp32"][0], run)
    before = (run / "summary.json").read_text()
    again = run_train(*tiny_args(run, target_val_loss=3.4, resume="auto", **ARGS))
    assert again.returncode == 0 and "nothing to do: target val/loss 3.4 was reached" in \
        again.stdout, again.stderr[-2000:]
    assert (run / "summary.json").read_text() == before   # the report of the run stands
    # ... unless told to train on: then it runs to the end, the target kept on record.
    on = run_train(*tiny_args(run, target_val_loss=3.4, resume="auto", stop_at_target="false",
                              **ARGS))
    assert on.returncode == 0, on.stderr[-2000:]
    s = _summary(run)
    assert s["steps"] == 40 and s["status"] == "completed" and s["step_at_target"] == step
    assert s["best_val_loss"] <= s["final_val_loss"] + 1e-9


def test_a_target_not_reached_runs_to_the_end_and_reports_the_gap(runs):
    run, r = runs["fp8"]
    s = _summary(run)
    assert set(s) == SUMMARY_KEYS
    assert s["status"] == "completed" and s["steps"] == s["total_steps"] == 40
    assert s["target_met"] is False and s["time_to_target_s"] is None
    evals = [row for row in _rows(run) if "val/loss" in row]
    assert s["best_val_loss"] == min(row["val/loss"] for row in evals)
    assert s["final_val_loss"] == evals[-1]["val/loss"] and s["final_val_step"] == 40
    assert abs(s["target_gap"] - (s["best_val_loss"] - 0.5)) < 1e-9
    assert "target val/loss 0.5 NOT met" in r.stdout
    assert not any("val/time_to_target_s" in row for row in _rows(run))
    # The steady state leaves the first log interval (compile, warm-up) out.
    assert s["steady_state_tokens"] == (40 - 5) * 8 * 64 and s["tokens_per_sec"] > 0
    assert s["tokens"] == 40 * 8 * 64 and s["wall_time_s"] >= s["train_time_s"] > 0
    assert 0 < s["first_step_s"] < s["wall_time_s"]
    # the optimizer step of every logged step, timed apart, shorter than the step
    timed = [row for row in _rows(run) if "train/loss" in row]
    assert all(0 < row["train/optimizer_ms"] < 1e3 * row["train/step_time"] for row in timed)
    assert s["fp8"].startswith("native") and s["fp8_layers_converted"] == 8
    assert s["batch"] == {"micro_batch_size": 8, "gradient_accumulation_steps": 1,
                          "world_size": 1, "effective_batch_size": 8, "tokens_per_step": 512}
    assert s["checkpoints_written"] == 2 == len(os.listdir(run / "checkpoints")) - 1  # + latest
    assert s["mfu"] is None and s["peak_memory_gb"] is None   # no GPU: not made up
    assert s["skipped_steps"] == 0 and s["n_params"] > 0
    # FP8 emulated on a CPU: the verdict gives the FLOP share and claims no speed-up.
    v = s["fp8_verdict"]
    assert v["status"] == "emulated" and v["step"] is None
    assert 0 < v["flop_share"] < 1
    assert "emulated" in r.stdout and "FLOP" in r.stdout


def _compare(*args):
    return subprocess.run([sys.executable, "scripts/compare_runs.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_compare_runs_renders_a_table_and_a_png(runs, tmp_path):
    fp32, fp8 = runs["fp32"][0], runs["fp8"][0]
    r = _compare(fp32, fp8, "--out", tmp_path / "cmp")
    assert r.returncode == 0, r.stderr
    table = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in r.stdout.splitlines() if line.startswith("| ") and "---" not in line}
    assert table[""] == ["fp32", "fp8"]
    a, b = _summary(fp32), _summary(fp8)
    assert table["final val/loss"] == [f"{a['final_val_loss']:.4f}", f"{b['final_val_loss']:.4f}"]
    assert table["target met"][0] == "yes" and table["target met"][1].startswith("no (gap ")
    assert table["precision"][0] == "fp32" and "FP8 native" in table["precision"][1]
    assert table["steps"] == [f"{a['steps']} / 40", "40 / 40"]
    png = (tmp_path / "cmp" / "val_loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    assert (tmp_path / "cmp" / "compare.md").read_text().strip() == \
        "\n".join(line for line in r.stdout.splitlines() if line.startswith("|"))
    # Every val row carries the times the plot needs.
    assert all("time/wall_s" in row and "time/train_s" in row
               for row in _rows(fp8) if "val/loss" in row)


def test_compare_runs_reads_an_unfinished_run_and_refuses_a_missing_one(runs, tmp_path):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(runs["fp8"][0] / "metrics.jsonl", unfinished / "metrics.jsonl")
    r = _compare(runs["fp32"][0], unfinished, "--out", tmp_path / "cmp", "--x", "tokens")
    assert r.returncode == 0, r.stderr
    assert "no summary.json (unfinished?)" in r.stdout
    bad = _compare(tmp_path / "nope", "--out", tmp_path / "cmp2")
    assert bad.returncode == 2 and bad.stderr.startswith("error: run directory")
    assert not (tmp_path / "cmp2").exists()
