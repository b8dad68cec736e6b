"""scripts/bench.py --quick on CPU: the harness end to end (real train_fp8.py runs on the
synthetic stream, the probe's micro-batch, FP8 layer counts, the tables); scripts/bench_loss.py
at a small size. They check the harnesses, not speed: CPU numbers say nothing about a GPU."""


import json
import math
import subprocess
import sys

import pytest
from support.runs import ROOT


def test_bench_quick_writes_results_for_every_configuration(tmp_path):
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, "scripts/bench.py", "--quick", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads((out / "results.json").read_text())
    rows = report["results"]
    assert [(x["preset"], x["precision"], x["compile"]) for x in rows] == [
        ("tiny", "fp32", False), ("tiny", "native", False), ("tiny", "torchao", False)]
    for x in rows:
        assert x["status"] == "ok" and x["tokens_per_sec"] > 0 and x["step_time_ms"] > 0
        # the first step (its start-up included) and the optimizer step, beside the step time
        assert x["first_step_s"] > 0 and 0 < x["optimizer_ms"] < x["step_time_ms"]
        assert x["micro_batch"] == 4 and x["steps"] == 3            # from the probe, cap 4
        assert math.isfinite(x["loss"]) and 9.0 < x["loss"] < 11.5  # ln(50257) = 10.8 at start
    assert [x["fp8_layers"] for x in rows] == [0, 16, 16]
    assert [x["fp8_used"] for x in rows][1:] == ["native (emulated on CPU)",
                                                 "torchao (emulated on CPU)"]
    assert report["environment"]["torch_version"] and "fp32" in (out / "results.md").read_text()
    assert not (out / "runs").exists() or not any((out / "runs").iterdir())  # cleaned up
    assert "wrote" in r.stdout and "| tiny | native | off | adamw | 4 |" in r.stdout
    # One probe for the preset (eager, in the base precision), used by every configuration.
    (probe,) = report["probes"]
    assert (probe["preset"], probe["precision"], probe["status"], probe["micro_batch"]) == \
        ("tiny", "fp32", "ok", 4)
    assert "probe tiny (fp32): micro-batch 4" in (out / "results.md").read_text()


def test_bench_rejects_steps_that_are_not_whole_warmup_intervals():
    r = subprocess.run([sys.executable, "scripts/bench.py", "--steps", "5", "--warmup", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--steps must be a positive multiple of --warmup" in r.stderr


def test_bench_loss_prints_both_losses_equal_and_the_chunked_one_smaller(tmp_path):
    """scripts/bench_loss.py at a small size: each variant in its own process, the same loss,
    the chunked loss's peak memory below the plain one's (4 chunks of 64 rows here)."""
    out = tmp_path / "loss.json"
    r = subprocess.run([sys.executable, "scripts/bench_loss.py", "--vocab", "32768", "--tokens",
                        "256", "--hidden", "32", "--chunk-tokens", "64", "--steps", "1",
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "chunked / plain: time" in r.stdout
    plain, chunked = json.loads(out.read_text())["results"]
    assert (plain["variant"], chunked["variant"]) == ("plain", "chunked")
    assert chunked["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert chunked["peak_extra_mb"] < plain["peak_extra_mb"]
