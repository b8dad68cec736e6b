"""FP8, per backend (te, torchao, native): does it import here, and does an FP8 GEMM on this
device (forward and backward, the way training calls it) agree with the bf16 reference.
Importing is not enough: a Transformer Engine built for another CUDA imports fine and fails at
its first GEMM. For Transformer Engine, each scaling recipe (fp8_recipe: delayed, current,
block) is checked on its own: TE says whether this GPU runs it (block scaling needs more than
FP8 itself), and each one it runs gets its own GEMM check."""
from __future__ import annotations

from ..config.schema import FP8_RECIPES  # the standard library only: --help stays instant
from .checks import CheckFailed, describe, run_check

BACKENDS = ("te", "torchao", "native")
TE_RECIPES = FP8_RECIPES["te"]   # delayed, current, block
INSTALL = {"te": "pip install --no-build-isolation 'transformer_engine[pytorch]'",
           "torchao": "pip install torchao"}

# FP8 checks: 256 x 256 x 256 GEMMs on standard-normal operands, judged by the relative
# Frobenius error against the same computation in bf16. E4M3 keeps 3 mantissa bits and E5M2
# (gradients, hybrid format) 2, so quantization alone costs about 4% in the forward GEMM and 6%
# in the gradient GEMMs (measured with the CPU emulation); a wrong layout, scale or dtype is off
# by 100% or more. The tolerances sit between the two.
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
    from ..precision import fp8_unavailable
    out = {}
    for recipe in TE_RECIPES:
        reason = run_check(lambda r=recipe: {"reason": fp8_unavailable(device, te_recipe=r)})
        if not reason["ok"]:   # the query itself raised: a reason too, never a traceback
            reason = {"reason": f"availability check failed ({reason['error']})"}
        out[recipe] = {"available": reason["reason"] is None, "reason": reason["reason"],
                       "gemm": None}
        if out[recipe]["available"]:
            out[recipe]["gemm"] = run_check(check_te, device, recipe)
    return out


def fp8_gate(device_report: dict) -> str | None:
    """Why no FP8 GEMM can run on this device, or None when one can."""
    if not device_report["cuda"]:
        return f"no CUDA device: {device_report['reason']}"
    import torch

    from ..precision import fp8_unavailable   # the trainer's own rule (cc >= 8.9)
    return fp8_unavailable(torch.device("cuda", device_report["index"]))


# ----------------------------------------------------------------------------------- imports

def fp8_imports() -> dict:
    """Per backend: does it import here (no device needed)."""
    from ..precision import backend_version   # torch and the backends load here
    return {name: _import_check(lambda n=name: backend_version(n)) for name in BACKENDS}


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


# ------------------------------------------------------------------------------ GEMM checks

def judge(result: dict) -> dict:
    """`result` as it is when its errors are within FWD_TOL / GRAD_TOL; CheckFailed if not."""
    bad = [f"{key} relative error {result[key]:.3g} > {tol}" for key, tol in
           (("fwd_err", FWD_TOL), ("grad_err", GRAD_TOL)) if key in result
           and not result[key] <= tol]   # "not <=" so that NaN fails too
    if bad:
        raise CheckFailed(f"{result['what']}: " + "; ".join(bad) + " against bf16")
    return result


def check_native(device) -> dict:
    """The native backend's forward (E4M3 x E4M3, fast accumulation) and grad_input (E5M2 x
    E4M3) GEMMs through its own fp8_mm. torch._scaled_mm also exists on CPU, so the CPU test
    runs this for real."""
    from ..precision import gemm_errors
    return judge(gemm_errors("native", device))


def check_torchao(device) -> dict:
    """A Linear converted by torchao's convert_to_float8_training (its default recipe), forward
    and backward. On CPU torchao emulates the FP8 GEMMs (the CPU test runs that)."""
    from ..precision import gemm_errors
    return judge(gemm_errors("torchao", device))


def check_te(device, recipe_name: str = "delayed") -> dict:
    """te.Linear forward and backward under TE's autocast with the recipe a training config with
    this fp8_recipe builds, three steps, the last judged (under delayed scaling the later steps
    take their scales from the amax history)."""
    from ..precision import gemm_errors
    return judge(gemm_errors("te", device, recipe_name))
