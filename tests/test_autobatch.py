"""Micro-batch discovery: the search against an injected memory model that raises a genuine
torch.OutOfMemoryError, the plan over many (target, world, fitted), and real probing through
train_fp8.py on CPU (measured bytes against a budget), its cache, and two ranks that disagree."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import yaml

from conftest import DATA_DIR, ROOT, run_train
from fp8train import autobatch
from fp8train.autobatch import Probe, plan_from_fit, search_max_batch
from fp8train.config import Config, ConfigError, load_config
from fp8train.schedule import scaled_lr


def oom_above(n, bytes_per_seq=1000):
    """A step that fits up to n sequences and raises CUDA's out-of-memory error beyond."""
    def trial(micro):
        if micro > n:
            raise torch.OutOfMemoryError(f"CUDA out of memory (asked for {micro} > {n})")
        return micro * bytes_per_seq
    return trial


@pytest.mark.parametrize("n", list(range(1, 70)) + [97, 100, 127, 128, 129, 200, 255, 256, 1000])
def test_search_finds_exactly_the_largest_fit_in_log_trials(n):
    maximum = 256
    probe = Probe(oom_above(n), budget_bytes=float("inf"))
    assert search_max_batch(probe.fits, maximum) == min(n, maximum)
    # doubling to the first failure, then bisection: at most 2·log2(N) + 2 trials
    assert len(probe.trials) <= 2 * math.ceil(math.log2(min(n, maximum) + 1)) + 2
    assert all(ok == (m <= n) for m, ok, _ in probe.trials)


@pytest.mark.parametrize("n,budget", [(100, 50_500), (100, 99_999), (30, 10**9), (64, 64_000)])
def test_search_respects_the_memory_budget(n, budget):
    """Headroom: a step that runs but uses more than the budget counts as not fitting."""
    probe = Probe(oom_above(n), budget_bytes=budget)
    assert search_max_batch(probe.fits, 128) == min(n, budget // 1000)


def test_other_errors_are_not_taken_for_out_of_memory():
    def trial(micro):
        raise RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        search_max_batch(Probe(trial, 1e12).fits, 64)


# What an allocation failure reads like when it is not a torch.OutOfMemoryError: Transformer
# Engine registers no exception translator, so its C++ errors are plain RuntimeErrors built by
# NVTE_CHECK_CUDA / NVTE_CHECK_CUBLAS (transformer_engine/common/util/logging.h), and torch
# names cuBLAS's status by its enum.
LIBRARY_OOMS = [
    "/te/common/gemm/cublaslt_gemm.cu:412 in function cublas_gemm: CUDA Error: out of memory",
    "/te/common/gemm/cublaslt_gemm.cu:301 in function cublas_gemm: cuBLAS Error: the resource "
    "allocation failed",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN Error: CUDNN_STATUS_ALLOC_FAILED. For more information, enable cuDNN error logging",
    "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
]


@pytest.mark.parametrize("message", LIBRARY_OOMS)
def test_an_allocation_failure_inside_a_library_counts_as_not_fitting(message):
    def trial(micro):
        if micro > 6:
            raise RuntimeError(message)
        return micro
    assert search_max_batch(Probe(trial, 1e12).fits, 64) == 6
    assert autobatch.is_out_of_memory(RuntimeError(message))


@pytest.mark.parametrize("message", [
    "CUDA error: an illegal memory access was encountered",
    "mat1 and mat2 shapes cannot be multiplied (64x128 and 256x128)",
    "cuBLAS Error: an invalid numeric value was used as an argument"])
def test_other_library_errors_are_not_out_of_memory(message):
    assert not autobatch.is_out_of_memory(RuntimeError(message))
    assert not autobatch.is_out_of_memory(ValueError("out of memory"))   # not from a device


def test_an_out_of_memory_error_wrapped_in_another_is_recognised():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except torch.OutOfMemoryError as e:
            raise ValueError("a library's own error while handling it") from e
    except ValueError as wrapped:
        assert autobatch.is_out_of_memory(wrapped)


def test_discovery_releases_memory_and_restarts_the_peak_after_its_trials(tmp_path, monkeypatch):
    """The run's system/gpu_memory_peak_gb must describe the run, not the probe's largest
    (often failed) trial: after the last trial, discovery frees the cache and restarts the
    peak statistics of its device."""
    events = []
    monkeypatch.setattr(autobatch, "release_memory",
                        lambda device=None: events.append(("release", device)))

    def trial(micro):
        events.append(("trial", micro))
        return oom_above(5)(micro)

    cfg = Config(max_batch_size=8, probe_memory_limit_gb=1.0, output_dir=str(tmp_path))
    fit = autobatch.discover(cfg, trial, {"k": 1}, torch.device("cpu"), 0, 1, True, print)
    assert fit.micro == 5
    trials = [e for e in events if e[0] == "trial"]
    assert len(trials) >= 4
    # each trial is followed by a release (Probe.fits), and the search by one for the device
    assert events[-1] == ("release", torch.device("cpu"))
    assert events.index(trials[-1]) < len(events) - 1


def test_releasing_memory_restarts_the_cuda_peak(monkeypatch):
    """The CUDA side of release_memory, with torch.cuda stood in for (no GPU here)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: calls.append(("reset_peak", device)))
    autobatch.release_memory()                       # after one trial: the cache only
    assert calls == ["empty_cache"]
    cuda = torch.device("cuda", 0)
    autobatch.release_memory(cuda)                   # after the search: the peak too
    assert calls[1:] == ["empty_cache", ("reset_peak", cuda)]


def test_nothing_fits():
    assert search_max_batch(Probe(oom_above(0), 1e12).fits, 64) == 0


def test_plan_hits_the_target_exactly_for_every_combination():
    for world in (1, 2, 3, 4, 8):
        for target in range(world, 300, world):
            for fitted in (1, 2, 3, 5, 7, 16, 17, 48, 52, 64, 100, 128, 500):
                cfg = Config(target_effective_batch_size=target, max_batch_size=128)
                plan = plan_from_fit(cfg, world, fitted)
                assert plan.micro * plan.accum * plan.world == target
                assert plan.micro <= min(fitted, 128) and plan.world == world
                per_rank = target // world
                # the largest micro-batch that divides this rank's share and fits
                assert not any(per_rank % m == 0 for m in range(plan.micro + 1,
                                                                 min(fitted, 128) + 1))


def test_target_not_divisible_by_world_is_an_error_with_the_nearest_targets():
    cfg = Config(target_effective_batch_size=100, source="run.yaml")
    with pytest.raises(ConfigError, match=r"run.yaml: key 'target_effective_batch_size' \(100\) "
                                          r"is not divisible by the world size \(8\); nearest "
                                          r"valid: 96 or 104"):
        plan_from_fit(cfg, 8, 64)


def test_lr_scaling_rules():
    assert scaled_lr(3e-3, "none", 512, 256) == (3e-3, "")
    lr, note = scaled_lr(3e-3, "sqrt", 512, 256)
    assert lr == pytest.approx(3e-3 * math.sqrt(2)) and "sqrt(512/256)" in note
    assert scaled_lr(3e-3, "linear", 128, 256)[0] == pytest.approx(1.5e-3)
    with pytest.raises(ConfigError, match="lr_reference_batch_size is not set"):
        load_config(["--lr_scaling", "sqrt"])
    with pytest.raises(ConfigError, match="'gradient_accumulation_steps' is derived"):
        load_config(["--auto_batch_size", "--target_effective_batch_size=64",
                     "--gradient_accumulation_steps=2"])


# --- real probing through train_fp8.py --------------------------------------------------------

AUTO = ["--config", "configs/test_auto_batch.yaml"]


def probe_file(out):
    with open(out / "batch_probe.json") as fh:
        return list(json.load(fh).values())


def test_cpu_probe_plans_within_the_budget_and_caches_it(tmp_path):
    out = tmp_path / "run"
    r = run_train(*AUTO, "--output_dir", out, "--plan-only")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "batch discovery: probing micro-batches up to 64" in r.stdout
    line = next(x for x in r.stdout.splitlines() if x.startswith("batch plan:"))
    (entry,) = probe_file(out)
    fitted = entry["fitted_micro_batch"]
    budget = 0.1 * (1 - 0.1)  # probe_memory_limit_gb × (1 - memory_headroom)
    # The measured peaks grow with the micro-batch, every fit is within the budget, and the
    # next size up is not.
    trials = sorted(entry["trials"], key=lambda t: t["micro"])
    assert all(t["fits"] == (t["peak_gb"] <= budget) for t in trials)
    assert [t["peak_gb"] for t in trials] == sorted(t["peak_gb"] for t in trials)
    assert 4 <= fitted < 64 and any(t["micro"] == fitted + 1 and not t["fits"] for t in trials)
    micro = max(d for d in range(1, fitted + 1) if 64 % d == 0)
    assert line.startswith(f"batch plan: micro {micro} × accum {64 // micro} × 1 device = 64 "
                           f"sequences (8,192 tokens) per step; fitted micro {fitted} of max 64 "
                           "(probe ")
    assert "plan only" in r.stdout and not (out / "checkpoints").exists()

    # The second run trains with the cached plan, without probing.
    r2 = run_train(*AUTO, "--output_dir", out, "--max_steps=4", "--warmup_steps=1")
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert "probing" not in r2.stdout
    assert f"fitted micro {fitted} of max 64 (cached in {out / 'batch_probe.json'})" in r2.stdout
    derived = yaml.safe_load(open(out / "config.yaml"))["derived"]
    assert (derived["micro_batch_size"], derived["gradient_accumulation_steps"]) == \
        (micro, 64 // micro)
    assert derived["effective_batch_size"] == 64

    # Any key that changes memory use misses the cache; --reprobe ignores it.
    r3 = run_train(*AUTO, "--output_dir", out, "--plan-only", "--seq_len=64")
    assert "probing" in r3.stdout and len(probe_file(out)) == 2
    r4 = run_train(*AUTO, "--output_dir", out, "--plan-only", "--reprobe")
    assert "probing" in r4.stdout and len(probe_file(out)) == 2


def test_a_model_that_does_not_fit_at_all_exits_2(tmp_path):
    r = run_train(*AUTO, "--output_dir", tmp_path / "run", "--plan-only",
                  "--probe_memory_limit_gb=0.001")
    assert r.returncode == 2
    assert "does not fit with micro-batch 1 at seq_len 128" in r.stderr
    assert "Traceback" not in r.stderr


def torchrun2(*args, env_extra):
    env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR, **env_extra)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           "2", "train_fp8.py", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_two_ranks_that_fit_different_sizes_agree_on_the_smaller(tmp_path):
    """Rank 1 is given a fifth of rank 0's memory: both plan with rank 1's fit (the minimum),
    the target still holds, and nobody hangs."""
    one = tmp_path / "one"
    r1 = run_train(*AUTO, "--output_dir", one, "--plan-only", "--target_effective_batch_size=128",
                   env={autobatch.LIMIT_ENV: "0.05"})
    small_fit = probe_file(one)[0]["fitted_micro_batch"]
    two = tmp_path / "two"
    r = torchrun2(*AUTO, "--output_dir", two, "--max_steps=2", "--warmup_steps=1",
                  "--target_effective_batch_size=128",
                  env_extra={autobatch.LIMIT_ENV: "0.25,0.05"})
    assert r.returncode == 0 and r1.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("batch plan:") == 1  # rank 0 prints
    derived = yaml.safe_load(open(two / "config.yaml"))["derived"]
    micro, accum = derived["micro_batch_size"], derived["gradient_accumulation_steps"]
    assert micro * accum * 2 == 128
    assert micro == max(d for d in range(1, small_fit + 1) if 64 % d == 0)
    assert f"fitted micro {small_fit} of max 64" in r.stdout


def test_a_rank_whose_probe_fails_stops_every_rank(tmp_path):
    """Rank 1 cannot even read its budget: both ranks stop with rank 1's error instead of
    rank 0 waiting for it forever."""
    r = torchrun2(*AUTO, "--output_dir", tmp_path / "run", "--plan-only",
                  env_extra={autobatch.LIMIT_ENV: "0.25,not-a-number"})
    assert r.returncode != 0
    assert r.stderr.count("batch discovery failed on rank 1: ValueError") == 2


def test_plan_only_in_manual_mode_prints_the_plan_and_scaled_lr(tmp_path):
    from conftest import tiny_args
    out = tmp_path / "run"
    r = run_train(*tiny_args(out), "--dry_run", "--lr_scaling=sqrt",
                  "--lr_reference_batch_size=64")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "batch plan: micro 8 × accum 2 × 1 device = 16 sequences" in r.stdout
    assert "learning rate: 0.003 × sqrt(16/64) = 0.0015 (lr_scaling: sqrt)" in r.stdout
    assert "not training" in r.stdout and not (out / "metrics.jsonl").exists()


def test_scaled_lr_is_the_peak_the_schedule_reaches(tmp_path):
    from conftest import tiny_args
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, max_steps=8, warmup_steps=4, log_interval=4),
                  "--lr_scaling=linear", "--lr_reference_batch_size=32")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in open(out / "metrics.jsonl") if "train/lr" in x]
    assert rows[0]["step"] == 4 and rows[0]["train/lr"] == pytest.approx(3e-3 * 16 / 32)
    derived = yaml.safe_load(open(out / "config.yaml"))["derived"]
    assert derived["peak_learning_rate"] == pytest.approx(1.5e-3)


def test_activation_checkpointing_is_turned_on_only_when_nothing_fits_without_it(tmp_path):
    """0.018 GB: micro-batch 1 of the tiny model (18 MB measured) does not fit, but it does
    with recomputed activations; at 0.1 GB it fits without, and the setting stays off."""
    r = run_train("--config=configs/test_auto_batch.yaml", f"--output_dir={tmp_path / 'a'}",
                  "--plan-only", "--probe_memory_limit_gb=0.018")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "the model does not fit with micro-batch 1" in r.stderr and \
        "trying again with activation_checkpointing on" in r.stderr
    assert "activation_checkpointing turned on: micro-batch 1 did not fit without it" in r.stdout
    r = run_train("--config=configs/test_auto_batch.yaml", f"--output_dir={tmp_path / 'b'}",
                  "--plan-only")
    assert r.returncode == 0 and "activation_checkpointing turned on" not in r.stdout
    assert "does not fit" not in r.stderr
