"""Scale read-out for FP8 layers we did not write (torchao, Transformer Engine): hooks that,
on watched steps only, measure the amax of each converted layer's input, weight and
grad_output, ask the backend which scale it used, and record the saturation / underflow
fractions that scale gives. Unwatched steps pay one Python branch per layer."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .base import LayerStats
from .scaling import quant_stats

# scale_fn(module, kind, amax) -> the scale the backend applies to that tensor, where kind is
# "input", "weight" or "grad_output".
ScaleFn = Callable[[nn.Module, str, torch.Tensor], torch.Tensor]


class ScaleProbe:
    def __init__(self, modules: dict, scale_fn: ScaleFn, dtypes: dict, per_layer: bool = True):
        self.scale_fn, self.dtypes = scale_fn, dtypes
        self.stats = LayerStats(per_layer)
        self.watching = False
        self.handles = [m.register_forward_hook(self._forward_hook(name))
                        for name, m in modules.items()]

    def _measure(self, name: str, module: nn.Module, kind: str, t: torch.Tensor) -> dict:
        t = t.detach()
        amax = t.abs().amax().float()
        # A copy: a backend may update its scale in place before the stats are read.
        scale = self.scale_fn(module, kind, amax).detach().float().reshape(()).clone()
        sat, under = quant_stats(t, scale, self.dtypes[kind])
        prefix = {"input": "fwd", "weight": "fwd", "grad_output": "bwd"}[kind]
        return {f"{prefix}_scale_{kind}": scale, f"amax_{kind}": amax,
                f"saturated_{kind}": sat, f"underflow_{kind}": under}

    def _forward_hook(self, name: str):
        def hook(module, inputs, output):
            if not self.watching or not module.training or not torch.is_grad_enabled():
                return
            vals = self._measure(name, module, "input", inputs[0])
            vals.update(self._measure(name, module, "weight", module.weight))
            self.stats.record(name, **vals)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(
                    lambda g: self.stats.record(name, **self._measure(name, module,
                                                                       "grad_output", g)))
        return hook

    def watch(self, on: bool) -> None:
        self.watching = on
        if on:
            self.stats.clear()
