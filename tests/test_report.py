"""Time-to-target and the end-of-run report (summary.json), on real runs of train_fp8.py."""
import json
import os

from conftest import run_train, tiny_args

ARGS = dict(batch_size=8, gradient_accumulation_steps=1, max_steps=40, eval_interval=10,
            log_interval=5, checkpoint_interval=20, eval_samples=0)
SUMMARY_KEYS = {
    "status", "exit_code", "steps", "total_steps", "tokens", "final_val_loss", "final_val_step",
    "best_val_loss", "best_val_step", "target_val_loss", "target_met", "time_to_target_s",
    "tokens_to_target", "step_at_target", "target_gap", "wall_time_s", "train_time_s",
    "tokens_per_sec", "mfu", "steady_state_tokens", "peak_memory_gb", "batch", "precision",
    "fp8", "fp8_layers_converted", "model", "n_params", "skipped_steps", "rollbacks",
    "checkpoints_written", "latest_checkpoint"}


def _rows(run):
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


def _summary(run):
    return json.loads((run / "summary.json").read_text())


def test_a_target_reached_stops_the_run_with_a_checkpoint(tmp_path):
    """byte-level tinyshakespeare: the unigram entropy is 3.31 nats; 3.4 is passed within the
    first evaluations, long before max_steps."""
    run = tmp_path / "run"
    r = run_train(*tiny_args(run, target_val_loss=3.4, **ARGS))
    assert r.returncode == 0, r.stderr[-3000:]
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
    again = run_train(*tiny_args(run, target_val_loss=3.4, resume="auto", **ARGS))
    assert again.returncode == 0 and "nothing to do: target val/loss 3.4 was reached" in \
        again.stdout, again.stderr[-2000:]
    # ... unless told to train on: then it runs to the end, the target kept on record.
    on = run_train(*tiny_args(run, target_val_loss=3.4, resume="auto", stop_at_target="false",
                              **ARGS))
    assert on.returncode == 0, on.stderr[-2000:]
    s = _summary(run)
    assert s["steps"] == 40 and s["status"] == "completed" and s["step_at_target"] == step
    assert s["best_val_loss"] <= s["final_val_loss"] + 1e-9


def test_a_target_not_reached_runs_to_the_end_and_reports_the_gap(tmp_path):
    run = tmp_path / "run"
    r = run_train(*tiny_args(run, target_val_loss=0.5, use_fp8="true", **ARGS))
    assert r.returncode == 0, r.stderr[-3000:]
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
    assert s["fp8"].startswith("native") and s["fp8_layers_converted"] == 8
    assert s["batch"] == {"micro_batch_size": 8, "gradient_accumulation_steps": 1,
                          "world_size": 1, "effective_batch_size": 8, "tokens_per_step": 512}
    assert s["checkpoints_written"] == 2 == len(os.listdir(run / "checkpoints")) - 1  # + latest
    assert s["mfu"] is None and s["peak_memory_gb"] is None   # no GPU: not made up
    assert s["skipped_steps"] == 0 and s["n_params"] > 0
