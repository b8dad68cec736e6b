"""Precision backends, chosen by name from the config and applied from outside the model.

    fp32, bf16, fp16                  the run's base precision (key `precision`)
    te, torchao, native               FP8 for the selected Linears (keys use_fp8, fp8_backend),
                                      with the base precision everywhere else

`build_precision` picks one, checks it can run on this device, and falls back (one loud
warning) or stops (exit 2) when it cannot, as `fp8_fallback` says. What the rest of the package
uses besides: `choose` (fp8 auto), `numerics` (activations captured for its check), `verdict`
(what FP8 bought a run), `gemm_checks` (each backend's GEMMs against bf16, for the GPU check)."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..config.load import Config
from ..errors import BadInput
from .backends import fp8_backends
from .base import Precision
from .plain import BF16, FP16, FP32

BASE = {"fp32": FP32, "bf16": BF16, "fp16": FP16}


def base_precision(cfg: Config, device: torch.device) -> Precision:
    name = cfg.precision
    if name == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        name = "bf16" if cuda_bf16 else "fp32"
    prec = BASE[name]()
    reason = prec.unavailable(device)
    if reason:
        raise BadInput(f"{cfg.where('precision')}: key 'precision': {reason}; use "
                          f"{'bf16 or ' if name != 'bf16' else ''}fp32")
    return prec


def build_precision(cfg: Config, device: torch.device, warn: Callable[[str], None],
                    run_dir: Optional[str] = None) -> Precision:
    """The run's precision: the base (bf16/fp32/fp16), or an FP8 backend over it. `run_dir`:
    where the backend caches its layer timings (a sweep trial's own directory; default
    output_dir)."""
    base = base_precision(cfg, device)
    if not cfg.use_fp8:
        return base
    from .choose import provisional   # fp8 auto: a backend to start with (choose.py decides)
    cfg = provisional(cfg, _runs_here(cfg, base, device))
    backend = fp8_backends()[cfg.fp8_backend](cfg, base, run_dir)
    reason = backend.unavailable(device)
    if reason is None:
        return backend
    if cfg.fp8_fallback == "error":
        raise BadInput(f"{cfg.where('fp8_backend', 'use_fp8')}: key 'fp8_backend': "
                          f"'{cfg.fp8_backend}' cannot run "
                          f"here: {reason} (fp8_fallback: error; fp8_fallback: bf16 trains "
                          "without FP8 instead)")
    warn(f"FP8 backend '{cfg.fp8_backend}' cannot run here: {reason}. Training WITHOUT FP8, "
         f"in {base.name} (fp8_fallback: bf16; set fp8_fallback: error to stop instead)")
    base.fallback_from = f"{cfg.fp8_backend}: {reason}"
    return base


def _runs_here(cfg: Config, base: Precision, device: torch.device) -> Callable[[str], bool]:
    """Whether an FP8 backend (with its default recipe) runs on `device`: on a GPU only, since
    on a CPU fp8_backend auto takes native, FP8 being emulated whatever the backend."""
    from .choose import AUTO_RECIPES, concrete

    def runs(name: str) -> bool:
        if device.type != "cuda":
            return False
        backend = fp8_backends()[name](concrete(cfg, name, AUTO_RECIPES[name][0]), base)
        try:
            return backend.unavailable(device) is None
        except Exception:  # e.g. a format the default recipe refuses (a BadInput)
            return False
    return runs


__all__ = ["Precision", "build_precision", "base_precision", "BASE"]
