"""GPU checks of the bf16 training loop: run only where CUDA is present (skipped in CI). Every
run reads tinyshakespeare from disk and never downloads it (gpu_support.run_train)."""
import json
import os

import pytest
import torch
import yaml
from gpu_support import needs_corpus, needs_cuda, run_train
from support.runs import tiny_args

from fp8train.observe.metrics_file import read_rows

pytestmark = [pytest.mark.gpu, needs_cuda, needs_corpus]


def test_bf16_run_on_gpu_reports_memory_and_precision(tmp_path):
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, max_steps=20, batch_size=16, seq_len=128))
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = yaml.safe_load(open(out / "config.yaml"))
    assert cfg["derived"]["precision"] == "bf16"
    assert cfg["derived"]["device"] == torch.cuda.get_device_name()
    rows = read_rows(out, strict=True)
    last = [x for x in rows if "train/loss" in x][-1]
    assert last["system/gpu_memory_peak_gb"] >= last["system/gpu_memory_allocated_gb"] > 0
    assert last["system/gpu_memory_reserved_gb"] >= last["system/gpu_memory_allocated_gb"]
    from fp8train.observe.metrics import peak_flops
    if peak_flops(torch.cuda.get_device_name()) is not None:
        assert 0 < last["train/mfu"] < 1
        assert cfg["derived"]["mfu_peak"].startswith("MFU against the")
    else:
        assert "train/mfu" not in last and cfg["derived"]["mfu_peak"].startswith("no MFU")
    assert cfg["derived"]["environment"]["gpu_name"] == torch.cuda.get_device_name()


@pytest.mark.gpu_quick
def test_resume_on_gpu_continues_the_step_count(tmp_path):
    out = tmp_path / "run"
    first = run_train(*tiny_args(out, max_steps=6, lr_decay_steps=12))
    assert first.returncode == 0, first.stderr[-3000:]
    r = run_train(*tiny_args(out, max_steps=12, lr_decay_steps=12), "--resume")
    assert r.returncode == 0 and "at step 6" in r.stdout, r.stderr[-3000:]
    assert os.path.isdir(out / "checkpoints" / "step_0000012")


def test_profiled_steps_on_gpu_record_cuda_kernels_and_a_memory_snapshot(tmp_path):
    """profile_steps on CUDA: the trace has the GPU's kernels inside each step's range, and the
    memory snapshot of the same steps loads as memory_viz reads it (a pickled dict with the
    allocator's segments and the recorded traces)."""
    import pickle
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, max_steps=8, log_interval=2, eval_samples=0),
                  "--profile_steps=[3,4]")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the memory snapshot in https://pytorch.org/memory_viz" in r.stdout
    trace = json.loads((out / "profile" / "trace_steps_3-4_rank0.json").read_text())
    kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel"]
    assert kernels, "no CUDA kernel in the trace"
    with open(out / "profile" / "memory_steps_3-4_rank0.pickle", "rb") as fh:
        snapshot = pickle.load(fh)
    assert snapshot["segments"] and any(snapshot["device_traces"])


def test_background_checkpoints_on_gpu_resume_like_the_uninterrupted_run(tmp_path):
    """checkpoint_async on CUDA: the state goes device -> pinned host buffers at the step and is
    written by a thread while training goes on. A run resumed from such a checkpoint (step 4,
    written in the background while steps 5-6 trained) logs the uninterrupted run's losses."""
    import shutil
    out = tmp_path / "run"
    args = tiny_args(out, max_steps=12, log_interval=2, checkpoint_interval=4, eval_samples=0,
                     keep_checkpoints=0, checkpoint_async="true")
    r = run_train(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "saved in the background" in r.stdout
    step4 = out / "checkpoints" / "step_0000004"
    assert json.loads((step4 / "manifest.json").read_text())["async"] is True
    assert "copied to host memory" in (out / "train.log").read_text()
    rows = read_rows(out, strict=True)
    saves = [x for x in rows if "checkpoint/save_s" in x]
    assert [x["step"] for x in saves] == [4, 8, 12] and all(x["checkpoint/size_gb"] > 0
                                                            for x in saves)
    again = tmp_path / "again"
    shutil.copytree(out, again)
    r = run_train(*tiny_args(again, max_steps=12, log_interval=2, checkpoint_interval=4,
                             eval_samples=0, keep_checkpoints=0, checkpoint_async="true"),
                  f"--resume={again / 'checkpoints' / 'step_0000004'}")
    assert r.returncode == 0 and "at step 4" in r.stdout, r.stderr[-3000:]
    losses = {x["step"]: x["train/loss"] for x in rows if "train/loss" in x}
    resumed = read_rows(again, strict=True)
    for x in resumed:
        if "train/loss" in x and x["step"] > 4:
            assert x["train/loss"] == pytest.approx(losses[x["step"]], rel=1e-5), x["step"]


def test_a_background_checkpoint_on_gpu_overlaps_training_without_stalling_it(tmp_path):
    """A state large enough for its write to take seconds (llama-350m: ~308M parameters, with
    AdamW's moments ~3.7 GB in fp32) saved in the background every 10 steps: training goes on
    during each write (its row counts the steps trained meanwhile), and the training thread is
    never held up for long by the writer (safetensors 0.8+ and torch.save's storage writes
    release the GIL: fp8train/checkpoint/write_stall.py); the stall is measured in the process itself
    (`checkpoint/stall_max_s`). Bound: 0.25 s, as in the CPU test
    (tests/e2e/test_checkpoint_stall.py); a writer holding the GIL stops training for seconds."""
    import safetensors

    from fp8train.checkpoint.write_stall import safetensors_holds_gil
    if safetensors_holds_gil():
        pytest.skip(f"safetensors {safetensors.__version__} holds the GIL while it writes: "
                    "checkpoint_async is off with it (pip install 'safetensors>=0.8')")
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, model="llama-350m", n_layer=24, max_steps=30, log_interval=5,
                             eval_interval=100, eval_sequences=16, eval_samples=0,
                             checkpoint_interval=10, keep_checkpoints=1,
                             checkpoint_async="true"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_rows(out, strict=True)
    saves = {x["step"]: x for x in rows if "checkpoint/save_s" in x}
    assert sorted(saves) == [10, 20, 30], saves
    for step in (10, 20):   # the background ones; 30, the last, is written before the run ends
        row = saves[step]
        assert row["checkpoint/size_gb"] > 3, row
        assert row["checkpoint/overlap_steps"] >= 1, f"no step trained during the write: {row}"
        assert 0 <= row["checkpoint/stall_max_s"] < 0.25, row
    assert "checkpoint/stall_max_s" not in saves[30]
    said = [line for line in r.stdout.splitlines() if "saved in the background" in line]
    assert len(said) == 2 and all("during the write, stalled" in line for line in said), r.stdout
