"""FSDP2 all-gathers the torchao tensorwise weights in FP8 (key fp8_fsdp_all_gather), over NCCL,
in the real trainer (skipped without FP8 tensor cores or without torchao).

One GPU: `accelerate launch` with the FSDP2 config and one process runs the wrapper tensors,
the parameter mapping and `_scaled_mm` on the gathered FP8 weights, and trains like the same
run without FSDP (within 3%). The rest needs two GPUs (skipped with fewer):

`accelerate launch --config_file accelerate_configs/fsdp_8xh100.yaml --num_processes 2` runs the
tiny model in bf16 with --fp8_backend=torchao, once with the FP8 all-gather (the default under
FSDP2) and once with fp8_fsdp_all_gather=false (the weights gathered in bf16, then cast to FP8
by each layer). This file is also the driver those processes run: it wraps the all-gather that
FSDP2 calls to count its bytes, and torchao's `fsdp_pre_all_gather` to see whether each weight
shard's cast had a precomputed scale, then runs `fp8train.train.cli.main` (nothing of Accelerate is
mocked here: on CUDA it shards with FSDP2 itself).

- Bytes: the two runs issue the same all-gathers; each Block's carries its converted weights at
  1 byte per element instead of bf16's 2, everything else unchanged.
- Scales: none precomputed before the first optimizer step, every cast after it uses one.
- Numerics: the FP8 all-gather casts each fp32 master shard with the scale of the whole weight,
  the bf16 gather casts the bf16-rounded weight: one rounding fewer, so not bit-identical.
  Emulated on CPU with the same model and settings, the two runs' losses differed by up to 0.5%
  (train) and 1% (val) after 12 steps; asserted: within 3%.
- Resume: 6 steps, a sharded checkpoint (the converted weights are torchao's wrapper tensors
  inside FSDP2's DTensors), a resume to step 12 ends where the uninterrupted run ends (1e-3).
- compile: true trains with the FP8 all-gather and stays within 3% of the eager run.
"""
import json
import os
import subprocess
import sys

import pytest
import yaml

if __name__ == "__main__":   # run by the launcher as a script: tests/ (support/) is one level up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_support import (free_port, needs_corpus, needs_cuda, needs_fp8,  # noqa: E402
                         needs_torchao, needs_two_gpus, offline_environ, run_train, train_rows,
                         val_rows)
from support.runs import ROOT, tiny_args  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow, needs_cuda, needs_corpus, needs_fp8,
              needs_torchao]

WORLD, STEPS = 2, 12
RUN = dict(use_fp8="true", fp8_backend="torchao", fp8_fallback="error", fp8_layers="all",
           precision="bf16", batch_size=8, gradient_accumulation_steps=1, seq_len=64,
           n_layer=2, learning_rate=1e-3, warmup_steps=3, lr_decay_steps=STEPS, log_interval=3,
           eval_interval=6, checkpoint_interval=6, eval_sequences=32, eval_samples=0)


def _launch(out_dir, run_dir, *extra, steps=STEPS, world=WORLD) -> subprocess.CompletedProcess:
    """`accelerate launch` of the FSDP2 config with `world` processes (one process is FSDP2 too:
    Accelerate launches FSDP through torchrun whatever the count)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           "accelerate_configs/fsdp_8xh100.yaml", "--num_processes", str(world),
                           "--main_process_port", str(free_port()),
                           "tests/gpu/test_fsdp_fp8_all_gather.py", str(out_dir),
                           *tiny_args(run_dir, max_steps=steps, **RUN), *extra],
                          cwd=ROOT, env=offline_environ(), capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """run(name, *extra) -> (run directory, [what each rank recorded]), made once per module."""
    tmp = tmp_path_factory.mktemp("fsdp_fp8_gpu")
    done = {}

    def run(name, *extra):
        if name not in done:
            r = _launch(tmp / f"{name}-ranks", tmp / name, *extra)
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
            ranks = [json.loads((tmp / f"{name}-ranks" / f"rank{i}.json").read_text())
                     for i in range(WORLD)]
            done[name] = (tmp / name, ranks, r.stdout)
        return done[name]

    return run


def _losses(run_dir) -> dict:
    return {row["step"]: row["train/loss"] for row in train_rows(run_dir)}


def test_one_process_fsdp2_gathers_fp8_weights_and_trains_like_the_run_without_fsdp(tmp_path):
    r = _launch(tmp_path / "ranks", tmp_path / "fsdp", world=1)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "FSDP2 all-gathers the weights in FP8" in r.stdout
    rank = json.loads((tmp_path / "ranks" / "rank0.json").read_text())
    first = rank["casts_before_first_step"]
    assert rank["rc"] == 0 and rank["fp8_weight_elements_per_block"] > 0
    assert first >= 8 and all(rank["precomputed"][first:]) and len(rank["precomputed"]) > first
    derived = yaml.safe_load(open(tmp_path / "fsdp" / "config.yaml"))["derived"]
    assert derived["fp8"] == "torchao" and derived["fp8_fsdp_all_gather"] is True
    plain = run_train(*tiny_args(tmp_path / "plain", max_steps=STEPS, **RUN))
    assert plain.returncode == 0, plain.stderr[-3000:]
    a, b = _losses(tmp_path / "fsdp"), _losses(tmp_path / "plain")
    assert sorted(a) == sorted(b) == [3, 6, 9, 12]
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=3e-2), (step, a, b)


@needs_two_gpus
def test_fp8_all_gather_halves_the_weight_bytes_and_trains_like_the_bf16_gather(runs):
    fp8_dir, fp8_ranks, stdout = runs("fp8")
    bf16_dir, bf16_ranks, _ = runs("bf16-gather", "--fp8_fsdp_all_gather=false")
    assert "FSDP2 all-gathers the weights in FP8" in stdout
    for fp8, bf16 in zip(fp8_ranks, bf16_ranks):
        assert fp8["rc"] == bf16["rc"] == 0
        weights = fp8["fp8_weight_elements_per_block"]
        assert len(fp8["gathers"]) == len(bf16["gathers"])
        saved = [b - a for a, b in zip(fp8["gathers"], bf16["gathers"])]
        assert set(saved) == {0, weights}, (fp8["gathers"], bf16["gathers"])   # 2 bytes -> 1
        assert saved.count(weights) >= 2 * 2 * STEPS
        first = fp8["casts_before_first_step"]
        assert first >= 8 and not any(fp8["precomputed"][:first])
        assert all(fp8["precomputed"][first:]) and bf16["precomputed"] == []
    a, b = _losses(fp8_dir), _losses(bf16_dir)
    assert sorted(a) == sorted(b) == [3, 6, 9, 12]
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=3e-2), (step, a, b)
    assert a[12] < a[3]
    assert val_rows(fp8_dir)[-1]["val/loss"] == pytest.approx(
        val_rows(bf16_dir)[-1]["val/loss"], rel=3e-2)


@needs_two_gpus
def test_fp8_all_gather_resumes_from_a_sharded_checkpoint(runs, tmp_path):
    straight, _, _ = runs("fp8")
    resumed = tmp_path / "resumed"
    r = _launch(tmp_path / "first", resumed, steps=6)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    r = _launch(tmp_path / "second", resumed, "--resume")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 6" in r.stdout, r.stdout[-2000:]
    a, b = _losses(resumed), _losses(straight)
    for step in (9, 12):
        assert a[step] == pytest.approx(b[step], rel=1e-3), (step, a, b)


@needs_two_gpus
def test_fp8_all_gather_under_compile(runs):
    eager, _, _ = runs("fp8")
    compiled, ranks, _ = runs("fp8-compiled", "--compile=true")
    assert all(all(r["precomputed"][r["casts_before_first_step"]:]) for r in ranks)
    a, b = _losses(compiled), _losses(eager)
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=3e-2), (step, a, b)


# --- the driver: run by the launcher, one process per rank --------------------------------------

def _drive(out_dir: str, argv: list) -> int:
    sys.path.insert(0, str(ROOT))
    import accelerate
    import torch
    import torch.distributed as dist
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Wrapped

    from fp8train.precision import ao
    from fp8train.train.cli import main

    seen = dict(gathers=[], precomputed=[])

    def counted(gather):
        def watched(output_tensor, input_tensor, *args, **kw):
            seen["gathers"].append(input_tensor.numel() * input_tensor.element_size())
            return gather(output_tensor, input_tensor, *args, **kw)
        return watched

    # FSDP2's default all-gather: all_gather_single in recent torch, all_gather_into_tensor
    # before it.
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            setattr(dist, name, counted(getattr(dist, name)))

    pre_gather = Wrapped.fsdp_pre_all_gather

    def watched_pre_gather(self, mesh):
        seen["precomputed"].append(self._precomputed_scale is not None)
        return pre_gather(self, mesh)

    Wrapped.fsdp_pre_all_gather = watched_pre_gather
    prepare = accelerate.Accelerator.prepare

    def watched_prepare(self, *objs, **kw):
        model = next(o for o in objs if isinstance(o, torch.nn.Module))
        seen["fp8_weight_elements_per_block"] = sum(
            p.numel() for p in model.blocks[0].parameters() if isinstance(p, Wrapped)) // \
            int(os.environ["WORLD_SIZE"])
        return prepare(self, *objs, **kw)

    accelerate.Accelerator.prepare = watched_prepare
    step = ao.TorchAO.after_optimizer_step

    def watched_step(self):
        seen.setdefault("casts_before_first_step", len(seen["precomputed"]))
        step(self)

    ao.TorchAO.after_optimizer_step = watched_step
    rc = main(argv)
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as fh:
        json.dump(dict(seen, rc=rc), fh)
    return rc


if __name__ == "__main__":
    sys.exit(_drive(sys.argv[1], sys.argv[2:]))
