"""Muon in real runs: with FP8 (native, emulated) and gradient accumulation, a run stopped and
resumed from its checkpoint (Muon's momentum, AdamW's moments, the FP8 scales) ends bit for bit
where an uninterrupted one does, and the log says which optimizer trains what."""
import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file
from support.runs import DATA_DIR, ROOT, run_train, tiny_args

MUON = dict(optimizer="muon", use_fp8="true", fp8_backend="native", lr_decay_steps=12,
            learning_rate=3e-3, muon_lr=0.02)


def final(run_dir):
    latest = open(os.path.join(run_dir, "checkpoints", "latest")).read().strip()
    return load_file(os.path.join(run_dir, "checkpoints", latest, "model.safetensors"))


def test_muon_with_fp8_and_accumulation_resumes_bit_exact(tmp_path):
    a, b = tmp_path / "straight", tmp_path / "stopped"
    r = run_train(*tiny_args(a, max_steps=12, **MUON))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Muon" in r.stdout
    assert run_train(*tiny_args(b, max_steps=6, **MUON)).returncode == 0
    r2 = run_train(*tiny_args(b, max_steps=12, **MUON), "--resume")
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert "at step 6" in r2.stdout
    pa, pb = final(a), final(b)
    assert pa.keys() == pb.keys() and any(k.startswith("fp8_state.") for k in pa)
    for k in pa:
        assert (pa[k] == pb[k]).all(), k
    val = lambda d: [row["val/loss"] for row in map(json.loads, open(d / "metrics.jsonl"))
                     if "val/loss" in row]
    assert val(a) == val(b)


def test_fp8_until_hands_the_cool_down_to_the_base_precision_and_resumes_bit_exact(tmp_path):
    """fp8_until 0.5 of a 12-step schedule: FP8 for steps 1-6, fp32 after, said once; a run
    stopped after the hand-over (step 8) and resumed ends where the straight one does; the
    summary splits the tokens."""
    until = dict(use_fp8="true", fp8_backend="native", lr_decay_steps=12, fp8_until=0.5,
                 log_interval=2)
    a, b = tmp_path / "straight", tmp_path / "stopped"
    r = run_train(*tiny_args(a, max_steps=12, **until))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("fp8_until: step 6 reached after 6,144 tokens in FP8; FP8 handed "
                          "over to fp32") == 1
    rows = [json.loads(line) for line in open(a / "metrics.jsonl")]
    scaled = [row["step"] for row in rows if "fp8/fwd_scale" in row]
    assert scaled and max(scaled) <= 6                    # no FP8 statistics after the switch
    assert {"step": 6, "tokens": 6144, "fp8/on": 0} in rows
    summary = json.loads((a / "summary.json").read_text())
    assert (summary["tokens_fp8"], summary["tokens_after_fp8"]) == (6144, 6144)
    assert summary["fp8"] == "native (emulated on CPU) (until fp8_until, then fp32)"
    assert "summary: 6,144 tokens trained in FP8, then 6,144 in fp32 (fp8_until)" in r.stdout
    assert run_train(*tiny_args(b, max_steps=8, **until)).returncode == 0
    r2 = run_train(*tiny_args(b, max_steps=12, **until), "--resume")
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert "fp8_until: step" not in r2.stdout           # handed over before the checkpoint
    pa, pb = final(a), final(b)
    for k in pa:
        assert (pa[k] == pb[k]).all(), k
    assert json.loads((b / "summary.json").read_text())["tokens_fp8"] == 6144


def test_muon_under_ddp_matches_one_process(tmp_path):
    """Two gloo processes (micro 4 × accum 1 × 2) against one (micro 4 × accum 2): DDP averages
    whole gradients before Muon orthogonalises them, so the runs agree up to the bf16 rounding
    of the Newton-Schulz iteration on gradients that differ in summation order (a wrong
    split, one rank's gradient alone, would be far off)."""
    one, two = tmp_path / "one", tmp_path / "two"
    args = dict(optimizer="muon", max_steps=8, batch_size=4)
    assert run_train(*tiny_args(one, gradient_accumulation_steps=2, **args)).returncode == 0
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "train_fp8.py", *tiny_args(two, gradient_accumulation_steps=1, **args)],
                       cwd=ROOT, env=dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "batch plan: micro 4 × accum 1 × 2 devices" in r.stdout and "Muon" in r.stdout
    pa, pb = final(one), final(two)
    # bf16 orthogonalisation: a 1e-6 change of a gradient moves Newton-Schulz's output by about
    # 1% (measured), so the runs agree as a whole, not to fp32 rounding (AdamW's ~3e-6)
    for k in pa:
        assert (pa[k] - pb[k]).norm() <= 0.05 * pa[k].norm(), k
    val = lambda d: [row["val/loss"] for row in map(json.loads, open(d / "metrics.jsonl"))
                     if "val/loss" in row]
    assert val(one) == pytest.approx(val(two), rel=5e-3)
