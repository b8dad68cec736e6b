"""Transformer Engine's current and block scaling recipes (fp8_recipe: current | block) on CPU.

Transformer Engine cannot be imported without CUDA. What is real here: TE's recipe classes, from
its wheel (FP8TRAIN_TE_WHEEL, as in tests/e2e/test_precision.py), and every line of fp8train. What
is stood in for, because it needs CUDA: transformer_engine.pytorch (te.Linear is a plain Linear,
autocast a recorder, TE's availability functions return what the test says) and torch.cuda's
device queries where the backend is asked about a GPU. The scale numerics are TE's
compute_scale_from_amax (common/recipe/recipe_common.cuh) applied to tensors of known values.
"""
import math
import os
import pickle
import types

import pytest
import torch
from support.fake_te import BLOCK_REASON, install_fake_te
from support.precision_shared import tiny_model
from torch import nn

from fp8train.config.load import Config
from fp8train.errors import BadInput
from fp8train.precision import build_precision
from fp8train.precision import te as te_backend
from fp8train.precision.spec import Fp8Spec
from fp8train.precision.scaling import (E4M3, SAMPLE, block_amax, block_scales, current_scale,
                                        quant_stats, quant_stats_blocks, sample, sample_with_scales,
                                        te_scale)

CPU = torch.device("cpu")
@pytest.fixture
def te(monkeypatch):
    return install_fake_te(monkeypatch)


def _mock_h100(monkeypatch):
    """torch.cuda's device queries as an H100 answers them (only the queries: no kernel runs)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


def _backend(te, recipe, **kw):
    """The te backend as unavailable() leaves it on a GPU where TE runs (CPU tensors)."""
    prec = te_backend.TransformerEngine(
        Fp8Spec.of(Config(use_fp8=True, fp8_backend="te", fp8_recipe=recipe, **kw)),
        build_precision(Config(), CPU, pytest.fail))
    prec.te, prec.recipes = te, te.recipes
    return prec


# --- the recipe object -------------------------------------------------------------------------

@pytest.mark.parametrize("recipe,fmt", [("current", "hybrid"), ("current", "e4m3"),
                                        ("block", "hybrid"), ("block", "e4m3")])
def test_recipe_is_tes_own_class_with_the_format_and_is_what_autocast_enters(te, recipe, fmt):
    prec = _backend(te, recipe, fp8_format=fmt)
    model = prec.convert(tiny_model())
    r = prec.recipe
    cls = {"current": te.recipes.Float8CurrentScaling, "block": te.recipes.Float8BlockScaling}
    assert type(r) is cls[recipe] and r.fp8_format == getattr(te.recipes.Format, fmt.upper())
    assert not hasattr(r, "margin") and not hasattr(r, "reduce_amax")   # DelayedScaling's only
    # TE's defaults, which the scale read-out follows: no amax epsilon; power-of-2 scales for
    # block (1 x 128 tiles of inputs and gradients, 128 x 128 of weights), none for current.
    for q in (r.fp8_quant_fwd_inp, r.fp8_quant_fwd_weight, r.fp8_quant_bwd_grad):
        assert q.amax_epsilon == 0.0 and q.power_2_scale is (recipe == "block")
    if recipe == "block":
        assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == \
            (1, 2, 1)
    with prec.forward_context(training=True):
        pass
    with prec.forward_context(training=False):   # fp8_eval false: FP8 off
        pass
    assert te.entered == [(True, r), (False, r)]
    assert all(isinstance(model.get_submodule(n), te.Linear) for n in prec.modules)
    said = prec.describe()
    assert said.startswith(f"FP8 Transformer Engine: {cls[recipe].__name__}"
                           f"(fp8_format={fmt.upper()})"), said
    if recipe == "block":
        assert "1x128 block of inputs, 1x128 of grad_output, 128x128 of weights, power-of-2" \
            in said


def test_a_recipe_te_refuses_is_one_config_error_line(te, monkeypatch):
    """No TE 2.x refuses hybrid or e4m3 for these recipes (their __post_init__ asserts only
    fp8_format != E5M2), so the refusal is provoked with E5M2: TE's own pydantic ValidationError
    becomes one line naming both keys."""
    monkeypatch.setitem(te_backend._FORMAT_NAMES, "e4m3", "E5M2")
    cfg = Config(use_fp8=True, fp8_backend="te", fp8_recipe="block", fp8_format="e4m3")
    with pytest.raises(BadInput) as e:
        te_backend.build_recipe(Fp8Spec.of(cfg), te.recipes)
    text = str(e.value)
    assert "\n" not in text and "key 'fp8_format'" in text and "fp8_recipe: block" in text
    assert "Float8BlockScaling" in text and "Pure E5M2 training is not supported" in text


@pytest.mark.parametrize("recipe", ["current", "block"])
def test_no_margin_to_raise_so_the_margin_remedy_switches_fp8_off(te, recipe):
    prec = _backend(te, recipe)
    prec.convert(tiny_model())
    assert prec.recover("margin") == ("FP8 switched off (te has no margin to raise): the "
                                      "converted layers compute in fp32 from here")
    with prec.forward_context(training=True):
        pass
    assert te.entered == [(False, prec.recipe)] and "switched off" in prec.derived()["fp8"]


# --- is the recipe available on this GPU -------------------------------------------------------

@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_unavailable_gives_tes_reason_for_the_chosen_recipe(te, monkeypatch, recipe):
    """An H100 with a TE whose block-scaled GEMM needs CUDA 12.9 (TE's check_fp8_block_scaling
    _support; TE's availability functions are stood in for, they need CUDA): block falls back
    with TE's reason or stops with it (fp8_fallback: error), delayed and current run."""
    _mock_h100(monkeypatch)
    te.block = (False, BLOCK_REASON)
    monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "x")
    monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE")
    cuda = torch.device("cuda", 0)
    warnings = []
    prec = build_precision(Config(use_fp8=True, fp8_backend="te", fp8_recipe=recipe), cuda,
                           warnings.append)
    if recipe != "block":
        assert prec.fp8 and prec.te is te and not warnings
        # Only delayed scaling pickles state that a resume must unpickle.
        assert ("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE" in os.environ) is (recipe == "delayed")
        return
    reason = f"{BLOCK_REASON} (Transformer Engine's is_fp8_block_scaling_available, for " \
             f"Float8BlockScaling)"
    assert not prec.fp8 and len(warnings) == 1 and reason in warnings[0], warnings
    assert prec.derived()["fp8"] == f"off (fallback: te: {reason})"
    with pytest.raises(BadInput, match="'te' cannot run here: FP8 block scaled GEMM") as e:
        build_precision(Config(use_fp8=True, fp8_backend="te", fp8_recipe="block",
                               fp8_fallback="error"), cuda, warnings.append)
    assert "\n" not in str(e.value)


def test_availability_from_older_te_or_a_failing_query_is_a_reason_not_a_traceback(te,
                                                                                   monkeypatch):
    """TE 2.3-2.8 answer through FP8GlobalStateManager's classmethods (no module function);
    a TE before 2.3 has no Float8BlockScaling; a query that raises is a reason too."""
    older = types.SimpleNamespace(is_fp8_block_scaling_available=lambda: (False, "too old GPU"),
                                  is_fp8_available=lambda: (True, ""))
    monkeypatch.setattr(te_backend, "global_state_manager", lambda: older)
    no_functions = types.SimpleNamespace()
    assert te_backend.recipe_unavailable(no_functions, te.recipes, "current") is None
    assert te_backend.recipe_unavailable(no_functions, te.recipes, "block").startswith(
        "too old GPU (Transformer Engine's is_fp8_block_scaling_available")
    before_block = types.SimpleNamespace(DelayedScaling=None, Float8CurrentScaling=None)
    why = te_backend.recipe_unavailable(te, before_block, "block")
    assert "has no Float8BlockScaling (fp8_recipe: block, added in TE 2.3)" in why
    assert "pip install -U --no-build-isolation" in why

    def broken(return_reason=False):
        raise RuntimeError("CUDA driver version is insufficient\nfor CUDA runtime version")
    te.is_fp8_block_scaling_available = broken
    why = te_backend.recipe_unavailable(te, te.recipes, "block")
    assert why == ("Transformer Engine's is_fp8_block_scaling_available failed (RuntimeError: "
                   "CUDA driver version is insufficient for CUDA runtime version)")


# --- checkpoints: what `_extra_state` holds ------------------------------------------------------

def _pre_2_18_extra_state(recipe) -> torch.Tensor:
    """What TE 2.4-2.17's get_extra_state (module/base.py) saves for a module under a recipe
    without delayed-scaling state: the pickled recipe object and fp8_meta's plain values."""
    state = {"recipe": recipe, "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": 1}}
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


@pytest.mark.parametrize("recipe", ["current", "block"])
def test_stateless_recipes_checkpoint_no_extra_state_and_load_strictly(te, tmp_path, recipe):
    """These recipes have no state to checkpoint. TE from 2.18 still returns an empty
    `_extra_state` per layer (stateless in pytorch/_extra_state.py), and TE 2.4-2.17 a pickle
    of the recipe object, whose classes fp8train's checkpoint scan refuses. Empty tensors have
    no storage, so Accelerate's safetensors writer takes them all for one shared tensor and
    keeps one: the strict load of a resume or a rollback would then miss the others. So the
    converted layers leave `_extra_state` out: a real Accelerator save_state / load_state
    round trip restores every weight strictly, the checkpoint passes the scan, and a
    checkpoint holding one empty `_extra_state` (written before) loads without unpickling
    anything (TE 2.2-2.3 pickle.loads whatever they are given, as the stand-in does here)."""
    from accelerate import Accelerator

    from fp8train.checkpoint.safe_load import _check_extra_state, _Unsafe, unsafe_content

    class OldLinear(te.Linear):   # te.Linear's extra state as TE 2.3 handles it
        def get_extra_state(self):
            return _pre_2_18_extra_state(prec.recipe)

        def set_extra_state(self, state):
            pickle.loads(state.numpy().tobytes())

    te.Linear = OldLinear
    prec = _backend(te, recipe)
    with pytest.raises(_Unsafe, match="needs global"):
        _check_extra_state(_pre_2_18_extra_state(te.recipes.Float8CurrentScaling()), "")
    model = prec.convert(tiny_model())
    assert len(prec.modules) > 1
    assert not [k for k in model.state_dict() if k.endswith("_extra_state")]
    saver = Accelerator(cpu=True)
    saver.prepare(model)
    saver.save_state(str(tmp_path / "ckpt"))
    assert unsafe_content(str(tmp_path / "ckpt")) is None
    again = _backend(te, recipe).convert(tiny_model())
    loader = Accelerator(cpu=True)
    loader.prepare(again)
    loader.load_state(str(tmp_path / "ckpt"))
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    old = dict(model.state_dict())
    old[next(iter(prec.modules)) + "._extra_state"] = torch.empty(0, dtype=torch.uint8)
    again.load_state_dict(old, strict=True)
    # Delayed scaling's pickle, from TE's real DelayedScaling, still passes the scan.
    _check_extra_state(_pre_2_18_extra_state(te.recipes.DelayedScaling()), "")


# --- scale numerics: TE's compute_scale_from_amax, per tensor and per tile ------------------------

def test_te_scale_follows_compute_scale_from_amax():
    amax = torch.tensor([2.0, 0.0, float("inf"), float("nan"), 1e-40, 3.0])
    got = te_scale(amax, 448.0)
    fp32_max = torch.finfo(torch.float32).max
    third = (torch.tensor(448.0) / torch.tensor(3.0)).item()   # float32 division, as TE's
    assert got.tolist() == [224.0, 1.0, 1.0, 1.0, fp32_max, third]
    torch.testing.assert_close(current_scale(amax, 448.0), got, rtol=0, atol=0)
    pow2 = te_scale(amax, 448.0, pow2=True)   # mantissa cleared: rounded down to 2^k
    assert pow2.tolist() == [128.0, 1.0, 1.0, 1.0, 2.0 ** 127, 128.0]
    # amax_epsilon floors the amax, 0 included
    assert te_scale(torch.tensor([0.0, 1e-6]), 448.0, epsilon=1e-3).tolist() == \
        pytest.approx([448000.0, 448000.0])


def test_block_amax_tiles_the_2d_view_with_partial_edge_tiles():
    t = torch.randn(3, 2, 200)   # 6 rows of 200: tiles of 128 and 72 columns
    got = block_amax(t, (1, 128))
    rows = t.reshape(6, 200).abs()
    assert got.shape == (6, 2)
    assert torch.equal(got, torch.stack([rows[:, :128].amax(1), rows[:, 128:].amax(1)], 1))
    w = torch.randn(200, 300)
    got = block_amax(w, (128, 128))
    assert got.shape == (2, 3) and got[1, 2] == w[128:, 256:].abs().amax()


@pytest.mark.parametrize("shape,tile", [((520, 260), (1, 128)), ((520, 260), (128, 128)),
                                        ((4, 64, 256), (1, 128))])
def test_each_sampled_value_gets_its_own_tiles_scale(shape, tile):
    """sample_with_scales takes the same strided sample as quant_stats and pairs each value with
    its tile's scale: checked against the scale grid expanded to every element. 520 x 260 is
    more than SAMPLE values (every 2nd one is taken, rows end in partial tiles)."""
    assert (math.prod(shape) > SAMPLE) is (shape[0] == 520)
    t = torch.randn(shape) * torch.logspace(-4, 4, shape[-1])
    scales = block_scales(t, tile, 448.0)
    rows, cols = t.reshape(-1, shape[-1]).shape
    full = scales.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[:rows, :cols]
    values, per_value = sample_with_scales(t, scales, tile)
    assert torch.equal(values, sample(t)) and torch.equal(per_value, sample(full))


def test_one_outlier_block_underflows_its_own_block_only():
    """A 256 x 256 weight of 1e-3 with one 1e4. One scale for the tensor (current scaling:
    448 / 1e4) puts 1e-3 below E4M3's smallest subnormal: every small value underflows. With
    128 x 128 blocks only the outlier's block does (scale 2^-5, power of 2); the other three
    blocks get 2^18 from their own amax of 1e-3."""
    w = torch.full((256, 256), 1e-3)
    w[0, 0] = 1e4
    tensor_scale = te_scale(w.abs().amax(), 448.0)
    sat, under = quant_stats(w, tensor_scale, E4M3)
    assert sat.item() == 0.0 and under.item() == 65535 / 65536
    scales = block_scales(w, (128, 128), 448.0)
    assert scales.tolist() == [[2.0 ** -5, 2.0 ** 18], [2.0 ** 18, 2.0 ** 18]]
    sat, under = quant_stats_blocks(w, scales, (128, 128), E4M3)
    assert sat.item() == 0.0 and under.item() == (128 * 128 - 1) / 65536


# --- the per-layer metrics ------------------------------------------------------------------------

def _outlier(shape, small, big):
    t = torch.full(shape, small)
    t.view(-1)[0] = big
    return t


def _watched_step(te, recipe, fmt="hybrid"):
    """One Linear(256, 256) under the recipe's scale read-out, one watched forward and backward
    with known input (1e-3, one 1e3), weight (1e-3, one 1e4) and grad_output (1e-9, one 1e2)."""
    spec = Fp8Spec.of(Config(use_fp8=True, fp8_backend="te", fp8_recipe=recipe, fp8_format=fmt))
    lin = nn.Linear(256, 256, bias=False)
    with torch.no_grad():
        lin.weight.copy_(_outlier((256, 256), 1e-3, 1e4))
    probe = te_backend.scale_probe({"lin": lin}, spec, te_backend.build_recipe(spec, te.recipes))
    probe.watch(True)
    lin(_outlier((2, 64, 256), 1e-3, 1e3)).backward(_outlier((2, 64, 256), 1e-9, 1e2))
    return {k: v.item() for k, v in probe.stats.collect().items()}


def test_current_scaling_metrics_are_fp8_max_over_each_tensors_own_amax(te):
    m = _watched_step(te, "current")
    assert m["fp8/lin/amax_input"] == pytest.approx(1e3)
    assert m["fp8/lin/fwd_scale_input"] == pytest.approx(448 / 1e3, rel=1e-6)
    assert m["fp8/lin/fwd_scale_weight"] == pytest.approx(448 / 1e4, rel=1e-6)
    assert m["fp8/lin/bwd_scale_grad_output"] == pytest.approx(57344 / 1e2, rel=1e-6)  # E5M2
    # the tensor scale fits the outlier and drops the rest (E5M2's subnormals reach 1.5e-5)
    assert m["fp8/lin/underflow_input"] == 32767 / 32768
    assert m["fp8/lin/underflow_weight"] == 65535 / 65536
    assert m["fp8/lin/underflow_grad_output"] == 32767 / 32768
    assert m["fp8/saturated"] == 0.0
    assert m["fp8/fwd_scale"] == pytest.approx((448 / 1e3 * 448 / 1e4) ** 0.5, rel=1e-5)


def test_block_scaling_metrics_report_the_median_tile_scale_and_per_tile_fractions(te):
    """Input and grad_output: 256 tiles of 1 x 128, one holding the outlier; weight: 4 tiles of
    128 x 128. The reported scale is the median tile's (power of 2); only the outlier's tile
    underflows (its other 127 values, or 128 x 128 - 1 for the weight)."""
    m = _watched_step(te, "block")
    assert m["fp8/lin/fwd_scale_input"] == 2.0 ** 18       # 448 / 1e-3 rounded down to 2^k
    assert m["fp8/lin/fwd_scale_weight"] == 2.0 ** 18
    assert m["fp8/lin/bwd_scale_grad_output"] == 2.0 ** 45  # 57344 / 1e-9 rounded down
    assert m["fp8/lin/amax_weight"] == pytest.approx(1e4)   # the tensor's, over all tiles
    assert m["fp8/lin/underflow_input"] == 127 / 32768
    assert m["fp8/lin/underflow_weight"] == (128 * 128 - 1) / 65536
    assert m["fp8/lin/underflow_grad_output"] == 127 / 32768
    assert m["fp8/saturated"] == 0.0
    metric_names = {k for k in m if k.startswith("fp8/lin/")}
    assert metric_names == {f"fp8/lin/{k}" for k in (
        "fwd_scale_input", "fwd_scale_weight", "bwd_scale_grad_output", "amax_input",
        "amax_weight", "amax_grad_output", "saturated_input", "saturated_weight",
        "saturated_grad_output", "underflow_input", "underflow_weight", "underflow_grad_output")}


@pytest.mark.parametrize("recipe", ["current", "block"])
def test_a_converted_model_logs_every_layers_metrics_and_the_aggregates(te, recipe):
    prec = _backend(te, recipe)
    model = prec.convert(tiny_model())
    prec.watch(True)
    with prec.forward_context(training=True):
        out = model(torch.randint(0, 256, (2, 64)))
    out.float().pow(2).mean().backward()
    stats = prec.stats()
    prec.watch(False)
    for key in ("fp8/fwd_scale", "fp8/bwd_scale", "fp8/amax", "fp8/saturated", "fp8/underflow"):
        assert torch.isfinite(stats[key]), key
    for name in prec.modules:
        assert stats[f"fp8/{name}/bwd_scale_grad_output"] > 0, name
    assert len([k for k in stats if k.count("/") == 2]) == 12 * len(prec.modules)
