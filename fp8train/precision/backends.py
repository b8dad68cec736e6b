"""The FP8 backends by name (imported when first asked for: each pulls in its library), and
the one way a backend is made from a spec for a device."""
from __future__ import annotations

from typing import Callable

from ..errors import BadInput


def fp8_backends() -> dict:
    from .ao import TorchAO
    from .native import Native
    from .te import TransformerEngine
    return {"te": TransformerEngine, "torchao": TorchAO, "native": Native}


def converter(spec, base, device, warn: Callable[[str], None]):
    """The backend `spec` names (spec.Fp8Spec, its backend decided) over the precision `base`,
    for `device`; where it cannot run there, `base` with one loud warning (fp8_fallback: bf16)
    or a BadInput (fp8_fallback: error)."""
    backend = fp8_backends()[spec.backend](spec, base)
    reason = backend.unavailable(device)
    if reason is None:
        return backend
    if spec.fallback == "error":
        raise BadInput(f"{spec.where('fp8_backend', 'use_fp8')}: key 'fp8_backend': "
                       f"'{spec.backend}' cannot run here: {reason} (fp8_fallback: error; "
                       "fp8_fallback: bf16 trains without FP8 instead)")
    warn(f"FP8 backend '{spec.backend}' cannot run here: {reason}. Training WITHOUT FP8, "
         f"in {base.name} (fp8_fallback: bf16; set fp8_fallback: error to stop instead)")
    base.fallback_from = f"{spec.backend}: {reason}"
    return base
