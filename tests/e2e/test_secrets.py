"""Secrets in the environment never reach the run's files, the console or W&B: the rule for what
counts as a secret, redaction, and a real training run with W&B offline whose every file is read
back as bytes."""


import json
import secrets as stdlib_secrets

import pytest
from support.runs import tiny_args


def test_a_run_with_wandb_offline_writes_no_secret_anywhere(tmp_path):
    """WANDB_API_KEY, HF_TOKEN and a custom token in the environment, two of them also typed
    into the command line by mistake (the run's name, a tag): no file of the run (config.yaml,
    train.log, summary.json, metrics.jsonl, samples.jsonl, checkpoints, W&B's offline run with
    its .wandb file and logs) and neither stdout nor stderr holds any of them."""
    pytest.importorskip("wandb")
    from support.wandb_records import (history_and_config, offline_runs, run_with_env, wandb_env,
                                       wandb_records)

    secrets = {"WANDB_API_KEY": stdlib_secrets.token_hex(20),          # W&B's 40-hex format
               "HF_TOKEN": "hf_" + stdlib_secrets.token_hex(17),
               "MY_SERVICE_TOKEN": "svc-" + stdlib_secrets.token_hex(12)}
    out = tmp_path / "run"
    env = wandb_env(tmp_path, WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wandb_dir"),
                    **secrets)
    args = tiny_args(out, use_wandb="true", max_steps=6, eval_samples=2,
                     wandb_run_name=f"run-{secrets['MY_SERVICE_TOKEN']}",
                     wandb_tags=f"[ci, {secrets['HF_TOKEN']}]")
    r = run_with_env(args, env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(offline)" in r.stdout

    for name in ("config.yaml", "train.log", "summary.json", "metrics.jsonl", "samples.jsonl"):
        assert (out / name).is_file(), name
    (run_dir,) = offline_runs(out)
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files) and any(p.name == "debug.log" for p in files)
    for what, value in secrets.items():
        assert value not in r.stdout and value not in r.stderr, what
        for p in files:
            assert value.encode() not in p.read_bytes(), f"{what} in {p.relative_to(out)}"

    # What was typed into the command line is there, redacted.
    assert "wandb_run_name: run-***" in (out / "config.yaml").read_text()
    _, config = history_and_config(run_dir)
    assert config["wandb_run_name"] == "run-***" and config["wandb_tags"] == ["ci", "***"]
    records = wandb_records(run_dir)
    (run,) = [x.run for x in records if x.WhichOneof("record_type") == "run"]
    assert run.display_name == "run-***" and list(run.tags) == ["ci", "***"]
    meta = [x.environment for x in records
            if x.WhichOneof("record_type") == "environment" and x.environment.args]
    assert meta and "--wandb_run_name=run-***" in meta[0].args
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
