"""Scale read-out for FP8 layers we did not write (torchao, Transformer Engine): hooks that,
on watched steps only, measure the amax of each converted layer's input, weight and
grad_output, ask the backend which scale it used, and record the saturation / underflow
fractions that scale gives. Unwatched steps pay one Python branch per layer.

A backend that scales each tile of a tensor on its own (Transformer Engine's block scaling)
names the tile shape per tensor kind: its scale_fn then maps the grid of tile amaxes to the
grid of tile scales, the scale reported is the median tile scale, and each sampled value is
judged with its own tile's scale.

The probe is written for torch.compile, like the native layers: each layer's statistics go into
a row of its own (`module.fp8_stats`, base.stats_row) through in-place tensor ops, the forward's
from a forward hook, the grad_output's from the backward of an identity op the hook puts after
the layer's output (a tensor hook there would break the compiled graph at every layer). One hook
for every layer, which reads the row from its module: no per-layer constant for a compiled
graph to specialise on, so blocks compiled one by one (FSDP2) share one graph. Watching is a
Python flag: a watched step costs one recompilation, once, never one per layer or per step."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .base import BWD_STATS, FWD_STATS, N_FWD, WatchedStats, stats_row
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
        for m in modules.values():   # a plain attribute: not state, never checkpointed
            m.fp8_stats = stats_row(_stats_device(m))
        self.stats = WatchedStats(list(modules), list(modules.values()), per_layer)
        self.watching = False
        self.identity = _grad_output_probe(self)
        self.handles = [m.register_forward_hook(self._hook) for m in modules.values()]

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

    @staticmethod
    @torch.no_grad()
    def _store(row: torch.Tensor, columns: tuple, vals: dict, first: int) -> None:
        row[first:first + len(columns)].copy_(
            torch.stack([vals[k].float().reshape(()) for k in columns]))

    def _hook(self, module, inputs, output):
        if not self.watching or not module.training or not torch.is_grad_enabled():
            return None
        vals = self._measure(module, "input", inputs[0])
        vals.update(self._measure(module, "weight", module.weight))
        row = module.fp8_stats
        self._store(row, FWD_STATS, vals, 0)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            return self.identity.apply(output, row, module)
        return None

    def grad_output(self, module: nn.Module, row: torch.Tensor, grad: torch.Tensor) -> None:
        """Record the statistics of a watched layer's grad_output (called in backward)."""
        self._store(row, BWD_STATS, self._measure(module, "grad_output", grad), N_FWD)

    def watch(self, on: bool) -> None:
        self.watching = on
        if on:
            self.stats.start()


def _stats_device(module: nn.Module) -> torch.device:
    """Where a layer's statistics row lives: the GPU the run uses (the weights may sit in host
    memory under FSDP's CPU offload), else the weight's device."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return module.weight.device


def _grad_output_probe(probe: ScaleProbe):
    """The identity, whose backward hands the gradient to `probe.grad_output`. A class per probe
    (an autograd.Function under torch.compile takes tensors and constants, not arbitrary
    objects); `row` is the layer's statistics row, passed so that the graph sees the backward
    write to it."""
    class GradOutputProbe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y: torch.Tensor, row: torch.Tensor, module: nn.Module):
            ctx.row, ctx.module = row, module
            return y.view_as(y)

        @staticmethod
        def backward(ctx, grad: torch.Tensor):
            probe.grad_output(ctx.module, ctx.row, grad)
            return grad, None, None
    return GradOutputProbe
