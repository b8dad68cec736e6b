"""FP8 Linear layers on `torch._scaled_mm`, with Transformer Engine's delayed scaling.

Each converted Linear quantizes its input and weight (E4M3) and, in backward, its grad_output
(E5M2 in the hybrid format) with scales computed from an amax history, exactly as TE's
DelayedScaling recipe does (see scaling.update_delayed_scaling). All three GEMMs (forward,
grad_input, grad_weight) take FP8 operands; the forward uses fast accumulation, the two
backward GEMMs do not (as TE does).

The state of every layer lives in one module (`model.fp8_state`): an amax history
[history_len, layers, 3] and scales [layers, 3], columns (input, weight, grad_output). One update
per micro-batch covers the whole model, and the state is saved and restored with the model's
own tensors, so a resumed run continues with the same scales.

On a CPU the GEMMs are emulated: the FP8 values are dequantized and multiplied in fp32, which
gives the same numbers as `_scaled_mm` up to accumulation order (tested) at a usable speed.
The state is rank 0's when data-parallel: DDP broadcasts buffers from rank 0 every forward
(TE instead reduces amax across ranks)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .base import Fp8Backend, LayerStats
from .layers import replace_module
from .scaling import FORMATS, FP8_MAX, quant_stats, quantize, update_delayed_scaling

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2


class Fp8State(nn.Module):
    def __init__(self, names: list, fp8_format: str = "hybrid", history_len: int = 1024,
                 margin: int = 0, algo: str = "max", emulate: bool = False,
                 per_layer_stats: bool = True):
        super().__init__()
        n = len(names)
        self.names = list(names)
        self.fwd_dtype, self.bwd_dtype = FORMATS[fp8_format]
        self.margin, self.algo, self.emulate = margin, algo, emulate
        self.register_buffer("amax_history", torch.zeros(history_len, n, 3))
        self.register_buffer("scale", torch.ones(n, 3))
        fmax = [FP8_MAX[self.fwd_dtype], FP8_MAX[self.fwd_dtype], FP8_MAX[self.bwd_dtype]]
        self.register_buffer("fp8_max", torch.tensor([fmax] * n), persistent=False)
        self.enabled = True       # False: the layers run as plain Linears (bf16 evaluation)
        self.watching = False
        self.stats = LayerStats(per_layer_stats)

    @torch.no_grad()
    def record(self, index: int, cols: slice, *amaxes: torch.Tensor) -> None:
        """Fold this pass's amax into the current history row (max, so that a recomputed forward
        under activation checkpointing records the same value, not a second one). A non-finite
        amax (a step whose update will be skipped) is not recorded: in the history it would
        freeze the scale for history_len steps."""
        new = torch.stack([a.float() for a in amaxes])
        new = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
        row = self.amax_history[0, index, cols]
        torch.maximum(row, new, out=row)

    def watch(self, on: bool) -> None:
        self.watching = on
        if on:
            self.stats.clear()

    @torch.no_grad()
    def update(self) -> None:
        update_delayed_scaling(self.amax_history, self.scale, self.fp8_max, self.margin,
                               self.algo)


def fp8_mm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
           out_dtype: torch.dtype, emulate: bool, fast_accum: bool) -> torch.Tensor:
    """(a / scale_a) @ (b / scale_b) for FP8 a [M, K] (row-major) and b [K, N] (column-major)."""
    if emulate:
        return ((a.float() @ b.float()) / (scale_a * scale_b)).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=scale_a.reciprocal(), scale_b=scale_b.reciprocal(),
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, layer, record):
        st: Fp8State = layer.fp8_state
        i = layer.fp8_index
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        # Clones: the state is updated in place after this micro-batch, backward needs these.
        s_in, s_w = st.scale[i, INPUT].clone(), st.scale[i, WEIGHT].clone()
        xq = quantize(x2, s_in, st.fwd_dtype)
        wq = quantize(weight, s_w, st.fwd_dtype)
        if record:
            a_in, a_w = x2.abs().amax(), weight.abs().amax()
            st.record(i, slice(INPUT, WEIGHT + 1), a_in, a_w)
            if st.watching:
                sat_in, und_in = quant_stats(x2, s_in, st.fwd_dtype)
                sat_w, und_w = quant_stats(weight, s_w, st.fwd_dtype)
                st.stats.record(layer.fp8_name, fwd_scale_input=s_in, fwd_scale_weight=s_w,
                                amax_input=a_in, amax_weight=a_w, saturated_input=sat_in,
                                underflow_input=und_in, saturated_weight=sat_w,
                                underflow_weight=und_w)
        y = fp8_mm(xq, s_in, wq.t(), s_w, out_dtype, st.emulate, fast_accum=True)
        ctx.save_for_backward(xq, wq, s_in, s_w)
        ctx.layer, ctx.record = layer, record
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        xq, wq, s_in, s_w = ctx.saved_tensors
        layer = ctx.layer
        st: Fp8State = layer.fp8_state
        i = layer.fp8_index
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        s_g = st.scale[i, GRAD_OUTPUT].clone()
        gq = quantize(g2, s_g, st.bwd_dtype)
        if ctx.record:
            a_g = g2.abs().amax()
            st.record(i, slice(GRAD_OUTPUT, GRAD_OUTPUT + 1), a_g)
            if st.watching:
                sat, und = quant_stats(g2, s_g, st.bwd_dtype)
                st.stats.record(layer.fp8_name, bwd_scale_grad_output=s_g, amax_grad_output=a_g,
                                saturated_grad_output=sat, underflow_grad_output=und)
        emulate = st.emulate
        # _scaled_mm wants its second operand column-major: transpose-copy-transpose.
        w_cm = wq if emulate else wq.t().contiguous().t()
        x_cm = xq if emulate else xq.t().contiguous().t()
        gq_t = gq.t() if emulate else gq.t().contiguous()
        grad_x = fp8_mm(gq, s_g, w_cm, s_w, ctx.x_dtype, emulate, fast_accum=False)
        grad_w = fp8_mm(gq_t, s_g, x_cm, s_in, ctx.w_dtype, emulate, fast_accum=False)
        return grad_x.reshape(ctx.x_shape), grad_w, None, None


@torch.compiler.disable
def _fp8_matmul(x, weight, layer, record):
    # Eager under torch.compile: the state updates are side effects dynamo would recompile for
    # every layer shape; the rest of the model still compiles around it.
    return _Fp8Matmul.apply(x, weight, layer, record)


class Fp8Linear(nn.Linear):
    """nn.Linear whose matmuls run in FP8 with delayed scaling (state in `fp8_state`)."""

    @classmethod
    def from_linear(cls, lin: nn.Linear, state: Fp8State, index: int, name: str) -> "Fp8Linear":
        new = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
        new.weight = lin.weight
        new.bias = lin.bias
        new.fp8_index, new.fp8_name = index, name
        # A plain attribute, not a submodule: the state is registered once, on the model root.
        object.__setattr__(new, "fp8_state", state)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_state.enabled:
            return F.linear(x, self.weight, self.bias)
        # Only training passes move the scales; evaluation in FP8 reads them.
        record = self.training and torch.is_grad_enabled()
        y = _fp8_matmul(x, self.weight, self, record)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8_index={self.fp8_index}"


class Native(Fp8Backend):
    """FP8 Linears on torch._scaled_mm (emulated on CPU), TE delayed-scaling semantics."""
    label = "native"

    def unavailable(self, device: torch.device) -> Optional[str]:
        if not hasattr(torch, "_scaled_mm"):
            return f"torch {torch.__version__} has no torch._scaled_mm"
        return self.device_gate(device, cpu_emulation=True)

    def convert(self, model: nn.Module) -> nn.Module:
        cfg = self.cfg
        names = self.select(model)
        self.state = Fp8State(names, cfg.fp8_format, cfg.fp8_amax_history_len, cfg.fp8_margin,
                              cfg.fp8_amax_compute_algo, self.emulate, cfg.fp8_log_layers)
        self.state.to(next(model.parameters()).device)
        for i, name in enumerate(names):
            replace_module(model, name, Fp8Linear.from_linear(model.get_submodule(name),
                                                             self.state, i, name))
        model.fp8_state = self.state
        self.recorder = self.state
        return model

    @contextlib.contextmanager
    def high_precision(self):
        self.state.enabled = False
        try:
            yield
        finally:
            self.state.enabled = True

    def after_backward(self) -> None:
        if not self.disabled:
            self.state.update()

    def raise_margin(self) -> bool:
        self.state.margin += 1
        return True

    def describe(self) -> str:
        how = "emulated on CPU: numerics only, no speed-up" if self.emulate \
            else "torch._scaled_mm"
        return (f"FP8 native ({how}); delayed scaling, {self.cfg.fp8_format}, margin "
                f"{self.margin()}, amax history {self.cfg.fp8_amax_history_len} "
                f"({self.cfg.fp8_amax_compute_algo})")
