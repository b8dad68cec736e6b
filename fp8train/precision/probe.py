"""Scale read-out for FP8 layers we did not write (torchao, Transformer Engine): hooks that,
on watched steps only, measure the amax of each converted layer's input, weight and
grad_output, ask the backend which scale it used, and record the saturation / underflow
fractions that scale gives. Unwatched steps pay one Python branch per layer.

A backend that scales each tile of a tensor on its own (Transformer Engine's block scaling)
names the tile shape per tensor kind: its scale_fn then maps the grid of tile amaxes to the
grid of tile scales, the scale reported is the median tile scale, and each sampled value is
judged with its own tile's scale.

The probe is written for torch.compile, like the native layers: the statistics go into one
[layers, 12] buffer through in-place tensor ops, the forward's from a forward hook, the
grad_output's from the backward of an identity op the hook puts after the layer's output (a
tensor hook there would break the compiled graph at every layer). Watching is a Python flag: a
watched step costs one recompilation, once, never one per layer or per step."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .base import BWD_STATS, FWD_STATS, N_FWD, WatchedStats
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
        self.modules = list(modules.values())
        self.values: Optional[torch.Tensor] = None   # [layers, 12], allocated when first watched
        self.seen = dict.fromkeys(range(len(modules)), False)
        self.stats = WatchedStats(list(modules), self, "values", self.seen, per_layer)
        self.watching = False
        self.identity = _grad_output_probe(self)
        self.handles = [m.register_forward_hook(self._forward_hook(i))
                        for i, m in enumerate(self.modules)]

    def _measure(self, module: nn.Module, kind: str, t: torch.Tensor) -> dict:
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

    @torch.no_grad()
    def _store(self, index: int, columns: tuple, vals: dict) -> None:
        first = 0 if columns is FWD_STATS else N_FWD
        row = torch.stack([vals[k].float().reshape(()) for k in columns])
        self.values[index, first:first + len(columns)].copy_(row)

    def _forward_hook(self, index: int):
        def hook(module, inputs, output):
            if not self.watching or not module.training or not torch.is_grad_enabled():
                return None
            vals = self._measure(module, "input", inputs[0])
            vals.update(self._measure(module, "weight", module.weight))
            self._store(index, FWD_STATS, vals)
            self.seen[index] = True
            if isinstance(output, torch.Tensor) and output.requires_grad:
                return self.identity.apply(output, self.values, index)
            return None
        return hook

    def grad_output(self, index: int, grad: torch.Tensor) -> None:
        """Record the statistics of a watched layer's grad_output (called in backward)."""
        vals = self._measure(self.modules[index], "grad_output", grad)
        self._store(index, BWD_STATS, vals)

    def watch(self, on: bool) -> None:
        self.watching = on
        if on:
            if self.values is None:
                device = next(iter(self.modules[0].parameters())).device if self.modules \
                    else torch.device("cpu")
                self.values = torch.zeros(len(self.modules), N_FWD + len(BWD_STATS),
                                          device=device)
            self.stats.clear()
            self.values.zero_()


def _grad_output_probe(probe: ScaleProbe):
    """The identity, whose backward hands the gradient to `probe.grad_output`. A class per probe
    (an autograd.Function under torch.compile takes tensors and constants, not arbitrary
    objects); `values` is the probe's buffer, passed so that the graph sees the backward write
    to it."""
    class GradOutputProbe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y: torch.Tensor, values: torch.Tensor, index: int):
            ctx.index = index
            return y.view_as(y)

        @staticmethod
        def backward(ctx, grad: torch.Tensor):
            probe.grad_output(ctx.index, grad)
            return grad, None, None
    return GradOutputProbe
