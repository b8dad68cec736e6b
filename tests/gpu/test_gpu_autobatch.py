"""Micro-batch discovery on a real GPU (skipped without CUDA): the probe finds a micro-batch
within the device budget, and 50 real steps with that plan do not run out of memory and stay
under the budget."""
import json

import pytest
import torch
import yaml

from conftest import run_train

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("model", ["gpt2-124m", "llama-350m"])
def test_probe_then_train_within_the_budget(tmp_path, model):
    out = tmp_path / model
    args = ["--config", "configs/test_auto_batch.yaml", "--output_dir", out, f"--model={model}",
            "--seq_len=1024", "--probe_memory_limit_gb=null", "--max_batch_size=256",
            "--target_effective_batch_size=256", "--max_steps=50", "--warmup_steps=5",
            "--eval_interval=50", "--checkpoint_interval=50", "--eval_sequences=16"]
    r = run_train(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    (entry,) = json.load(open(out / "batch_probe.json")).values()
    budget = torch.cuda.get_device_properties(0).total_memory * 0.9 / 1e9
    derived = yaml.safe_load(open(out / "config.yaml"))["derived"]
    assert derived["micro_batch_size"] * derived["gradient_accumulation_steps"] == 256
    assert derived["micro_batch_size"] <= entry["fitted_micro_batch"]
    rows = [json.loads(x) for x in open(out / "metrics.jsonl") if "train/loss" in x]
    assert max(x["system/gpu_memory_peak_gb"] for x in rows) < budget
