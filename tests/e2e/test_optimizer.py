"""Muon in real runs: with FP8 (native, emulated) and gradient accumulation, a run stopped and
resumed from its checkpoint (Muon's momentum, AdamW's moments, the FP8 scales) ends bit for bit
where an uninterrupted one does, and the log says which optimizer trains what."""
import json
import os

from safetensors.torch import load_file
from support.runs import run_train, tiny_args

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
