"""Transformer Engine's current and block scaling recipes (fp8_recipe: current | block) on a real
GPU. One command on a machine with one H100 (or any GPU of compute capability 8.9+ for current;
block scaling needs 9.0 and CUDA 12.9, and is skipped with TE's own reason elsewhere):

    python -m pytest -q tests/gpu/test_gpu_te_recipes.py

(skipped without CUDA, FP8 tensor cores, transformer_engine or the tinyshakespeare corpus).

- the scales fp8train reports are the ones TE casts with: TE's own quantizers (the ones te.Linear
  builds for each recipe) dequantize to exactly what fp8train's emulation gives with
  fp8train's scales (fp8_max / amax per tensor for current scaling; per 1 x 128 or 128 x 128
  tile, rounded down to a power of two, for block scaling);
- a few steps of the tiny model train with each recipe: the loss is finite and falls, the fp8/
  metrics are logged at every logged step, the checkpoints hold no `_extra_state` (these
  recipes have no state) and passes fp8train's checkpoint scan, and a run stopped at step 6 and
  resumed gives the losses of the uninterrupted run."""
import math

import pytest
import torch
import yaml
from gpu_support import (needs_corpus, needs_cuda, needs_fp8, needs_te, run_train, te_extra_states,
                         train_rows, val_rows)
from support.runs import tiny_args

pytestmark = [pytest.mark.gpu, needs_cuda, needs_fp8, needs_te]

RECIPES = ["current", "block"]


def _skip_unless_te_runs(recipe: str) -> None:
    """Skip with Transformer Engine's own reason when it says this GPU cannot run `recipe`
    (the check the trainer itself makes before it falls back or stops)."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as recipes

    from fp8train.precision.te import recipe_unavailable
    why = recipe_unavailable(te, recipes, recipe)
    if why:
        pytest.skip(f"fp8_recipe {recipe} cannot run here: {why}")


@pytest.mark.parametrize("recipe", RECIPES)
def test_reported_scales_are_the_ones_tes_quantizers_use(recipe):
    """Quantize bf16 tensors whose magnitudes span 8 decades along the last dim with TE's
    quantizer for the recipe and dequantize: the result must equal fp8train's emulation with
    the scales its metrics report (scaling.te_scale / block_scales). Block scales are powers of
    two, so the match is exact; a current scale is fp8_max / amax (one rounding), compared to
    1e-6."""
    _skip_unless_te_runs(recipe)
    import transformer_engine_torch as tex

    from fp8train.precision.scaling import E4M3, block_scales, quantize, te_scale
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(384, 512, device=dev, generator=gen) *
         torch.logspace(-4, 4, 512, device=dev)).to(torch.bfloat16)
    if recipe == "current":
        from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer
        quantizer = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, dev, rowwise=True,
                                                  columnwise=False)
        got = quantizer(x).dequantize(dtype=torch.float32)
        scale = te_scale(x.abs().amax().float(), 448.0)
        want = quantize(x, scale, E4M3).float() / scale
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        return
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    for dim, tile in ((1, (1, 128)), (2, (128, 128))):   # inputs / grads, weights
        quantizer = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False,
                                         amax_epsilon=0.0, force_pow_2_scales=True,
                                         block_scaling_dim=dim)
        got = quantizer(x).dequantize(dtype=torch.float32)
        scales = block_scales(x, tile, 448.0)
        full = scales.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)
        want = quantize(x, full, E4M3).float() / full
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{tile}: {m}")


def _run(out, recipe, **kw):
    args = dict(use_fp8="true", fp8_backend="te", fp8_recipe=recipe, fp8_fallback="error",
                fp8_layers="all", batch_size=8, gradient_accumulation_steps=1, seq_len=64,
                n_layer=2, warmup_steps=3, lr_decay_steps=12, log_interval=1, eval_interval=6,
                checkpoint_interval=6, eval_sequences=32, eval_samples=0)
    args.update(kw)
    return tiny_args(out, **args)


@needs_corpus
@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_training_checkpoint_and_resume(tmp_path, recipe):
    """12 steps straight; and 6 steps, stop, resume to 12."""
    _skip_unless_te_runs(recipe)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    whole = run_train(*_run(straight, recipe, max_steps=12))
    assert whole.returncode == 0, whole.stderr[-3000:]
    name = {"current": "Float8CurrentScaling", "block": "Float8BlockScaling"}[recipe]
    assert f"FP8 Transformer Engine: {name}(" in whole.stdout, whole.stdout[-3000:]
    derived = yaml.safe_load(open(straight / "config.yaml"))["derived"]
    assert derived["fp8"] == "te" and derived["fp8_recipe"] == recipe, derived

    rows = {row["step"]: row for row in train_rows(straight)}
    assert sorted(rows) == list(range(1, 13))
    losses = [rows[s]["train/loss"] for s in range(1, 13)]
    assert all(math.isfinite(v) for v in losses), losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses   # it learns
    for step, row in rows.items():
        for key in ("fp8/fwd_scale", "fp8/bwd_scale", "fp8/amax", "fp8/saturated",
                    "fp8/underflow"):
            assert math.isfinite(row[key]), (step, key, row.get(key))
        per_layer = {k for k in row if k.startswith("fp8/") and k.count("/") == 2}
        assert len(per_layer) == 12 * 8, (step, sorted(per_layer))   # 8 te.Linear, 12 each
        for key in per_layer:
            if "_scale_" in key and recipe == "block":   # the median tile's: a power of two
                assert math.log2(row[key]).is_integer(), (step, key, row[key])
            if key.endswith("/fwd_scale_input") and recipe == "current":
                amax = row[key.replace("fwd_scale_input", "amax_input")]
                assert row[key] * amax == pytest.approx(448.0, rel=1e-5), (step, key)
        # power-of-2 scales are at most fp8_max / amax: nothing clips
        assert recipe != "block" or row["fp8/saturated"] == 0.0, (step, row["fp8/saturated"])

    for ckpt in sorted((straight / "checkpoints").glob("step_*")):
        assert te_extra_states(ckpt) == {}, ckpt   # none, after the checkpoint scan passed
        from safetensors import safe_open
        with safe_open(str(ckpt / "model.safetensors"), framework="pt") as fh:
            # Left out: empty tensors would look shared to Accelerate's writer (one kept).
            assert not [k for k in fh.keys() if k.endswith("._extra_state")]

    first = run_train(*_run(resumed, recipe, max_steps=6))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_train(*_run(resumed, recipe, max_steps=12), "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "at step 6" in second.stdout, second.stdout[-2000:]
    again = {row["step"]: row for row in train_rows(resumed)}
    assert sorted(again) == list(range(1, 13))
    for step in range(1, 13):   # GPU kernels may sum in another order in another process
        assert again[step]["train/loss"] == pytest.approx(rows[step]["train/loss"],
                                                          rel=1e-3), step
    assert val_rows(resumed)[-1]["val/loss"] == pytest.approx(
        val_rows(straight)[-1]["val/loss"], rel=1e-3)
