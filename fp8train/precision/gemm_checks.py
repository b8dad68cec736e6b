"""Each FP8 backend's GEMMs run once, forward and backward, the way training calls them, on
fixed operands, with their relative errors against the same computation in bf16: what the GPU
check (fp8train/diagnose, scripts/diagnose_gpu.py) judges. Also whether each backend imports
(its version) and whether Transformer Engine runs a recipe on the current GPU, by the trainer's
own rules. Importing is not enough: a Transformer Engine built for another CUDA imports fine and
fails at its first GEMM."""
from __future__ import annotations

import importlib
import sys

from ..config.schema import FP8_RECIPES

CHECK_DIM = 256   # the GEMMs are CHECK_DIM x CHECK_DIM x CHECK_DIM


def gemm_errors(backend: str, device, recipe: str = "delayed") -> dict:
    """{"what", "fwd_err", "grad_err"} of `backend`'s FP8 GEMMs on `device` (`recipe`: TE's)."""
    if backend == "te":
        return te_errors(device, recipe)
    return {"native": native_errors, "torchao": torchao_errors}[backend](device)


def backend_version(backend: str) -> str:
    """What imports for `backend`, in words ("torchao 0.18.0"); the import's exception when it
    does not."""
    if backend == "te":
        importlib.import_module("transformer_engine.pytorch")
        return f"transformer_engine {sys.modules['transformer_engine'].__version__}"
    if backend == "torchao":
        from .ao import import_float8  # quiets torchao's optional-kernel logs
        import_float8()
        return f"torchao {sys.modules['torchao'].__version__}"
    import torch
    if not hasattr(torch, "_scaled_mm"):
        raise ImportError(f"torch {torch.__version__} has no torch._scaled_mm")
    return f"torch {torch.__version__}, torch._scaled_mm"


def fp8_unavailable(device, te_recipe: "str | None" = None) -> "str | None":
    """Why no FP8 GEMM runs on CUDA `device` (compute capability below 8.9), by the trainer's
    own rule; with `te_recipe`, why Transformer Engine does not run that recipe on the current
    CUDA device (its own availability function, as training asks it). None when it runs."""
    if te_recipe is None:
        from .base import cuda_fp8_gate
        return cuda_fp8_gate(device)
    from transformer_engine.common import recipe as recipes

    from .te import recipe_unavailable
    te = importlib.import_module("transformer_engine.pytorch")
    return recipe_unavailable(te, recipes, te_recipe)


def rel_err(got, ref) -> float:
    """Relative Frobenius error of `got` against `ref`, in fp32 (inf when not finite)."""
    from .numerics import rel_error
    return rel_error(got.detach(), ref.detach())


def _operands(device):
    """x [M, K], w [N, K] (a Linear's weight) and grad_output [M, N], bf16, fixed seed."""
    import torch
    gen = torch.Generator().manual_seed(0)
    n = CHECK_DIM
    return [torch.randn(n, n, generator=gen).to(device=device, dtype=torch.bfloat16)
            for _ in range(3)]



def native_errors(device) -> dict:
    """The native backend's two kinds of GEMM through its own fp8_mm: forward (E4M3 x E4M3, fast
    accumulation) and grad_input (E5M2 x E4M3, full accumulation), with per-tensor scales.
    torch._scaled_mm also exists on CPU, so the CPU test runs this for real."""
    import torch

    from .native import fp8_mm
    from .scaling import E4M3, E5M2, FP8_MAX, quantize
    x, w, g = _operands(device)

    def scale(t, dtype):
        return (FP8_MAX[dtype] / t.float().abs().amax()).float()

    s_x, s_w, s_g = scale(x, E4M3), scale(w, E4M3), scale(g, E5M2)
    xq, wq, gq = quantize(x, s_x, E4M3), quantize(w, s_w, E4M3), quantize(g, s_g, E5M2)
    # _scaled_mm wants its second operand column-major, as native.py arranges it.
    y = fp8_mm(xq, s_x, wq.t(), s_w, torch.bfloat16, emulate=False, fast_accum=True)
    gx = fp8_mm(gq, s_g, wq.t().contiguous().t(), s_w, torch.bfloat16, emulate=False,
                fast_accum=False)
    return {"what": "torch._scaled_mm forward + grad_input GEMMs",
            "fwd_err": rel_err(y, x @ w.t()), "grad_err": rel_err(gx, g @ w)}


def torchao_errors(device) -> dict:
    """A Linear converted by torchao's convert_to_float8_training (the config's default recipe),
    forward and backward. On CPU torchao emulates the FP8 GEMMs (the CPU test runs that)."""
    import dataclasses

    import torch
    from torch import nn

    from .ao import import_float8
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
        raise RuntimeError("convert_to_float8_training left the Linear unconverted")
    xr = x.clone().requires_grad_()
    y = model(xr)
    y.backward(g)
    grad_err = max(rel_err(xr.grad, g @ w), rel_err(model[0].weight.grad, g.t() @ x))
    return {"what": f"{type(model[0]).__name__} ({recipe}"
                    f"{', emulated' if emulated else ''}) forward + backward",
            "fwd_err": rel_err(y, x @ w.t()), "grad_err": grad_err}


def te_errors(device, recipe_name: str = "delayed") -> dict:
    """te.Linear forward and backward under TE's autocast with the recipe a default training
    config with this fp8_recipe builds (te.build_recipe). Three steps, the
    last one judged: under delayed scaling the first runs at TE's initial scale of 1, the later
    ones with scales from the amax history, which is the delayed-scaling machinery training
    depends on (current and block scaling give the same scales every step)."""
    import torch

    from ..config.load import Config
    from .spec import Fp8Spec
    from .te import RECIPES, build_recipe, recipe_kwargs
    te = importlib.import_module("transformer_engine.pytorch")
    spec = Fp8Spec.of(Config(use_fp8=True, fp8_backend="te", fp8_recipe=recipe_name))
    recipe = build_recipe(spec)
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
    kw = recipe_kwargs(spec)
    what = (f"DelayedScaling({kw['fp8_format']}, history {kw['amax_history_len']})"
            if recipe_name == "delayed" else
            f"{RECIPES[recipe_name][0]}({kw['fp8_format']})")
    return {"what": f"te.Linear forward + backward, {what}",
            "fwd_err": rel_err(y, x @ w.t()), "grad_err": grad_err}
