"""Transformer Engine's delayed-scaling state on a real GPU (skipped without CUDA, FP8 tensor
cores or transformer_engine):

- a checkpoint carries every TE layer's scales and amax history (`_extra_state`, a pickle that
  fp8train's checkpoint scan must accept), a resume restores them exactly, and a stopped and
  resumed run continues as the uninterrupted run does;
- the rollback remedy `fp8_margin + 1` (Fp8Backend.recover("margin")) is what TE's next scale
  update uses: scale = fp8_max / amax / 2^margin for every TE layer.

What TE does, from its source (transformer_engine.pytorch.quantization, TE 2.x): each FP8 cast
of a layer's input and weight (forward) and grad_output (backward) writes its amax into row 0 of
that layer's amax_history (fp8_meta["scaling_fwd"] / ["scaling_bwd"], columns input 0, weight 1,
output 2 / grad_output 0, grad_input 1). The forward update runs when the outermost autocast
exits (training, grad enabled), the backward update at the end of the backward of the first
FP8 layer of the forward; each takes amax = max over the whole history ("max") or row 0
("most_recent"), sets scale = fp8_max / amax / 2^margin with the margin of the recipe the
layers were registered under (an amax of 0 or inf keeps the scale), then rolls the history by
one row and clears row 0. fp8_max is the format's: E4M3 448 forward, E5M2 57344 backward in
the hybrid format."""
import math

import pytest
import torch
from gpu_support import (needs_corpus, needs_cuda, needs_fp8, needs_te, run_train, te_extra_states,
                         te_state_manager, train_rows, val_rows)
from support.runs import tiny_args

pytestmark = [pytest.mark.gpu, needs_cuda, needs_fp8, needs_te]

# (fp8_meta key, state-dict suffix, column, metric) of the tensors TE scales; the other columns
# (the forward output, the backward grad_input) are never cast by a plain te.Linear.
TENSORS = [("scaling_fwd", "fwd", 0, "fwd_scale_input"),
           ("scaling_fwd", "fwd", 1, "fwd_scale_weight"),
           ("scaling_bwd", "bwd", 0, "bwd_scale_grad_output")]

TE_RUN = dict(use_fp8="true", fp8_backend="te", fp8_fallback="error", fp8_layers="all",
              batch_size=8, gradient_accumulation_steps=1, seq_len=64, n_layer=2,
              warmup_steps=3, lr_decay_steps=12, log_interval=1, eval_interval=6,
              checkpoint_interval=6, eval_sequences=32, eval_samples=0)


def _filled_rows(history: torch.Tensor) -> torch.Tensor:
    """The rows of an amax history that hold an amax (any column non-zero), oldest first: TE
    appends each update's amax at the end and rolls the rest towards the front."""
    return history[(history != 0).any(dim=1)]


@needs_corpus
@pytest.mark.slow
def test_te_scales_survive_checkpoint_and_resume(tmp_path):
    """Train 6 steps with --fp8_backend=te and stop (checkpoint at step 6), resume to step 12;
    and the same 12 steps without a stop. Then:
    - every TE layer's `_extra_state` in the step-6 checkpoint passes fp8train's scan and
      unpickles to scales that have moved from TE's initial 1 and 6 filled history rows;
    - at step 7, the first step after the resume, each layer casts with exactly the saved scales
      (read from the run's fp8/<layer>/... metrics, which report the scale TE used);
    - the resumed run's step-12 history starts with the saved rows, bit for bit (restored, then
      rolled on), and has as many rows as the uninterrupted run's;
    - losses after the resume, the final val/loss and the final scales equal the uninterrupted
      run's within 1e-3 (GPU kernels may differ in summation order between processes)."""
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    first = run_train(*tiny_args(resumed, max_steps=6, **TE_RUN))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_train(*tiny_args(resumed, max_steps=12, **TE_RUN), "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "at step 6" in second.stdout, second.stdout[-2000:]
    whole = run_train(*tiny_args(straight, max_steps=12, **TE_RUN))
    assert whole.returncode == 0, whole.stderr[-3000:]

    ckpts = resumed / "checkpoints"
    saved = te_extra_states(ckpts / "step_0000006")
    after = te_extra_states(ckpts / "step_0000012")
    reference = te_extra_states(straight / "checkpoints" / "step_0000012")
    assert len(saved) == 8 and saved.keys() == after.keys() == reference.keys(), saved.keys()

    rows = {row["step"]: row for row in train_rows(resumed)}
    straight_rows = {row["step"]: row for row in train_rows(straight)}
    assert sorted(rows) == sorted(straight_rows) == list(range(1, 13))
    logged = {key.split("/")[1] for key in rows[7] if key.startswith("fp8/") and
              key.count("/") == 2}   # fp8/<layer>/<metric>; the aggregates have one "/"
    for layer, state in saved.items():
        # The state dict's module path and the layer name the metrics use (the same unless a
        # wrapper adds a prefix).
        names = [n for n in logged if layer == n or layer.endswith("." + n)]
        assert len(names) == 1, (layer, sorted(logged))
        name = names[0]
        for _, kind, col, metric in TENSORS:
            scale = state[f"scale_{kind}"][col].item()
            assert scale != 1.0 and math.isfinite(scale), (layer, metric, scale)
            # The scale the resumed run cast with at step 7 is the one saved at step 6 ...
            assert rows[7][f"fp8/{name}/{metric}"] == scale, (layer, metric)
            # ... and the one the uninterrupted run cast with at step 7.
            assert straight_rows[7][f"fp8/{name}/{metric}"] == pytest.approx(scale, rel=1e-3)
        for kind in ("fwd", "bwd"):
            old = _filled_rows(state[f"amax_history_{kind}"])
            new = _filled_rows(after[f"amax_history_{kind}"])
            ref = _filled_rows(reference[f"amax_history_{kind}"])
            assert len(old) == 6 and len(new) == len(ref) == 12, (layer, kind, len(old),
                                                                  len(new), len(ref))
            assert torch.equal(new[:6], old), (layer, kind)
            torch.testing.assert_close(new, ref, rtol=1e-3, atol=0)
            torch.testing.assert_close(after[f"scale_{kind}"], reference[f"scale_{kind}"],
                                       rtol=1e-3, atol=0)
    for step in range(7, 13):
        assert rows[step]["train/loss"] == pytest.approx(straight_rows[step]["train/loss"],
                                                         rel=1e-3), step
    assert val_rows(resumed)[-1]["val/loss"] == pytest.approx(
        val_rows(straight)[-1]["val/loss"], rel=1e-3)


def _snapshot(backend) -> dict:
    return {name: {key: (m.fp8_meta[key].amax_history.clone(), m.fp8_meta[key].scale.clone())
                   for key in ("scaling_fwd", "scaling_bwd")}
            for name, m in backend.modules.items()}


def test_te_margin_remedy_is_used_by_the_next_scale_update():
    """Drive the te backend as the training loop does (convert, forward in
    backend.forward_context(training=True) under bf16 autocast, backward, after_backward) on
    three 256 x 256 Linears, with inputs and output gradients that shrink every step so that the
    window maximum of the amax history, not the latest amax, sets the scale. After each step,
    every layer's input, weight and grad_output scale must be fp8_max / amax / 2^margin, with
    amax the history's maximum over the window the update saw (the rows before the step plus
    the amax the step added). Three steps at fp8_margin 0, then backend.recover("margin") (the
    rollback remedy), then three steps that must use margin 1: the running layers were
    registered with TE under the recipe they first saw, so the remedy only works if it changes
    that recipe's margin."""
    from torch import nn

    from fp8train.config.load import Config
    from fp8train.precision import build_precision
    from fp8train.precision.scaling import FORMATS, FP8_MAX
    dev = torch.device("cuda")
    cfg = Config(use_fp8=True, fp8_backend="te", fp8_fallback="error", fp8_layers="all")
    backend = build_precision(cfg, dev, warn=pytest.fail)
    assert backend.fp8 and backend.label == "te", backend.name
    fwd_dtype, bwd_dtype = FORMATS[cfg.fp8_format]
    fp8_max = {"scaling_fwd": FP8_MAX[fwd_dtype], "scaling_bwd": FP8_MAX[bwd_dtype]}
    assert fp8_max == {"scaling_fwd": 448.0, "scaling_bwd": 57344.0}   # hybrid: E4M3, E5M2

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 256)).to(dev)
    model = backend.convert(model)
    assert len(backend.modules) == 3
    manager = te_state_manager()
    try:
        def step(k: int) -> None:
            x = torch.randn(128, 256, device=dev) * (4.0 - 0.5 * k)
            g = torch.randn(128, 256, device=dev) * (2.0 - 0.25 * k)
            with torch.autocast("cuda", dtype=torch.bfloat16), \
                    backend.forward_context(training=True):
                y = model(x)
            (y.float() * g).sum().backward()
            backend.after_backward()
            model.zero_grad(set_to_none=True)

        def check(before: dict, after: dict, margin: int, k: int) -> None:
            for name in after:
                for key, _, col, metric in TENSORS:
                    old_hist, _ = before[name][key]
                    new_hist, new_scale = after[name][key]
                    amax = torch.maximum(old_hist[:, col].max(), new_hist[:, col].max())
                    assert amax > 0, (name, metric, k)
                    expected = torch.tensor(fp8_max[key], device=dev) / amax / 2.0 ** margin
                    torch.testing.assert_close(
                        new_scale[col], expected, rtol=1e-6, atol=0,
                        msg=lambda m: f"{name} {metric} at step {k}, margin {margin} "
                                      f"(recipe margin {backend.recipe.margin}): {m}")

        step(0)   # TE creates each layer's state on its first FP8 forward
        for k in range(1, 4):
            before = _snapshot(backend)
            step(k)
            check(before, _snapshot(backend), margin=0, k=k)
        what = backend.recover("margin")
        assert what == "fp8_margin 0 -> 1" and backend.margin() == 1, what
        for k in range(4, 7):
            before = _snapshot(backend)
            step(k)
            check(before, _snapshot(backend), margin=1, k=k)
    finally:
        manager.reset()   # forget this model in TE's process-wide amax buffers


def test_the_loss_gap_check_leaves_tes_amax_history_alone():
    """fp8_check_interval's forward (train/fp8_check.py) between two training steps of three TE
    Linears under delayed scaling: every layer's amax history and scales are bit for bit what
    they were, the layers still mark their FP8 state for the checkpoint, and the check's loss
    differs from the FP8 forward's by little (the same inputs and weights)."""
    from torch import nn

    from fp8train.config.load import Config
    from fp8train.precision import build_precision
    from fp8train.train.fp8_check import LossGapCheck
    dev = torch.device("cuda")
    cfg = Config(use_fp8=True, fp8_backend="te", fp8_fallback="error", fp8_layers="all",
                 fp8_check_interval=1)
    backend = build_precision(cfg, dev, warn=pytest.fail)
    torch.manual_seed(0)
    model = backend.convert(nn.Sequential(nn.Linear(256, 256), nn.GELU(),
                                          nn.Linear(256, 256)).to(dev))
    x, target = torch.randn(128, 256, device=dev), torch.randn(128, 256, device=dev)

    def loss_fn(a, b):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(a).float(), b)
        return loss, loss, None

    manager = te_state_manager()
    try:
        for _ in range(2):
            with backend.forward_context(training=True):
                loss_fn(x, target)[0].backward()
            backend.after_backward()
        before = _snapshot(backend)
        check = LossGapCheck(cfg, backend, None, dev)
        check.high_precision(loss_fn, x, target)
        after = _snapshot(backend)
        for name in before:
            for key in ("scaling_fwd", "scaling_bwd"):
                assert all(a.equal(b) for a, b in zip(before[name][key], after[name][key])), \
                    (name, key)
        assert all(m.fp8_meta["fp8_checkpoint"] for m in backend.modules.values())
        with torch.no_grad(), backend.forward_context(training=True):
            fp8 = loss_fn(x, target)[1]
        gap, high = check.gap_tensor(fp8).tolist()
        assert abs(gap) < 0.05 * high, (gap, high)
    finally:
        manager.reset()
