"""W&B logging through W&B's own client in offline mode (the server is the one thing that cannot
exist here). The offline run file is read back record by record, so the tests see exactly what
`wandb sync` would upload."""
import json
import os
import subprocess
import sys

import pytest
from support.runs import DATA_DIR, ROOT, run_train, tiny_args
from support.wandb_records import (history_and_config, metrics_rows, offline_runs, run_with_env,
                                   wandb_console_lines, wandb_env, wandb_summary)

pytest.importorskip("wandb")


def test_offline_run_holds_every_metric_the_config_and_resumes_the_same_run(tmp_path):
    out = tmp_path / "run"
    env = wandb_env(tmp_path, WANDB_MODE="offline")
    args = tiny_args(out, use_fp8="true", fp8_backend="native", use_wandb="true",
                     wandb_tags="[ci, fp8]", max_steps=6, profile_steps="[5,5]")
    r = run_with_env(args, env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "W&B: run" in r.stdout and "(offline)" in r.stdout
    (run_dir,) = offline_runs(out)
    run_id = (out / "wandb_run_id").read_text().strip()
    assert run_dir.endswith("-" + run_id)
    # W&B's own banner, history and summary (some 50 lines) stay off the console: one line
    # says where the offline run is and how to sync it.
    assert wandb_console_lines(r) == [], r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("W&B: ")]
    assert line.endswith(f"(sync it with `wandb sync {run_dir}`)"), line

    history, config = history_and_config(run_dir)
    # The full resolved config and the derived values, as in config.yaml.
    assert config["use_fp8"] is True and config["fp8_backend"] == "native"
    assert config["wandb_tags"] == ["ci", "fp8"] and config["max_steps"] == 6
    derived = config["derived"]
    assert (derived["micro_batch_size"], derived["gradient_accumulation_steps"],
            derived["world_size"]) == (8, 2, 1)
    assert derived["precision"] == "fp32" and derived["fp8_layers"] == 8
    assert derived["fp8"].startswith("native") and "emulated" in derived["fp8"]
    env_info = derived["environment"]
    assert env_info["torch_version"] and env_info["wandb_version"] and env_info["gpu_count"] == 0
    assert len(env_info["git_commit"].split("-")[0]) == 40 or env_info["git_commit"] == "unknown"

    # Every metrics.jsonl row went to W&B with the same values, keyed by our own step.
    rows = metrics_rows(out)
    train = [h for h in history if "train/loss" in h]
    assert [h["step"] for h in train] == [x["step"] for x in rows if "train/loss" in x] == [4, 6]
    for key in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec",
                "train/tokens_per_sec_per_device", "train/step_time",
                "train/data_wait_fraction", "train/penalty", "fp8/fwd_scale", "fp8/bwd_scale",
                "fp8/amax", "fp8/blocks.0.attn.qkv/fwd_scale_input"):
        assert train[-1][key] == pytest.approx([x for x in rows if "train/loss" in x][-1][key])
    val = [h for h in history if "val/loss" in h]
    assert [h["step"] for h in val] == [6] and val[0]["val/ppl"] > 1
    saves = [h for h in history if "checkpoint/save_s" in h]
    assert [h["step"] for h in saves] == [x["step"] for x in rows if "checkpoint/save_s" in x] \
        == [6] and saves[0]["checkpoint/size_gb"] > 0
    tables = [h for h in history if "samples/text/_type" in h]
    assert tables and tables[0]["samples/text/_type"] == "table-file" and \
        tables[0]["samples/text/nrows"] == 2
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [6, 6] and all(s["sample"] for s in samples)

    # The end-of-run report is the run's summary too.
    report = json.loads((out / "summary.json").read_text())
    summary = wandb_summary(run_dir)
    assert summary["summary/final_val_loss"] == pytest.approx(report["final_val_loss"])
    assert summary["summary/status"] == "completed" and summary["summary/steps"] == 6
    assert summary["summary/batch/effective_batch_size"] == 16
    assert summary["summary/fp8_layers_converted"] == 8
    # The profiler's trace is attached to the run (profile_steps).
    assert os.path.isfile(os.path.join(run_dir, "files", "profile",
                                       "trace_steps_5-5_rank0.json"))
    assert train[-1]["train/profiled"] == 1

    # A resumed run continues the same W&B run.
    r = run_with_env(args[:-1] + ["--max_steps=12", "--resume"], env)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = offline_runs(out)
    assert len(runs) == 2 and all(d.endswith("-" + run_id) for d in runs)
    history2, _ = history_and_config(runs[-1])
    assert [h["step"] for h in history2 if "train/loss" in h] == [8, 12]


def test_no_api_key_gives_one_warning_and_an_offline_run(tmp_path):
    out = tmp_path / "run"
    r = run_with_env(tiny_args(out, use_wandb="true", max_steps=4, eval_samples=0),
                     wandb_env(tmp_path))   # online mode, but no key anywhere
    assert r.returncode == 0, r.stderr[-3000:]
    warnings = [line for line in r.stderr.splitlines() if line.startswith("WARNING: W&B")]
    assert len(warnings) == 1 and "continuing offline" in warnings[0] and \
        "wandb sync" in warnings[0]
    assert wandb_console_lines(r) == [], r.stderr
    (run_dir,) = offline_runs(out)
    history, _ = history_and_config(run_dir)
    assert [h["step"] for h in history if "train/loss" in h] == [4]


def test_wandb_failing_at_init_does_not_stop_training(tmp_path):
    # Stands in for the W&B server refusing us (the one thing that cannot run here): init
    # raises W&B's own network error, online and offline alike.
    out = tmp_path / "run"
    code = ("import sys, wandb, wandb.errors\n"
            "def refuse(*a, **k):\n"
            "    raise wandb.errors.CommError('503 Service Unavailable')\n"
            "wandb.init = refuse\n"
            "from fp8train.train.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    env = dict(wandb_env(tmp_path), FP8TRAIN_DATA_DIR=DATA_DIR)
    r = subprocess.run([sys.executable, "-c", code,
                        *tiny_args(out, use_wandb="true", max_steps=4, eval_samples=0)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    warnings = [line for line in r.stderr.splitlines() if "W&B" in line]
    assert len(warnings) == 1 and "503 Service Unavailable" in warnings[0] and \
        "metrics.jsonl only" in warnings[0]
    assert "Traceback" not in r.stderr
    assert [x["step"] for x in metrics_rows(out) if "train/loss" in x] == [4]


def test_wandb_mode_disabled_is_respected(tmp_path):
    out = tmp_path / "run"
    r = run_with_env(tiny_args(out, use_wandb="true", max_steps=4, eval_samples=0),
                     wandb_env(tmp_path, WANDB_MODE="disabled"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(disabled)" in r.stdout and "WARNING" not in r.stderr
    assert offline_runs(out) == []
    assert [x["step"] for x in metrics_rows(out) if "train/loss" in x] == [4]


def test_a_sweep_trial_gets_its_own_run_directory(tmp_path):
    # What a sweep agent sets for each trial; the trial logs offline here.
    out = tmp_path / "sweep"
    env = wandb_env(tmp_path, WANDB_MODE="offline", WANDB_SWEEP_ID="sw123",
                    WANDB_RUN_ID="trial7")
    r = run_with_env(tiny_args(out, use_wandb="true", max_steps=4, eval_samples=0), env)
    assert r.returncode == 0, r.stderr[-3000:]
    trial = out / "trial7"
    assert (trial / "metrics.jsonl").is_file() and (trial / "config.yaml").is_file()
    assert "output_dir: " + str(trial) in (trial / "config.yaml").read_text()
    (run_dir,) = offline_runs(trial)
    assert run_dir.endswith("-trial7")
    # The agent starts a preempted trial again with the same run id and command line: it
    # continues from the trial's own checkpoint (no --resume on the sweep's command line).
    r = run_with_env(tiny_args(out, use_wandb="true", max_steps=6, eval_samples=0), env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {trial / 'checkpoints' / 'step_0000004'} at step 4" in r.stdout


def test_samples_do_not_change_training(tmp_path):
    """Sampling uses its own generator: the losses are bit-identical with and without it."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_train(*tiny_args(a, eval_samples=0)).returncode == 0
    assert run_train(*tiny_args(b, eval_samples=3, sample_tokens=16)).returncode == 0
    losses = [[x.get("train/loss", x.get("val/loss")) for x in metrics_rows(d)] for d in (a, b)]
    assert losses[0] == losses[1]
    assert not (a / "samples.jsonl").exists()
    samples = [json.loads(line) for line in (b / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [6] * 3 + [12] * 3
    assert all(len(s["sample"].encode()) <= 16 * 4 for s in samples)
