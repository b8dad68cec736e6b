"""fp8_check_interval end to end (fp8train/train/fp8_check.py): real CPU runs of the native
backend, FP8 emulated. A healthy run logs a small fp8/loss_gap and trains bit for bit as the
same run unchecked; a deliberately broken FP8 (the broken_fp8 fault of support/faults.py: E5M2
in the forward and 16 more bits of margin) gives a large gap, warned about once or remedied;
two processes over gloo both take part. Unit tests: tests/unit/test_fp8_check.py."""
import json
import os
import subprocess

import pytest
import safetensors.torch
from support.runs import DATA_DIR, ROOT, TORCHRUN, rows, run_train, tiny_args, untimed

FP8 = dict(use_fp8="true", fp8_backend="native")


def summary(out):
    return json.loads((out / "summary.json").read_text())


def final_weights(out):
    return safetensors.torch.load_file(str(out / "checkpoints" / "step_0000012" /
                                           "model.safetensors"))


@pytest.fixture(scope="module")
def unchecked(tmp_path_factory):
    out = tmp_path_factory.mktemp("unchecked") / "run"
    r = run_train(*tiny_args(out, **FP8))
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_a_healthy_run_logs_a_small_gap_and_trains_as_the_unchecked_run(tmp_path, unchecked):
    """Every 2nd step of 12: six rows with |gap| under half of fp8_max_loss_gap's default
    (0.05 nats; measured 3e-5 to 2e-4, and 0.012 at one step in processes of one thread), the
    relative gap beside each; training and evaluation bit for bit those of the same run without
    the check, final weights included; the summary counts the checks and prints them."""
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, fp8_check_interval=2, **FP8))
    assert r.returncode == 0, r.stderr[-3000:]
    gaps = rows(out, "fp8/loss_gap")
    assert [g["step"] for g in gaps] == [2, 4, 6, 8, 10, 12]
    assert all(abs(g["fp8/loss_gap"]) < 0.025 and g["fp8/loss_gap"] != 0 for g in gaps), gaps
    assert all(g["fp8/loss_gap_rel"] == pytest.approx(g["fp8/loss_gap"] / 3.5, rel=0.5)
               for g in gaps)
    same = [[untimed(x) for x in rows(o, key)] for o in (out, unchecked) for key in ("train/loss",
                                                                           "val/loss")]
    assert same[:2] == same[2:]
    a, b = final_weights(out), final_weights(unchecked)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    gap = summary(out)["fp8_loss_gap"]
    assert gap["checks"] == 6 and gap["last"] == gaps[-1]["fp8/loss_gap"]
    assert abs(gap["max"]) == max(abs(g["fp8/loss_gap"]) for g in gaps)
    assert summary(unchecked)["fp8_loss_gap"] is None
    assert "summary: FP8 - fp32 loss on the same batch: last" in r.stdout
    assert "FP8 is hurting" not in r.stderr


def broken(out, **keys):
    args = tiny_args(out, fp8_margin=16, fp8_check_interval=2, fp8_gap_window=2,
                     fp8_max_loss_gap=0.02, **FP8, **keys)
    r = run_train(*args, env={"FP8TRAIN_FAULTS": "broken_fp8@16"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r, [g["fp8/loss_gap"] for g in rows(out, "fp8/loss_gap")]


def test_a_broken_fp8_gives_a_large_gap_warned_about_once(tmp_path):
    """E5M2 forward, scales 2^32 too small: the gap is far beyond a healthy run's (tens of
    times), two checks in a row past 0.02 are warned about, once, with what to do; FP8 stays on
    (fp8_gap_action: warn)."""
    r, gaps = broken(tmp_path / "run")
    assert len(gaps) == 6 and max(abs(g) for g in gaps) > 0.05, gaps
    warned = [line for line in r.stderr.splitlines() if "FP8 is hurting this model" in line]
    assert len(warned) == 1, r.stderr
    assert "fp8_max_loss_gap 0.02 at 2 checks in a row" in warned[0]
    assert "fp8_gap_action: recover" in warned[0]
    assert "FP8 switched off" not in r.stdout + r.stderr


def test_fp8_gap_action_recover_applies_the_remedy_and_the_checks_stop(tmp_path):
    """fp8_gap_action: recover with fp8_recovery: bf16: FP8 is switched off where the window
    fills, said in the log and in a row (recovery/fp8_on 0); no check runs after it; the
    summary says FP8 was switched off, and why."""
    out = tmp_path / "run"
    r, gaps = broken(out, fp8_gap_action="recover", fp8_recovery="bf16")
    assert "FP8 switched off" in r.stderr, r.stderr
    off = [x for x in rows(out, "recovery/fp8_on")]
    assert len(off) == 1 and off[0]["recovery/fp8_on"] == 0
    assert all(x["step"] <= off[0]["step"] for x in rows(out, "fp8/loss_gap"))
    assert len(gaps) < 6
    assert "switched off for its loss gap" in summary(out)["fp8"]


def test_two_processes_both_take_part_in_the_check(tmp_path):
    """torchrun, 2 CPU processes over gloo, a check every 3rd step: the run ends (no rank left
    waiting in a collective), four rows of the ranks' mean gap, small."""
    out = tmp_path / "two"
    env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR)
    r = subprocess.run([*TORCHRUN, "--nproc_per_node", "2",
                        "train_fp8.py", *tiny_args(out, batch_size=4, fp8_check_interval=3,
                                                   gradient_accumulation_steps=1, **FP8)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    gaps = rows(out, "fp8/loss_gap")
    assert [g["step"] for g in gaps] == [3, 6, 9, 12]
    assert all(abs(g["fp8/loss_gap"]) < 0.01 for g in gaps), gaps
