"""Scale read-out for FP8 layers we did not write (torchao, Transformer Engine): hooks that,
on watched steps only, measure the amax of each converted layer's input, weight and
grad_output, ask the backend which scale it used, and record the saturation / underflow
fractions that scale gives. Unwatched steps pay one Python branch per layer.

A backend that scales each tile of a tensor on its own (Transformer Engine's block scaling)
names the tile shape per tensor kind: its scale_fn then maps the grid of tile amaxes to the
grid of tile scales, the scale reported is the median tile scale, and each sampled value is
judged with its own tile's scale."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .base import LayerStats
from .scaling import block_amax, quant_stats, quant_stats_blocks

# scale_fn(module, kind, amax) -> the scale the backend applies to that tensor, where kind is
# "input", "weight" or "grad_output"; for a tiled kind, amax and the result are grids.
ScaleFn = Callable[[nn.Module, str, torch.Tensor], torch.Tensor]


class ScaleProbe:
    def __init__(self, modules: dict, scale_fn: ScaleFn, dtypes: dict, per_layer: bool = True,
                 tiles: Optional[dict] = None):
        """tiles: kind -> (rows, cols) of the tiles that kind is scaled by (TE's block
        scaling); kinds not named are scaled as a whole."""
        self.scale_fn, self.dtypes, self.tiles = scale_fn, dtypes, tiles or {}
        self.stats = LayerStats(per_layer)
        self.watching = False
        self.handles = [m.register_forward_hook(self._forward_hook(name))
                        for name, m in modules.items()]

    def _measure(self, name: str, module: nn.Module, kind: str, t: torch.Tensor) -> dict:
        t = t.detach()
        tile = self.tiles.get(kind)
        if tile is None:
            amax = t.abs().amax().float()
            # A copy: a backend may update its scale in place before the stats are read.
            scale = self.scale_fn(module, kind, amax).detach().float().reshape(()).clone()
            sat, under = quant_stats(t, scale, self.dtypes[kind])
        else:
            amaxes = block_amax(t, tile)
            amax = amaxes.amax()
            scales = self.scale_fn(module, kind, amaxes).detach().float()
            sat, under = quant_stats_blocks(t, scales, tile, self.dtypes[kind])
            # The lower median: a scale some tile really has (a power of two stays one).
            scale = scales.reshape(-1).median()
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
