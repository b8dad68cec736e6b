"""FP8, per backend (te, torchao, native): does it import here, and does an FP8 GEMM on this
device (forward and backward, the way training calls it) agree with the bf16 reference.
Importing is not enough: a Transformer Engine built for another CUDA imports fine and fails at
its first GEMM. For Transformer Engine, each scaling recipe (fp8_recipe: delayed, current,
block) is checked on its own: TE says whether this GPU runs it (block scaling needs more than
FP8 itself), and each one it runs gets its own GEMM check."""
from __future__ import annotations

import importlib
import sys

from ..config.schema import FP8_RECIPES  # the standard library only: --help stays instant
from .checks import CheckFailed, describe, rel_err, run_check

BACKENDS = ("te", "torchao", "native")
TE_RECIPES = FP8_RECIPES["te"]   # delayed, current, block
INSTALL = {"te": "pip install --no-build-isolation 'transformer_engine[pytorch]'",
           "torchao": "pip install torchao"}

# FP8 checks: 256 x 256 x 256 GEMMs on standard-normal operands, judged by the relative
# Frobenius error against the same computation in bf16. E4M3 keeps 3 mantissa bits and E5M2
# (gradients, hybrid format) 2, so quantization alone costs about 4% in the forward GEMM and 6%
# in the gradient GEMMs (measured with the CPU emulation); a wrong layout, scale or dtype is off
# by 100% or more. The tolerances sit between the two.
CHECK_DIM = 256
FWD_TOL, GRAD_TOL = 0.10, 0.15


def fp8_section(device_report: dict) -> dict:
    """Imports everywhere; the real FP8 GEMM checks only where FP8 can run. The te entry also
    has "recipes" (None where nothing could be checked): per TE recipe, whether TE says this GPU
    runs it, why not, and its GEMM check; te's "gemm" is the delayed recipe's (the default)."""
    backends = fp8_imports()
    gate = fp8_gate(device_report)
    checks = {"torchao": check_torchao, "native": check_native}
    backends["te"]["recipes"] = None
    for name, entry in backends.items():
        entry["gemm"] = None
        if entry["imports"] and gate is None:
            import torch
            device = torch.device("cuda", device_report["index"])
            if name == "te":
                entry["recipes"] = te_recipes(device)
                entry["gemm"] = entry["recipes"]["delayed"]["gemm"]
            else:
                entry["gemm"] = run_check(checks[name], device)
    return {"gate": gate, "backends": backends}


def te_recipes(device) -> dict:
    """recipe -> {"available", "reason", "gemm"}: Transformer Engine's own verdict on whether
    this GPU runs the recipe (the reason when not), and the GEMM check of each one it runs."""
    out = {}
    for recipe in TE_RECIPES:
        reason = run_check(lambda r=recipe: {"reason": te_recipe_unavailable(r)})
        if not reason["ok"]:   # the query itself raised: a reason too, never a traceback
            reason = {"reason": f"availability check failed ({reason['error']})"}
        out[recipe] = {"available": reason["reason"] is None, "reason": reason["reason"],
                       "gemm": None}
        if out[recipe]["available"]:
            out[recipe]["gemm"] = run_check(check_te, device, recipe)
    return out


def te_recipe_unavailable(recipe: str) -> str | None:
    """The trainer's own check (fp8train.precision.te.recipe_unavailable): TE's availability
    function for the recipe, on the current CUDA device."""
    from transformer_engine.common import recipe as recipes

    from ..precision.te import recipe_unavailable
    te = importlib.import_module("transformer_engine.pytorch")
    return recipe_unavailable(te, recipes, recipe)


def fp8_gate(device_report: dict) -> str | None:
    """Why no FP8 GEMM can run on this device, or None when one can."""
    if not device_report["cuda"]:
        return f"no CUDA device: {device_report['reason']}"
    import torch

    from ..precision.base import cuda_fp8_gate  # the trainer's own rule (cc >= 8.9)
    return cuda_fp8_gate(torch.device("cuda", device_report["index"]))


# ----------------------------------------------------------------------------------- imports

def fp8_imports() -> dict:
    """Per backend: does it import here (no device needed)."""
    return {"te": _import_check(_import_te), "torchao": _import_check(_import_torchao),
            "native": _import_check(_import_native)}


def _import_check(fn) -> dict:
    try:
        return {"imports": True, "version": fn(), "error": None}
    except Exception as e:
        return {"imports": False, "version": None, "error": import_error(e)}


def import_error(e: Exception) -> str:
    """Why a backend does not import: not installed (and how to install it), or broken."""
    top = (getattr(e, "name", None) or "").split(".")[0]
    for label, module in (("te", "transformer_engine"), ("torchao", "torchao")):
        if isinstance(e, ModuleNotFoundError) and top == module:
            return f"{module} is not installed ({INSTALL[label]})"
    return f"import failed ({describe(e)})"   # e.g. a build for another torch or CUDA


def _import_te() -> str:
    importlib.import_module("transformer_engine.pytorch")
    return f"transformer_engine {sys.modules['transformer_engine'].__version__}"


def _import_torchao() -> str:
    from ..precision.ao import import_float8  # quiets torchao's optional-kernel logs
    import_float8()
    return f"torchao {sys.modules['torchao'].__version__}"


def _import_native() -> str:
    import torch
    if not hasattr(torch, "_scaled_mm"):
        raise ImportError(f"torch {torch.__version__} has no torch._scaled_mm")
    return f"torch {torch.__version__}, torch._scaled_mm"


# ------------------------------------------------------------------------------ GEMM checks

def _operands(device):
    """x [M, K], w [N, K] (a Linear's weight) and grad_output [M, N], bf16, fixed seed."""
    import torch
    gen = torch.Generator().manual_seed(0)
    n = CHECK_DIM
    return [torch.randn(n, n, generator=gen).to(device=device, dtype=torch.bfloat16)
            for _ in range(3)]


def judge(result: dict) -> dict:
    """`result` as it is when its errors are within FWD_TOL / GRAD_TOL; CheckFailed if not."""
    bad = [f"{key} relative error {result[key]:.3g} > {tol}" for key, tol in
           (("fwd_err", FWD_TOL), ("grad_err", GRAD_TOL)) if key in result
           and not result[key] <= tol]   # "not <=" so that NaN fails too
    if bad:
        raise CheckFailed(f"{result['what']}: " + "; ".join(bad) + " against bf16")
    return result


def check_native(device) -> dict:
    """The native backend's two kinds of GEMM through its own fp8_mm: forward (E4M3 x E4M3, fast
    accumulation) and grad_input (E5M2 x E4M3, full accumulation), with per-tensor scales.
    torch._scaled_mm also exists on CPU, so the CPU test runs this for real."""
    import torch

    from ..precision.native import fp8_mm
    from ..precision.scaling import E4M3, E5M2, FP8_MAX, quantize
    x, w, g = _operands(device)

    def scale(t, dtype):
        return (FP8_MAX[dtype] / t.float().abs().amax()).float()

    s_x, s_w, s_g = scale(x, E4M3), scale(w, E4M3), scale(g, E5M2)
    xq, wq, gq = quantize(x, s_x, E4M3), quantize(w, s_w, E4M3), quantize(g, s_g, E5M2)
    # _scaled_mm wants its second operand column-major, as native.py arranges it.
    y = fp8_mm(xq, s_x, wq.t(), s_w, torch.bfloat16, emulate=False, fast_accum=True)
    gx = fp8_mm(gq, s_g, wq.t().contiguous().t(), s_w, torch.bfloat16, emulate=False,
                fast_accum=False)
    return judge({"what": "torch._scaled_mm forward + grad_input GEMMs",
                  "fwd_err": rel_err(y, x @ w.t()), "grad_err": rel_err(gx, g @ w)})


def check_torchao(device) -> dict:
    """A Linear converted by torchao's convert_to_float8_training (the config's default recipe),
    forward and backward. On CPU torchao emulates the FP8 GEMMs (the CPU test runs that)."""
    import dataclasses

    import torch
    from torch import nn

    from ..precision.ao import import_float8
    float8, _ = import_float8()
    recipe = FP8_RECIPES["torchao"][0]   # torchao's default recipe (Config()'s is te's)
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    emulated = device.type != "cuda"
    if emulated:
        config = dataclasses.replace(config, emulate=True)
    x, w, g = _operands(device)
    model = nn.Sequential(nn.Linear(CHECK_DIM, CHECK_DIM, bias=False)).to(device, torch.bfloat16)
    with torch.no_grad():
        model[0].weight.copy_(w)
    float8.convert_to_float8_training(model, config=config)
    if type(model[0]) is nn.Linear:
        raise CheckFailed("convert_to_float8_training left the Linear unconverted")
    xr = x.clone().requires_grad_()
    y = model(xr)
    y.backward(g)
    grad_err = max(rel_err(xr.grad, g @ w), rel_err(model[0].weight.grad, g.t() @ x))
    return judge({"what": f"{type(model[0]).__name__} ({recipe}"
                          f"{', emulated' if emulated else ''}) forward + backward",
                  "fwd_err": rel_err(y, x @ w.t()), "grad_err": grad_err})


def check_te(device, recipe_name: str = "delayed") -> dict:
    """te.Linear forward and backward under TE's autocast with the recipe a default training
    config with this fp8_recipe builds (fp8train.precision.te.build_recipe). Three steps, the
    last one judged: under delayed scaling the first runs at TE's initial scale of 1, the later
    ones with scales from the amax history, which is the delayed-scaling machinery training
    depends on (current and block scaling give the same scales every step)."""
    import torch

    from ..config.load import Config
    from ..precision.te import RECIPES, build_recipe, recipe_kwargs
    te = importlib.import_module("transformer_engine.pytorch")
    cfg = Config(fp8_backend="te", fp8_recipe=recipe_name)
    recipe = build_recipe(cfg)
    x, w, g = _operands(device)
    lin = te.Linear(CHECK_DIM, CHECK_DIM, bias=False, params_dtype=torch.bfloat16,
                    device=device)
    with torch.no_grad():
        lin.weight.copy_(w)
    autocast = getattr(te, "autocast", None)   # newer TE; fp8_autocast is the older name
    for _ in range(3):
        ctx = (autocast(enabled=True, recipe=recipe) if autocast is not None
               else te.fp8_autocast(enabled=True, fp8_recipe=recipe))
        xr = x.clone().requires_grad_()
        lin.weight.grad = None
        with ctx:
            y = lin(xr)
        y.backward(g)
    grad_err = max(rel_err(xr.grad, g @ w), rel_err(lin.weight.grad, g.t() @ x))
    kw = recipe_kwargs(cfg)
    what = (f"DelayedScaling({kw['fp8_format']}, history {kw['amax_history_len']})"
            if recipe_name == "delayed" else
            f"{RECIPES[recipe_name][0]}({kw['fp8_format']})")
    return judge({"what": f"te.Linear forward + backward, {what}",
                  "fwd_err": rel_err(y, x @ w.t()), "grad_err": grad_err})
