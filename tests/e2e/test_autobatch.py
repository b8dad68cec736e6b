"""Micro-batch discovery: the search against an injected memory model that raises a genuine
torch.OutOfMemoryError, the plan over many (target, world, fitted), the choice of the fastest
micro-batch against injected timings, and real probing and timing through train_fp8.py on CPU
(measured bytes against a budget, measured tokens/s), their cache, and two ranks that
disagree."""


import json
import os
import subprocess

import pytest
import yaml
from support.autobatch_shared import probe_file
from support.runs import DATA_DIR, ROOT, TORCHRUN, run_train
from support.train_with_budgets import ENV as RANK_BUDGETS

from fp8train.batch.speed import BUDGET_KEY, Timing, fastest

AUTO = ["--config", "configs/test_auto_batch.yaml"]


LARGEST = [*AUTO, "--batch_timing_budget_s=0"]   # the largest fit, untimed


def test_cpu_probe_plans_within_the_budget_times_the_candidates_and_caches_it(tmp_path):
    """The demo-sized model on CPU: the probe measures real steps against a 0.1 GB budget; the
    micro-batches up to the fit that divide 64 are then timed on real steps, the table is
    printed with --plan-only, cached beside the fit and written into config.yaml, and the run
    trains at the micro-batch the rule picks from the measured table."""
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

    # The timing: largest first, real tokens/s and memory, the choice by the rule.
    speed = entry["speed"]
    candidates = [d for d in range(fitted, 0, -1) if 64 % d == 0]
    assert speed["candidates"] == candidates and speed["per_rank"] == 64
    table = speed["timings"]
    assert len(table) >= 2 and [t["micro"] for t in table] == candidates[:len(table)]
    assert all(t["tokens_per_sec"] > 100 and 0 < t["peak_gb"] <= budget for t in table)
    assert [t["peak_gb"] for t in table] == sorted((t["peak_gb"] for t in table), reverse=True)
    micro = fastest([Timing(t["micro"], t["tokens_per_sec"], None) for t in table], 0.03)
    assert "batch timing: micro-batches " + ", ".join(map(str, candidates)) in r.stdout
    assert sum("tokens/s" in x and x.startswith("  micro") for x in r.stdout.splitlines()) == \
        len(table)
    assert f"micro {micro:>4} × accum" in r.stdout and "<- fastest" in r.stdout
    assert line.startswith(f"batch plan: micro {micro} × accum {64 // micro} × 1 device = 64 "
                           f"sequences (8,192 tokens) per step; fitted micro {fitted} of max 64 "
                           "(probe ")
    assert line.endswith(f"micro {micro} the fastest of {len(table)} timed" + (
        "" if micro == candidates[0] else f" (the largest, {candidates[0]}, is slower)"))
    assert "plan only" in r.stdout and not (out / "checkpoints").exists()

    # The second run trains with the cached plan and table, without probing or timing.
    r2 = run_train(*AUTO, "--output_dir", out, "--max_steps=4", "--warmup_steps=1")
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert "probing" not in r2.stdout and "batch timing: micro-batches" not in r2.stdout
    assert "batch timing (cached)" in r2.stdout
    assert f"fitted micro {fitted} of max 64 (cached in {out / 'batch_probe.json'})" in r2.stdout
    derived = yaml.safe_load(open(out / "config.yaml"))["derived"]
    assert (derived["micro_batch_size"], derived["gradient_accumulation_steps"]) == \
        (micro, 64 // micro)
    assert derived["effective_batch_size"] == 64 and derived["batch_timings"] == table

    # Any key that changes memory use misses the cache; --reprobe ignores it. Untimed
    # (batch_timing_budget_s 0), the plan is the largest micro-batch that divides the target.
    r3 = run_train(*LARGEST, "--output_dir", out, "--plan-only", "--seq_len=64")
    assert "probing" in r3.stdout and len(probe_file(out)) == 2
    assert "batch timing" not in r3.stdout
    r4 = run_train(*LARGEST, "--output_dir", out, "--plan-only", "--reprobe")
    assert "probing" in r4.stdout and len(probe_file(out)) == 2
    largest = max(d for d in range(1, fitted + 1) if 64 % d == 0)
    assert f"batch plan: micro {largest} × accum {64 // largest} × 1 device" in r4.stdout


def test_a_model_that_does_not_fit_at_all_exits_2(tmp_path):
    r = run_train(*AUTO, "--output_dir", tmp_path / "run", "--plan-only",
                  "--probe_memory_limit_gb=0.001")
    assert r.returncode == 2
    assert "does not fit with micro-batch 1 at seq_len 128" in r.stderr
    assert "Traceback" not in r.stderr


def torchrun2(*args, budgets):
    """Two ranks of train_fp8.py, rank i probing within the i-th of `budgets` (GB, comma-
    separated), installed by tests/support/train_with_budgets.py."""
    env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR, **{RANK_BUDGETS: budgets})
    return subprocess.run([*TORCHRUN, "--nproc_per_node",
                           "2", "tests/support/train_with_budgets.py", *map(str, args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


def test_two_ranks_that_fit_different_sizes_agree_on_the_smaller(tmp_path):
    """Rank 1 is given a fifth of rank 0's memory: both plan with rank 1's fit (the minimum),
    the target still holds, and nobody hangs."""
    one = tmp_path / "one"
    r1 = run_train(*AUTO, "--output_dir", one, "--plan-only", "--target_effective_batch_size=128",
                   "--probe_memory_limit_gb=0.05")
    small_fit = probe_file(one)[0]["fitted_micro_batch"]
    two = tmp_path / "two"
    r = torchrun2(*AUTO, "--output_dir", two, "--max_steps=2", "--warmup_steps=1",
                  "--target_effective_batch_size=128", budgets="0.25,0.05")
    assert r.returncode == 0 and r1.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("batch plan:") == 1  # rank 0 prints
    derived = yaml.safe_load(open(two / "config.yaml"))["derived"]
    micro, accum = derived["micro_batch_size"], derived["gradient_accumulation_steps"]
    assert micro * accum * 2 == 128
    assert f"fitted micro {small_fit} of max 64" in r.stdout
    # Both ranks timed the micro-batches up to the agreed fit that divide their 64 sequences,
    # and trained at the one the table says is fastest.
    table = derived["batch_timings"]
    timed = [t["micro"] for t in table]
    assert len(timed) >= 2 and timed == sorted(timed, reverse=True)
    assert timed[0] == max(d for d in range(1, small_fit + 1) if 64 % d == 0)
    assert all(t["accum"] * t["micro"] == 64 and t["tokens_per_sec"] > 0 for t in table)
    assert micro == fastest([Timing(t["micro"], t["tokens_per_sec"], None) for t in table],
                            0.03)


def test_a_rank_whose_probe_fails_stops_every_rank(tmp_path):
    """Rank 1 cannot even read its budget: both ranks stop with rank 1's error instead of
    rank 0 waiting for it forever."""
    r = torchrun2(*AUTO, "--output_dir", tmp_path / "run", "--plan-only",
                  budgets="0.25,not-a-number")
    assert r.returncode != 0
    assert r.stderr.count("batch discovery failed on rank 1: ValueError") == 2


def test_plan_only_in_manual_mode_prints_the_plan_and_scaled_lr(tmp_path):
    from support.runs import tiny_args
    out = tmp_path / "run"
    r = run_train(*tiny_args(out), "--dry_run", "--lr_scaling=sqrt",
                  "--lr_reference_batch_size=64")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "batch plan: micro 8 × accum 2 × 1 device = 16 sequences" in r.stdout
    assert "learning rate: 0.003 × sqrt(16/64) = 0.0015 (lr_scaling: sqrt)" in r.stdout
    assert "not training" in r.stdout and not (out / "metrics.jsonl").exists()


def test_scaled_lr_is_the_peak_the_schedule_reaches(tmp_path):
    from support.runs import tiny_args
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


def test_a_compiled_run_times_two_sizes_with_a_budget_below_one_compile(tmp_path):
    """`--compile=true --plan-only`, shrunk to one layer of 32 tokens and micro-batches 2 and 1,
    each compiled for itself (as the run compiles its one size): their timed steps take about
    0.01 s, a size's warm-up 0.3-0.4 s with a warm inductor cache and 15-20 s with a cold one,
    so the 0.25 s budget could not pay for one compile. Both sizes are timed, the compiling
    reported apart. 46 s with a cold inductor cache (most of it the probe's compiles), 8 s with
    a warm one."""
    out = tmp_path / "run"
    # One thread: this model's steps take milliseconds, which OpenMP threads waiting on each
    # other on a loaded 2-core machine turned into a quarter of a second.
    r = run_train(*AUTO, "--compile=true", "--n_layer=1", "--seq_len=32", "--max_batch_size=2",
                  "--batch_timing_budget_s=0.25", "--output_dir", out, "--plan-only",
                  env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    (entry,) = probe_file(out)
    speed = entry["speed"]
    assert entry["fitted_micro_batch"] == 2 and speed["candidates"] == [2, 1]
    table = speed["timings"]
    assert [t["micro"] for t in table] == [2, 1] and BUDGET_KEY not in \
        speed["stopped"], speed
    assert all(t["tokens_per_sec"] > 0 and t["timed_s"] > 0 and t["warmup_s"] > 0
               for t in table), table
    assert speed["timed_s"] == pytest.approx(sum(t["timed_s"] for t in table), abs=0.02)
    rows = [x for x in r.stdout.splitlines() if x.startswith("  micro")]
    assert len(rows) == 2 and all("; timed " in x and ", warm-up " in x for x in rows), rows
    assert "warm-up and compiling, not counted in the budget)" in r.stdout
    assert "<- fastest" in r.stdout and "the fastest of 2 timed" in r.stdout
