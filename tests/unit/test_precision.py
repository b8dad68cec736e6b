"""In-process tests: FP8 numerics on CPU: the native Linear against fp32 matmuls, TE's delayed-
scaling semantics checked step by step against a plain-Python reference, the hybrid format,
layer ... The whole story, and the tests that start processes: tests/e2e/test_precision.py."""


import contextlib
import math
import os
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch
from support.precision_shared import CPU, tiny_model
from torch import nn

from fp8train.config.load import Config
from fp8train.precision import build_precision
from fp8train.precision import te as te_backend
from fp8train.precision.layers import compact_names, select_linears
from fp8train.precision.native import Fp8Linear, Fp8State, fp8_mm
from fp8train.precision.scaling import (E4M3, E5M2, FP8_MAX, quant_stats, quantize,
                                        update_delayed_scaling)
from fp8train.precision.spec import Fp8Spec


def fp8_layer(lin, **state_kw):
    state = Fp8State(["layer"], **state_kw)
    return Fp8Linear.from_linear(lin, state, 0, "layer"), state


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_native_linear_forward_and_all_gradients_match_fp32_within_fp8_error(fmt):
    torch.manual_seed(0)
    ref = nn.Linear(64, 48)
    x = torch.randn(4, 32, 64)
    g = torch.randn(4, 32, 48) * 1e-3  # gradients are small: the scale must adapt to them
    layer, state = fp8_layer(nn.Linear(64, 48), fp8_format=fmt, emulate=True)
    layer.load_state_dict(ref.state_dict())
    # One step to fill the amax history; from then on the delayed scales fit these tensors.
    for _ in range(2):
        x1 = x.clone().requires_grad_()
        y = layer(x1)
        y.backward(g)
        state.update()
        layer.zero_grad()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = layer(x1)
    y.backward(g)
    y_ref = ref(x2)
    y_ref.backward(g)
    # E4M3 has 3 mantissa bits (relative rounding error up to 1/16), E5M2 2 bits (1/8); errors
    # of many products average out, so the relative error of a whole tensor is a few percent.
    assert rel_err(y, y_ref) < 0.05
    assert rel_err(x1.grad, x2.grad) < (0.10 if fmt == "hybrid" else 0.05)
    assert rel_err(layer.weight.grad, ref.weight.grad) < (0.10 if fmt == "hybrid" else 0.05)
    assert torch.allclose(layer.bias.grad, ref.bias.grad, atol=1e-6)  # bias stays high precision
    # ... and is really quantized: not equal to fp32.
    assert rel_err(y, y_ref) > 1e-4


def test_emulated_gemm_equals_scaled_mm_on_cpu():
    """The CPU emulation (dequantize, fp32 matmul) and torch._scaled_mm agree up to summation
    order, for the three GEMM layouts the layer uses."""
    torch.manual_seed(1)
    a = quantize(torch.randn(32, 64), torch.tensor(40.0), E4M3)
    w = quantize(torch.randn(48, 64), torch.tensor(300.0), E4M3)
    g = quantize(torch.randn(32, 48) * 1e-3, torch.tensor(2.0 ** 20), E5M2)
    sa, sw, sg = torch.tensor(40.0), torch.tensor(300.0), torch.tensor(2.0 ** 20)
    cases = [(a, sa, w.t(), sw), (g, sg, w.t().contiguous().t(), sw),
             (g.t().contiguous(), sg, a.t().contiguous().t(), sa)]
    for m1, s1, m2, s2 in cases:
        real = fp8_mm(m1, s1, m2, s2, torch.float32, emulate=False, fast_accum=False)
        emu = fp8_mm(m1, s1, m2, s2, torch.float32, emulate=True, fast_accum=False)
        torch.testing.assert_close(emu, real, rtol=1e-5, atol=1e-6)


def test_native_layer_without_emulation_runs_scaled_mm_and_matches_emulation():
    torch.manual_seed(2)
    base = nn.Linear(32, 16)
    x = torch.randn(16, 32)
    outs = []
    for emulate in (False, True):
        layer, state = fp8_layer(nn.Linear(32, 16), emulate=emulate)
        layer.load_state_dict(base.state_dict())
        xi = x.clone().requires_grad_()
        layer(xi).sum().backward()
        outs.append((layer(x), xi.grad, layer.weight.grad))
    for real, emu in zip(*outs, strict=True):
        torch.testing.assert_close(emu, real, rtol=1e-5, atol=1e-6)


def test_hybrid_quantizes_gradients_as_e5m2_and_e4m3_format_does_not():
    """Half of grad_output's columns are 1e-6 of the rest: below E4M3's range relative to the
    amax (2^17) but inside E5M2's (2^31). The rows of grad_weight fed by those columns alone
    show which format the gradient went through: kept in hybrid, flushed to zero in e4m3."""
    torch.manual_seed(3)
    base = nn.Linear(32, 16, bias=False)
    x = torch.randn(16, 32)
    g = torch.randn(16, 16)
    g[:, 8:] *= 1e-6
    small_ref = g[:, 8:].t() @ x  # grad_weight rows 8..15
    small = {}
    for fmt in ("hybrid", "e4m3"):
        layer, state = fp8_layer(nn.Linear(32, 16, bias=False), fp8_format=fmt, emulate=True)
        layer.load_state_dict(base.state_dict())
        for _ in range(2):  # the second pass uses the scale learnt from the first
            layer.zero_grad()
            layer(x).backward(g)
            state.update()
        small[fmt] = layer.weight.grad[8:]
        assert state.bwd_dtype == (E5M2 if fmt == "hybrid" else E4M3)
        assert state.fp8_max[0, 2].item() == FP8_MAX[state.bwd_dtype]
    assert rel_err(small["hybrid"], small_ref) < 0.15
    assert small["e4m3"].abs().max().item() == 0.0
    amax = g.abs().max()
    u_h = quant_stats(g, FP8_MAX[E5M2] / amax, E5M2)[1].item()
    u_4 = quant_stats(g, FP8_MAX[E4M3] / amax, E4M3)[1].item()
    assert u_h == 0.0 and u_4 == pytest.approx(0.5, abs=0.02)


def reference_scales(amaxes, history_len, margin, algo, fp8_max, init=1.0):
    """TE's DelayedScaling written out plainly: the scale used at step t comes from the amaxes
    of steps t-history_len .. t-1; amax 0 keeps the previous scale."""
    scales, scale, window = [], init, []
    for a in amaxes:
        scales.append(scale)                      # the scale this step used
        window = (window + [a])[-history_len:]
        amax = max(window) if algo == "max" else window[-1]
        if amax > 0 and math.isfinite(amax):
            scale = fp8_max / amax / 2 ** margin
    return scales, scale


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("history_len,margin", [(1, 0), (3, 0), (4, 2), (16, 1)])
def test_delayed_scaling_update_matches_te_semantics(algo, history_len, margin):
    amaxes = [2.0, 8.0, 0.5, 0.0, 1.0, 0.25, 4.0, 0.125, 0.0, 0.0, 3.0]
    history = torch.zeros(history_len, 1)
    scale = torch.ones(1)
    fmax = torch.tensor([448.0])
    used = []
    for a in amaxes:
        used.append(scale.item())
        history[0] = torch.maximum(history[0], torch.tensor([a]))
        update_delayed_scaling(history, scale, fmax, margin, algo)
    expected, final = reference_scales(amaxes, history_len, margin, algo, 448.0)
    assert used == pytest.approx(expected, rel=1e-6)
    assert scale.item() == pytest.approx(final, rel=1e-6)


def test_delayed_scaling_window_forgets_old_amax():
    """With history 3 and 'max', a spike leaves the window after 3 steps."""
    history, scale, fmax = torch.zeros(3, 1), torch.ones(1), torch.tensor([448.0])
    for a in [100.0, 1.0, 1.0, 1.0]:
        history[0, 0] = a
        update_delayed_scaling(history, scale, fmax, 0, "max")
        last = scale.item()
    assert last == pytest.approx(448.0)  # 100 has dropped out
    history[0, 0] = float("inf")
    update_delayed_scaling(history, scale, fmax, 0, "most_recent")
    assert scale.item() == pytest.approx(448.0)  # a non-finite amax keeps the old scale


def test_native_layer_state_follows_the_recipe_and_saturation_is_reported():
    torch.manual_seed(4)
    layer, state = fp8_layer(nn.Linear(32, 16), history_len=4, margin=1, algo="max",
                             emulate=True)
    x = torch.randn(8, 32)
    xi = x.clone().requires_grad_()
    layer(xi).sum().backward()
    state.fold()   # the layer's records of this micro-batch into the history (after backward)
    assert state.amax_history[0, 0, 0].item() == pytest.approx(x.abs().max().item())
    assert state.amax_history[0, 0, 1].item() == pytest.approx(layer.weight.abs().max().item())
    assert state.amax_history[0, 0, 2].item() == pytest.approx(1.0)  # d(sum)/dy = 1
    state.update()
    assert state.scale[0, 0].item() == pytest.approx(448.0 / x.abs().max().item() / 2)
    assert state.scale[0, 2].item() == pytest.approx(57344.0 / 1.0 / 2)
    # An input 8x larger than the history saw saturates with margin 1; the watch reports it.
    state.watch(True)
    (layer(x * 8) * 0).sum().backward()
    stats = state.stats.collect()
    assert stats["fp8/layer/saturated_input"].item() > 0.1
    assert stats["fp8/layer/fwd_scale_input"].item() == pytest.approx(state.scale[0, 0].item())
    assert {"fp8/fwd_scale", "fp8/bwd_scale", "fp8/amax", "fp8/layer/amax_grad_output",
            "fp8/layer/bwd_scale_grad_output", "fp8/layer/underflow_grad_output"} <= set(stats)


def test_evaluation_does_not_move_the_scales():
    layer, state = fp8_layer(nn.Linear(32, 16), emulate=True)
    layer(torch.randn(4, 32)).sum().backward()
    state.update()
    before = (state.amax_history.clone(), state.scale.clone())
    with torch.no_grad():
        layer(torch.randn(4, 32) * 100)
    assert torch.equal(before[0], state.amax_history) and torch.equal(before[1], state.scale)


def test_activation_checkpoint_recompute_records_the_same_amax_once():
    from torch.utils.checkpoint import checkpoint
    layer, state = fp8_layer(nn.Linear(32, 16), history_len=4, emulate=True)
    x = torch.randn(4, 32, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    state.fold()
    assert state.amax_history[0, 0, 0].item() == pytest.approx(x.abs().max().item())
    assert (state.amax_history[1:] == 0).all()


def test_layer_selection_rules():
    model = nn.Sequential()
    model.add_module("a", nn.Linear(64, 64))
    model.add_module("odd", nn.Linear(64, 40))        # 40 % 16 != 0
    model.add_module("small", nn.Linear(16, 16))      # below the size threshold
    model.add_module("lm_head", nn.Linear(64, 128))   # excluded by default
    model.add_module("emb", nn.Embedding(10, 64))     # never a Linear
    sel = select_linears(model, min_size=1024)
    assert sel.chosen == ["a"]
    assert set(sel.skipped) == {"odd", "small", "lm_head"}
    line = sel.describe()
    assert line.startswith("FP8: converted 1/4 linear layers (a)")
    assert "odd (dims not divisible by 16)" in line and "lm_head (excluded" in line
    assert select_linears(model, exclude=[]).chosen == ["a", "small", "lm_head"]


def test_compact_names():
    names = [f"blocks.{i}.attn.qkv" for i in (0, 1, 2, 5)] + ["head"]
    assert compact_names(names) == "blocks.{0-2,5}.attn.qkv, head"


def test_native_conversion_of_the_gpt_keeps_its_function_and_checkpoints_its_state():
    torch.manual_seed(0)
    cfg = Config(use_fp8=True, fp8_backend="native", fp8_amax_history_len=8)
    model = tiny_model()
    ref = tiny_model()
    ref.load_state_dict(model.state_dict())
    prec = build_precision(cfg, CPU, warn=pytest.fail)
    model = prec.convert(model)
    assert prec.emulate and len(prec.selection.chosen) == 16
    assert all(isinstance(model.get_submodule(n), Fp8Linear) for n in prec.selection.chosen)
    x = torch.randint(0, 256, (2, 64))
    for _ in range(2):  # TE's initial scale is 1; after one step the scales fit the tensors
        with prec.forward_context(training=True):
            out = model(x)
        out.sum().backward()
        prec.after_backward()
    assert rel_err(out, ref(x)) < 0.1  # 16 FP8 GEMMs in a row: per-GEMM errors compound
    sd = model.state_dict()
    assert sd["fp8_state.amax_history"].shape == (8, 16, 3)
    assert "fp8_state.fp8_max" not in sd  # derived from the format, not state
    with prec.forward_context(training=False):  # fp8_eval false: plain Linears
        torch.testing.assert_close(model(x), ref(x))


def te_recipe_module():
    """TE's real recipe module, loaded from its wheel (TE itself needs CUDA to import, its
    recipe module only pydantic). CI downloads the wheel and names it in FP8TRAIN_TE_WHEEL."""
    wheel = os.environ.get("FP8TRAIN_TE_WHEEL")
    if not wheel or not Path(wheel).is_file():
        pytest.skip("FP8TRAIN_TE_WHEEL not set (CI sets it to a transformer_engine wheel)")
    src = zipfile.ZipFile(wheel).read("transformer_engine/common/recipe/__init__.py")
    name = "transformer_engine_recipe_from_wheel"
    if name not in sys.modules:
        mod = types.ModuleType(name)
        sys.modules[name] = mod  # dataclasses resolve annotations through sys.modules
        exec(compile(src, f"{wheel}!recipe/__init__.py", "exec"), mod.__dict__)
    return sys.modules[name]


@pytest.mark.parametrize("fmt,margin,hist,algo", [
    ("hybrid", 0, 1024, "max"), ("e4m3", 2, 16, "most_recent"), ("hybrid", 5, 1, "most_recent")])
def test_every_fp8_key_reaches_te_delayed_scaling_as_given(fmt, margin, hist, algo):
    recipe_mod = te_recipe_module()
    cfg = Config(use_fp8=True, fp8_format=fmt, fp8_margin=margin, fp8_amax_history_len=hist,
                 fp8_amax_compute_algo=algo)
    r = te_backend.build_recipe(Fp8Spec.of(cfg), recipe_mod)
    assert isinstance(r, recipe_mod.DelayedScaling)
    assert r.fp8_format == getattr(recipe_mod.Format, fmt.upper())
    assert (r.margin, r.amax_history_len, r.amax_compute_algo) == (margin, hist, algo)
    assert r.reduce_amax is True


class StubTE:
    """transformer_engine.pytorch as convert() and the contexts use it. TE cannot be imported
    without CUDA, so its modules are stood in for by plain Linears; the recipe objects are TE's
    own, from its wheel."""
    class Linear(nn.Linear):
        def __init__(self, i, o, bias=True, params_dtype=None, device=None):
            super().__init__(i, o, bias=bias, dtype=params_dtype, device=device)

    @staticmethod
    def checkpoint(block, x, use_reentrant):
        return block(x)

    @staticmethod
    def autocast(enabled, recipe):
        StubTE.entered.append((enabled, recipe))
        return contextlib.nullcontext()

    entered: list = []


def te_on_cpu(**cfg_kw):
    """A TE backend as unavailable() leaves it on a GPU, with the stand-in for TE's modules."""
    prec = te_backend.TransformerEngine(
        Fp8Spec.of(Config(use_fp8=True, fp8_backend="te", **cfg_kw)),
        build_precision(Config(), CPU, pytest.fail))
    prec.te, prec.recipes = StubTE, te_recipe_module()
    return prec


def test_te_margin_raised_after_a_rollback_reaches_the_recipe_te_reads():
    """TE registers each module's amax/scale buffers once, with the recipe object its autocast
    was entered with, and its fused scale update reads `margin` from that object
    (FP8GlobalStateManager.autocast_arguments). A rollback's margin + 1 must therefore change
    that very object, never replace it."""
    prec = te_on_cpu(fp8_margin=1)
    prec.convert(tiny_model())
    recipe = prec.recipe
    assert recipe.margin == 1 and recipe.reduce_amax is True   # the real run all-reduces amaxes
    StubTE.entered.clear()
    with prec.forward_context(training=True):
        pass
    assert StubTE.entered == [(True, recipe)]
    assert prec.recover("margin") == "fp8_margin 1 -> 2"
    assert prec.recipe is recipe and recipe.margin == 2
    assert "margin=2" in repr(recipe)     # TE's cached repr (its buffer keys) follows the change
    prec.load_state_dict({"margin_added": 3, "off": False})   # a resume after three rollbacks
    assert prec.recipe is recipe and recipe.margin == 4 and "margin=4" in prec.describe()
    with prec.forward_context(training=True):
        pass
    assert StubTE.entered[-1] == (True, recipe)


def test_te_margin_of_a_resumed_run_is_in_the_recipe_from_the_start():
    prec = te_on_cpu(fp8_margin=0)
    prec.load_state_dict({"margin_added": 2, "off": False})   # on resume, before conversion
    prec.convert(tiny_model())
    assert prec.recipe.margin == 2 and prec.margin_added == 2


def test_te_trials_do_not_all_reduce_and_are_forgotten(monkeypatch):
    """The micro-batch probe and fp8_layers auto's timing run different trials on each rank:
    their TE recipe must not all-reduce amaxes (ranks in different collectives hang), and the
    trial modules must leave TE's process-wide amax buffers (FP8GlobalStateManager.reset(),
    stood in for here: TE cannot be imported without CUDA)."""
    resets = []
    monkeypatch.setattr(te_backend, "global_state_manager",
                        lambda: types.SimpleNamespace(reset=lambda: resets.append(1)))
    trial = te_on_cpu().for_trials()
    trial.convert(tiny_model())
    assert trial.recipe.reduce_amax is False
    trial.reset_trials()
    assert resets == [1]
    timing = te_on_cpu().timing_copy()
    assert timing.reduce_amax is False


def test_te_falls_back_on_cpu_or_stops_when_told():
    warnings = []
    prec = build_precision(Config(use_fp8=True, fp8_backend="te"), CPU, warnings.append)
    assert prec.name == "fp32" and not prec.fp8
    assert len(warnings) == 1 and "Training WITHOUT FP8" in warnings[0]
    assert prec.derived()["fp8"].startswith("off (fallback: te: Transformer Engine needs a CUDA")
    from fp8train.errors import BadInput
    with pytest.raises(BadInput, match="key 'fp8_backend': 'te' cannot run here"):
        build_precision(Config(use_fp8=True, fp8_backend="te", fp8_fallback="error"), CPU,
                        warnings.append)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_torchao_converts_the_selected_layers_with_the_recipe(recipe):
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear
    torch.manual_seed(0)
    cfg = Config(use_fp8=True, fp8_backend="torchao", fp8_recipe=recipe,
                 fp8_exclude=["*.mlp.proj"])
    prec = build_precision(cfg, CPU, warn=pytest.fail)
    model = tiny_model()
    ref = tiny_model()
    ref.load_state_dict(model.state_dict())
    model = prec.convert(model)
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert all(kinds[n] is Float8Linear for n in prec.selection.chosen)
    assert kinds["blocks.0.mlp.proj"] is nn.Linear and len(prec.selection.chosen) == 12
    assert model.get_submodule("blocks.0.attn.qkv").config.emulate  # CPU: emulated
    x = torch.randint(0, 256, (2, 64))
    prec.watch(True)
    out = model(x)
    out.float().pow(2).mean().backward()
    stats = prec.stats()
    prec.watch(False)
    assert rel_err(out.detach(), ref(x).detach()) < 0.05
    assert stats["fp8/blocks.0.attn.qkv/fwd_scale_input"].item() == pytest.approx(
        448.0 / stats["fp8/blocks.0.attn.qkv/amax_input"].item(), rel=1e-5 if recipe ==
        "tensorwise" else 1.0)
    assert "fp8/blocks.1.mlp.fc/bwd_scale_grad_output" in stats
    assert stats["fp8/saturated"].item() == 0.0  # dynamic scaling never clips


@pytest.mark.parametrize("fp8_eval", [False, True])
def test_te_turns_fp8_off_for_eval_and_samples_and_keeps_its_scales_checkpointed(fp8_eval):
    """TE needs CUDA to import, so its autocast is stood in for by a recorder; what is tested is
    which autocast our backend enters and that the modules' FP8 state stays marked for the next
    checkpoint (TE unmarks it after a forward without FP8), even when the forward fails."""
    import contextlib

    from fp8train.precision.plain import FP32
    calls = []

    @contextlib.contextmanager
    def autocast(enabled, recipe):
        calls.append(enabled)
        yield

    prec = te_backend.TransformerEngine(Fp8Spec.of(Config(use_fp8=True, fp8_eval=fp8_eval)),
                                        FP32())
    prec.te = types.SimpleNamespace(autocast=autocast)
    meta = {"scaling_fwd": object(), "fp8_checkpoint": True}
    prec.modules = {"blocks.0.mlp.fc": types.SimpleNamespace(fp8_meta=meta)}
    with prec.forward_context(training=True):
        pass
    with prec.forward_context(training=False):
        meta["fp8_checkpoint"] = fp8_eval       # what TE does on a forward without FP8
    with pytest.raises(RuntimeError):
        with prec.sampling_context():
            meta["fp8_checkpoint"] = False
            raise RuntimeError("out of memory")
    # Sampling never runs in FP8 (arbitrary lengths), evaluation only with fp8_eval.
    assert calls == [True, fp8_eval, False]
    assert meta["fp8_checkpoint"] is True


def test_recovery_raises_the_native_margin_or_switches_fp8_off():
    torch.manual_seed(0)
    model = tiny_model()
    ref = tiny_model()
    ref.load_state_dict(model.state_dict())
    prec = build_precision(Config(use_fp8=True, fp8_backend="native", fp8_margin=1), CPU,
                           warn=pytest.fail)
    model = prec.convert(model)
    assert prec.recover("margin") == "fp8_margin 1 -> 2"
    assert prec.state.margin == 2 and "margin 2" in prec.describe()
    prec.load_state_dict({"margin_added": 3, "off": False})   # a resume after three rollbacks
    assert prec.state.margin == 4 and prec.margin_added == 3
    assert prec.recover("bf16").startswith("FP8 switched off: the converted layers compute in fp32")
    x = torch.randint(0, 256, (2, 64))
    with prec.forward_context(training=True):          # training forwards now skip FP8
        torch.testing.assert_close(model(x), ref(x))
    assert prec.recover("margin") is None               # nothing left to change
    assert "switched off" in prec.derived()["fp8"]


def test_recovery_for_torchao_and_plain_precisions():
    pytest.importorskip("torchao")
    prec = build_precision(Config(use_fp8=True, fp8_backend="torchao"), CPU, warn=pytest.fail)
    prec.convert(tiny_model())
    assert prec.recover("margin") == ("FP8 switched off (torchao has no margin to raise): the "
                                      "converted layers compute in fp32 from here")
    plain = build_precision(Config(), CPU, warn=pytest.fail)
    assert plain.recover("margin") is None and not plain.disabled


def test_te_recipe_takes_the_raised_margin():
    recipe_mod = te_recipe_module()
    spec = Fp8Spec.of(Config(use_fp8=True, fp8_margin=1))
    assert te_backend.build_recipe(spec, recipe_mod, margin=3).margin == 3
    assert te_backend.recipe_kwargs(spec, 2)["margin"] == 2


@pytest.mark.parametrize("compile_", [False, True])
def test_torchao_on_a_gpu_without_compile_is_called_out(compile_):
    """torchao float8 is slower than bf16 uncompiled (its casts are separate kernels): a GPU run
    without compile is told once. Emulated on CPU it is numerics only and says so already."""
    pytest.importorskip("torchao")
    prec = build_precision(Config(use_fp8=True, fp8_backend="torchao", compile=compile_), CPU,
                           warn=pytest.fail)
    prec.convert(tiny_model())
    assert prec.cautions() == []                     # CPU: emulated
    prec.emulate = False                             # as on a GPU (which CI does not have)
    said = prec.cautions()
    assert len(said) == (0 if compile_ else 1)
    assert all("set compile: true" in c for c in said)


def test_the_fp8_spec_is_the_config_read_once_into_plain_frozen_values(tmp_path):
    """build_precision reads the config into the FP8 spec once: every fp8 key by its short
    name, the execution keys the timings depend on, the cache directory (batch_cache_dir, else
    the run's), where each key came from; plain values (it goes to JSON as it is), frozen, and
    the only settings the backend holds."""
    import dataclasses
    import json
    cfg = Config(use_fp8=True, fp8_backend="native", fp8_recipe="current", fp8_format="e4m3",
                 fp8_margin=2, fp8_exclude=["lm_head", "*.attn.*"], fp8_layers="all",
                 compile=True, output_dir=str(tmp_path / "run"),
                 origins={"fp8_margin": "--fp8_margin"})
    prec = build_precision(cfg, CPU, warn=pytest.fail, run_dir=str(tmp_path / "trial"))
    spec = prec.spec
    assert spec == Fp8Spec.of(cfg, str(tmp_path / "trial"))
    assert (spec.backend, spec.recipe, spec.format, spec.margin, spec.layers, spec.exclude) == \
        ("native", "current", "e4m3", 2, "all", ("lm_head", "*.attn.*"))
    assert (spec.compile, spec.cache_dir, spec.decided, spec.asked) == \
        (True, str(tmp_path / "trial"), "config", ("native", "current"))
    assert spec.where("fp8_margin") == "--fp8_margin"
    json.dumps(dataclasses.asdict(spec))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.margin = 3
    assert not hasattr(prec, "cfg")
    # fp8 auto: a provisional spec, its backend and recipe decided anew, the config's kept.
    auto = build_precision(Config(use_fp8=True, fp8_backend="auto"), CPU, warn=pytest.fail)
    assert (auto.spec.backend, auto.spec.recipe, auto.spec.asked, auto.spec.decided) == \
        ("native", "delayed", ("auto", "auto"), "provisional")
    assert auto.auto and not prec.auto
