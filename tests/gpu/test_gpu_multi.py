"""Two GPUs (skipped with fewer): Transformer Engine's amax reduction under DDP, and FSDP2.

- TE under DDP: `torchrun --nproc_per_node 2` runs the real trainer with --fp8_backend=te. The
  ranks train on disjoint data, so their local amaxes differ; TE all-reduces the amaxes (max)
  before every scale update (DelayedScaling(reduce_amax=True), the default fp8train builds), so
  both ranks must end with bit-identical scales and amax histories in every TE layer. Then the
  run is resumed on 2 ranks and the same holds. This file is also the driver those processes
  run (`python -m torch.distributed.run --nproc_per_node 2 tests/gpu/test_gpu_multi.py OUT
  ARGS...`, as tests/e2e/test_ddp.py does on CPU): it wraps `Accelerator.prepare` to see the model
  and each TE layer's inputs, runs `fp8train.train.cli.main`, then saves what each rank holds (rank 0
  alone writes checkpoints, so they cannot show that the ranks agree).
- TE in the batch probe: ranks whose trials differ (different memory budgets) must not meet in
  TE's amax all-reduce; the run ends with the probe's own error instead of hanging.
- FSDP2: `accelerate launch --config_file accelerate_configs/fsdp_8xh100.yaml --num_processes 2`
  trains 6 steps, stops with a sharded checkpoint, resumes to step 12, and ends where an
  uninterrupted FSDP2 run of 12 steps ends.
"""
import os
import subprocess
import sys

import pytest

if __name__ == "__main__":   # run by torchrun as a script: tests/ (support/) is one level up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_support import (free_port, needs_corpus, needs_cuda, needs_fp8, needs_te,  # noqa: E402
                         needs_two_gpus, offline_environ, train_rows, val_rows)
from support.runs import ROOT, tiny_args  # noqa: E402
from support.train_with_budgets import ENV as RANK_BUDGETS  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow, needs_cuda, needs_two_gpus, needs_corpus]

WORLD = 2
TE_DDP = dict(use_fp8="true", fp8_backend="te", fp8_fallback="error", fp8_layers="all",
              batch_size=8, gradient_accumulation_steps=1, seq_len=64, n_layer=2,
              warmup_steps=3, lr_decay_steps=12, log_interval=3, eval_interval=6,
              checkpoint_interval=6, eval_sequences=32, eval_samples=0)


def _torchrun(tmp, args) -> subprocess.CompletedProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", str(WORLD), "tests/gpu/test_gpu_multi.py",
                           str(tmp), *map(str, args)],
                          cwd=ROOT, env=offline_environ(), capture_output=True, text=True,
                          timeout=900)


def _ranks(tmp) -> list:
    import torch
    return [torch.load(tmp / f"rank{i}.pt", weights_only=False) for i in range(WORLD)]


def _assert_ranks_agree(ranks: list, when: str) -> None:
    import torch
    assert [r["rc"] for r in ranks] == [0] * WORLD, when
    te0, te1 = ranks[0]["te"], ranks[1]["te"]
    assert len(te0) == 8 and te0.keys() == te1.keys(), (when, te0.keys(), te1.keys())
    for layer in te0:
        for key in ("scaling_fwd", "scaling_bwd"):
            for part in ("scale", "amax_history"):
                a, b = te0[layer][key][part], te1[layer][key][part]
                assert torch.equal(a, b), (when, layer, key, part, a, b)
            assert (te0[layer][key]["amax_history"] != 0).any(), (when, layer, key)
    # Not vacuous: the ranks' own last inputs to the TE layers differ (disjoint data), so equal
    # scales come from the reduction.
    local0, local1 = ranks[0]["local_amax"], ranks[1]["local_amax"]
    assert local0.keys() == te0.keys()
    assert any(local0[k] != local1[k] for k in local0), (when, local0, local1)


@needs_te
@needs_fp8
@needs_two_gpus   # (the marks nearest the function are checked first: this reason first)
def test_te_ranks_reduce_amax_and_end_with_identical_scales(tmp_path):
    """2 ranks with --fp8_backend=te: every TE layer's scales and amax histories are
    bit-identical on both ranks after 6 steps, and again after resuming on 2 ranks to step 12."""
    out = tmp_path / "run"
    r = _torchrun(tmp_path / "first", tiny_args(out, max_steps=6, **TE_DDP))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"× {WORLD} devices" in r.stdout, r.stdout[-2000:]
    _assert_ranks_agree(_ranks(tmp_path / "first"), "after 6 steps")
    r = _torchrun(tmp_path / "second", [*tiny_args(out, max_steps=12, **TE_DDP), "--resume"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 6" in r.stdout, r.stdout[-2000:]
    _assert_ranks_agree(_ranks(tmp_path / "second"), "after resuming to step 12")
    assert [row["step"] for row in train_rows(out)] == [3, 6, 9, 12]


@needs_te
@needs_fp8
@needs_two_gpus
def test_te_probe_on_ranks_with_different_budgets_ends_without_a_hang(tmp_path):
    """The batch probe with --fp8_backend=te on 2 ranks whose budgets differ
    (tests/support/train_with_budgets.py: rank 0 ~1 TB, rank 1 ~1 KB, so rank 1 stops after one trial
    and rank 0 runs four). The trials must not all-reduce TE's amaxes (Precision.for_trials):
    otherwise rank 0's second trial waits in an all-reduce that rank 1, already in the probe's
    all-gather, never joins. Expected: both ranks agree that micro-batch 1 does not fit on rank
    1, try again with activation checkpointing, and stop with that one error line (exit 2 on
    each rank, which torchrun reports as a failure), within seconds, not at a timeout."""
    import signal
    out = tmp_path / "run"
    args = tiny_args(out, use_fp8="true", fp8_backend="te", fp8_fallback="error",
                     fp8_layers="all", auto_batch_size="true", target_effective_batch_size=16,
                     max_batch_size=8, gradient_accumulation_steps="null", seq_len=64,
                     n_layer=2, max_steps=4, eval_samples=0)
    env = dict(offline_environ(), **{RANK_BUDGETS: "1000,0.000001"})
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node", str(WORLD), "tests/support/train_with_budgets.py",
                             *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # torchrun and both ranks
        stdout, stderr = proc.communicate()
        pytest.fail("the 2-rank probe hung (ranks in different collectives):\n"
                    + stdout[-2000:] + stderr[-3000:])
    text = stdout + stderr
    assert proc.returncode != 0, text[-3000:]
    assert "rank 1: " in stderr and "does not fit with micro-batch 1" in stderr, text[-3000:]
    assert "trying again with activation_checkpointing on" in text, text[-3000:]


FSDP = dict(batch_size=8, gradient_accumulation_steps=1, seq_len=64, n_layer=2, warmup_steps=3,
            lr_decay_steps=12, log_interval=3, eval_interval=6, checkpoint_interval=6,
            eval_sequences=32, eval_samples=0)


def _accelerate_fsdp(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           "accelerate_configs/fsdp_8xh100.yaml", "--num_processes", str(WORLD),
                           "--main_process_port", str(free_port()), "train_fp8.py",
                           *map(str, args)],
                          cwd=ROOT, env=offline_environ(), capture_output=True, text=True,
                          timeout=900)


def test_fsdp2_run_trains_and_resumes(tmp_path):
    """accelerate_configs/fsdp_8xh100.yaml on 2 GPUs, bf16: 6 steps, a sharded checkpoint
    (torch.distributed.checkpoint), a resume to step 12; the losses after the resume and the
    final val/loss equal those of an uninterrupted 12-step FSDP2 run within 1e-3, and the loss
    fell."""
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    r = _accelerate_fsdp(*tiny_args(resumed, max_steps=6, **FSDP))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    ckpt = resumed / "checkpoints" / "step_0000006"
    assert any(p.is_dir() and p.name.startswith("pytorch_model_fsdp") for p in ckpt.iterdir()), \
        sorted(p.name for p in ckpt.iterdir())
    r = _accelerate_fsdp(*tiny_args(resumed, max_steps=12, **FSDP), "--resume")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 6" in r.stdout, r.stdout[-2000:]
    r = _accelerate_fsdp(*tiny_args(straight, max_steps=12, **FSDP))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    a = {row["step"]: row["train/loss"] for row in train_rows(resumed)}
    b = {row["step"]: row["train/loss"] for row in train_rows(straight)}
    assert sorted(a) == sorted(b) == [3, 6, 9, 12]
    for step in (9, 12):
        assert a[step] == pytest.approx(b[step], rel=1e-3), (step, a, b)
    assert b[12] < b[3], b
    assert val_rows(resumed)[-1]["val/loss"] == pytest.approx(val_rows(straight)[-1]["val/loss"],
                                                              rel=1e-3)


@needs_two_gpus
def test_fsdp2_batch_probe_fits_the_sharded_footprint(tmp_path):
    """auto_batch_size under FSDP2 on 2 GPUs, bf16, within probe_memory_limit_gb 2: the probe
    counts each trial as sharded (said once), the micro-batch it plans is larger than the same
    probe without FSDP (DDP) plans, and the FSDP2 run's measured peak (summary.json's
    peak_memory_gb, torch's max allocated) stays within the limit."""
    import json
    args = ["--config=configs/test_auto_batch.yaml", "--n_layer=8", "--n_embd=768",
            "--seq_len=256", "--probe_memory_limit_gb=2", "--target_effective_batch_size=256",
            "--max_batch_size=256", "--batch_timing_budget_s=0.01", "--max_steps=4",
            "--eval_interval=4", "--checkpoint_interval=4", "--eval_sequences=8",
            "--eval_samples=0"]
    fsdp = _accelerate_fsdp(*args, f"--output_dir={tmp_path / 'fsdp'}")
    assert fsdp.returncode == 0, fsdp.stdout[-2000:] + fsdp.stderr[-3000:]
    assert fsdp.stdout.count("batch discovery under FSDP2 (2 ranks)") == 1, fsdp.stdout[-3000:]
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", str(WORLD), "train_fp8.py", *args,
                          f"--output_dir={tmp_path / 'ddp'}"],
                         cwd=ROOT, env=offline_environ(), capture_output=True, text=True,
                         timeout=900)
    assert ddp.returncode == 0, ddp.stdout[-2000:] + ddp.stderr[-3000:]
    plans = {m: json.load(open(tmp_path / m / "summary.json")) for m in ("fsdp", "ddp")}
    assert plans["fsdp"]["batch"]["micro_batch_size"] > plans["ddp"]["batch"]["micro_batch_size"]
    assert plans["fsdp"]["peak_memory_gb"] <= 2.0, plans["fsdp"]


# --- the driver: run by torchrun, one process per rank -------------------------------------------

def _drive(out_dir: str, argv: list) -> int:
    sys.path.insert(0, str(ROOT))
    import accelerate
    import torch

    from fp8train.train.cli import main

    seen = dict(model=None, local_amax={})

    def te_layers(model):
        return {name: m for name, m in model.named_modules()
                if isinstance(getattr(m, "fp8_meta", None), dict)}

    def remember_input(name):
        def hook(module, inputs):
            if module.training and torch.is_grad_enabled():
                seen["local_amax"][name] = inputs[0].detach().abs().amax().float().item()
        return hook

    prepare = accelerate.Accelerator.prepare

    def watched_prepare(self, *objs, **kw):
        result = prepare(self, *objs, **kw)
        for obj in result if isinstance(result, tuple) else (result,):
            if isinstance(obj, torch.nn.Module) and seen["model"] is None:
                seen["model"] = obj
                inner = getattr(obj, "module", obj)
                for name, m in te_layers(inner).items():
                    m.register_forward_pre_hook(remember_input(name))
        return result

    accelerate.Accelerator.prepare = watched_prepare
    rc = main(argv)
    te = {}
    if seen["model"] is not None:
        inner = getattr(seen["model"], "module", seen["model"])
        for name, m in te_layers(inner).items():
            if "scaling_fwd" in m.fp8_meta:
                te[name] = {key: dict(scale=m.fp8_meta[key].scale.detach().cpu().clone(),
                                      amax_history=m.fp8_meta[key].amax_history.detach().cpu()
                                      .clone())
                            for key in ("scaling_fwd", "scaling_bwd")}
    torch.save(dict(rc=rc, te=te, local_amax=dict(seen["local_amax"])),
               os.path.join(out_dir, f"rank{os.environ['RANK']}.pt"))
    return rc


if __name__ == "__main__":
    sys.exit(_drive(sys.argv[1], sys.argv[2:]))
