"""Precision backends, chosen by name from the config and applied from outside the model.

    fp32, bf16, fp16                  the run's base precision (key `precision`)
    te, torchao, native               FP8 for the selected Linears (keys use_fp8, fp8_backend),
                                      with the base precision everywhere else

`build_precision` picks one, checks it can run on this device, and falls back (one loud
warning) or stops (exit 2) when it cannot, as `fp8_fallback` says. The loop talks to the
`Precision` it returns through its verbs (convert, forward_context, after_backward,
after_optimizer_step, watch/stats, recover, hand_over, state_dict, report).

This module is the folder's whole public face (`__all__`): nothing outside precision/ imports
from its modules. Besides the two above: `base_precision` (the autocast a run evaluates in),
`Fp8Spec` (the FP8 settings, read once from the config and frozen: spec.py), `choose` (fp8
auto), `verdict_lines` (what FP8 bought a run, in words), and for the GPU check
`gemm_errors`, `backend_version`, `fp8_unavailable` and `rel_error`."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..config.load import Config
from ..config.load import section as config_section
from ..errors import BadInput
from .backends import converter, fp8_backends
from .base import Precision
from .choose import choose
from .gemm_checks import backend_version, fp8_unavailable, gemm_errors
from .numerics import rel_error
from .plain import BF16, FP16, FP32
from .spec import AUTO_RECIPES, Fp8Spec
from .verdict import describe as verdict_lines

BASE = {"fp32": FP32, "bf16": BF16, "fp16": FP16}


def base_precision(section, device: torch.device) -> Precision:
    """The base precision (fp32, bf16, fp16) the config's precision section names for
    `device` (auto: bf16 where CUDA runs it, else fp32); BadInput when it cannot run there."""
    name = section.name
    if name == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        name = "bf16" if cuda_bf16 else "fp32"
    prec = BASE[name]()
    reason = prec.unavailable(device)
    if reason:
        raise BadInput(f"{section.where('precision')}: key 'precision': {reason}; use "
                          f"{'bf16 or ' if name != 'bf16' else ''}fp32")
    return prec


def build_precision(cfg: Config, device: torch.device, warn: Callable[[str], None],
                    run_dir: Optional[str] = None, chosen: Optional[dict] = None) -> Precision:
    """The run's precision: the base (bf16/fp32/fp16), or an FP8 backend over it. `run_dir`:
    where the backend caches its layer timings (a sweep trial's own directory; default
    output_dir); `chosen`: a finished run's derived values (its config.yaml's), whose backend
    and recipe replace fp8 auto's (evaluating its checkpoint as it trained). The config is
    read here once, into the FP8 spec (spec.Fp8Spec) the backend reads from then on."""
    base = base_precision(config_section(cfg, "precision"), device)
    if not cfg.use_fp8:
        return base
    spec = Fp8Spec.of(cfg, run_dir)
    if chosen is not None:
        spec = spec.as_chosen(chosen)
    # fp8 auto: a backend to start with (choose.py decides)
    spec = spec.provisional(_runs_here(spec, base, device))
    return converter(spec, base, device, warn)


def _runs_here(spec: Fp8Spec, base: Precision,
               device: torch.device) -> Callable[[str], bool]:
    """Whether an FP8 backend (with its default recipe) runs on `device`: on a GPU only, since
    on a CPU fp8_backend auto takes native, FP8 being emulated whatever the backend."""

    def runs(name: str) -> bool:
        if device.type != "cuda":
            return False
        trial = spec.decide(name, AUTO_RECIPES[name][0], "provisional")
        backend = fp8_backends()[name](trial, base)
        try:
            return backend.unavailable(device) is None
        except Exception:  # e.g. a format the default recipe refuses (a BadInput)
            return False
    return runs


__all__ = ["Precision", "Fp8Spec", "build_precision", "base_precision", "choose",
           "verdict_lines", "gemm_errors", "backend_version", "fp8_unavailable", "rel_error"]
