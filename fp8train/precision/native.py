"""FP8 Linear layers on `torch._scaled_mm`, with Transformer Engine's delayed or current
scaling.

Each converted Linear quantizes its input and weight (E4M3) and, in backward, its grad_output
(E5M2 in the hybrid format). Under delayed scaling (fp8_recipe: delayed) the scales come from
an amax history, exactly as TE's DelayedScaling recipe does (see scaling.update_delayed_scaling);
under current scaling (fp8_recipe: current, TE's Float8CurrentScaling) each tensor is scaled from
its own amax as it is cast (scaling.current_scale), and the history is neither kept nor reduced.
All three GEMMs (forward, grad_input, grad_weight) take FP8 operands; the forward uses fast
accumulation, the two backward GEMMs do not (as TE does).

The state of every layer lives in one module (`model.fp8_state`): an amax history
[history_len, layers, 3] and scales [layers, 3], columns (input, weight, grad_output); under
current scaling a history of one row that stays zero (nothing carries over between steps). One update
per micro-batch covers the whole model, and the state is saved and restored with the model's
own tensors, so a resumed run continues with the same scales. A model with no converted layer
has an empty state ([history_len, 0, 3] and [0, 3], left out of checkpoints) and trains in its
base precision.

The layer is written for `torch.compile`: no graph break, no Python-side state change that a
compiled graph could not replay. Each cast takes its tensor's amax (the one delayed scaling
records for the next step) and the transposed copy that the backward GEMMs need in the same
traced function (`cast_fp8`, what TE's cast-transpose kernel does), for the compiler to fuse.
Each layer writes only tensors of its own, through in-place ops that torch.compile keeps in its
graphs, forward and backward alike: this micro-batch's amaxes (`fp8_amax`, folded into the
shared history by `Fp8State.fold` after backward, eagerly) and a watched step's statistics
(`fp8_stats`, base.stats_row). A tensor shared by every layer and written by each would break
under DDP's compiled graphs, which are split at bucket boundaries: one graph saves it for
backward and the next changes it. A layer finds its scales by a position tensor, not a Python
int, so layers compiled one by one (FSDP2 wraps each block) share one graph. Python flags that
change what is traced (watching, FP8 on or off) cost one recompilation each, never one per
layer.

Under gradient accumulation the backend (`Native`) casts each weight once per optimizer step,
before the first micro-batch (eagerly, in `fp8_context`), and every micro-batch of the step
reads that FP8 weight with the scale it was cast with (Transformer Engine's
is_first_microbatch). A weight whose tensor changed in between (a rollback, a load) is cast
again. The cache is kept out of checkpoints; it is off under
FSDP (weights are sharded outside the forward) and without accumulation (nothing to reuse).

On a CPU the GEMMs are emulated: each cast rounds to FP8 and keeps the FP8 values in fp32 (once:
every GEMM of the layer reads them, none converts again), multiplied in fp32 and divided by the
two scales, which gives the same numbers as `_scaled_mm` up to accumulation order (tested) at a
usable speed.
When data-parallel (DDP, FSDP), each micro-batch's amaxes are all-reduced (max) over the ranks
before the update, as Transformer Engine's reduce_amax does: every rank holds the same state,
computed from all the data, with no broadcast of buffers. The micro-batch probe's and the layer
timing's trials do not reduce (they differ per rank)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ranks import rank_world
from .base import N_FWD, Fp8Backend, WatchedStats, stats_row
from .layers import replace_module
from .scaling import FORMATS, FP8_MAX, current_scale, quant_stats, quantize, update_delayed_scaling

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2

# accelerate's distributed types under which a layer's weight is whole between forwards.
_WHOLE_WEIGHTS = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU")


def cast_fp8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transpose: bool,
             emulate: bool = False):
    """(t * scale in `dtype`, row-major; its transpose, row-major, when `transpose`; t's amax
    as fp32). One traced function, for a compiler to fuse; the amax is the one delayed scaling
    records (the cast itself uses the scale from history). `emulate`: the FP8 values exactly,
    held in fp32 (converted once, read by each emulated GEMM; no transpose)."""
    q = quantize(t, scale, dtype)
    if emulate:
        return q.float(), None, cast_fp8_amax(t)
    q = q.contiguous()  # a strided t (a transposed view) gives a copy
    q_t = q.t().contiguous() if transpose else None
    return q, q_t, cast_fp8_amax(t)


def cast_fp8_current(t: torch.Tensor, dtype: torch.dtype, transpose: bool,
                     emulate: bool = False):
    """cast_fp8 under current scaling: the scale is t's own (fp8_max / amax), so the amax comes
    first. Returns (q, q_t, amax, scale)."""
    amax = cast_fp8_amax(t)
    scale = current_scale(amax, FP8_MAX[dtype])
    q = quantize(t, scale, dtype)
    if emulate:
        return q.float(), None, amax, scale
    q = q.contiguous()
    return q, (q.t().contiguous() if transpose else None), amax, scale


def cast_fp8_amax(t: torch.Tensor) -> torch.Tensor:
    """max |t| as fp32: one reduction on a GPU; on a CPU, vector_norm's kernel is slower than
    abs and amax."""
    return (t.abs().amax() if t.device.type == "cpu" else
            torch.linalg.vector_norm(t, float("inf"))).float()


def _finite(amax: torch.Tensor) -> torch.Tensor:
    """A non-finite amax (a step whose update will be skipped) recorded as 0: in the history
    it would freeze the scale for history_len steps."""
    return torch.nan_to_num(amax, nan=0.0, posinf=0.0, neginf=0.0)


class Fp8State(nn.Module):
    def __init__(self, names: list, fp8_format: str = "hybrid", history_len: int = 1024,
                 margin: int = 0, algo: str = "max", emulate: bool = False,
                 per_layer_stats: bool = True, current: bool = False):
        super().__init__()
        n = len(names)
        self.current = current    # current scaling: each cast scales from its own amax
        history_len = 1 if current else history_len
        self.names = list(names)
        self.fwd_dtype, self.bwd_dtype = FORMATS[fp8_format]
        self.margin, self.algo, self.emulate = margin, algo, emulate
        self.register_buffer("amax_history", torch.zeros(history_len, n, 3))
        self.register_buffer("scale", torch.ones(n, 3))
        fmax = torch.tensor([FP8_MAX[self.fwd_dtype], FP8_MAX[self.fwd_dtype],
                             FP8_MAX[self.bwd_dtype]])
        self.register_buffer("fp8_max", fmax.expand(n, 3).clone(), persistent=False)
        self.enabled = True       # False: the layers run as plain Linears (bf16 evaluation)
        self.watching = False
        # The converted layers (plain references, not submodules: they belong to the model).
        self.layers: list = [None] * n
        self.stats = WatchedStats(self.names, self.layers, per_layer_stats)
        # True once Native.after_prepare set up the weight cache: the layers then read their
        # FP8 weights from it (Fp8Linear.cast_weight fills it), instead of casting them.
        self.cache_weights = False

    # No converted layer: nothing to checkpoint. The two empty buffers stay out of the state
    # dict, since empty tensors all share the null storage and accelerate's safetensors writer
    # keeps one tensor of those that share a storage (a resume would then miss the other).
    _EMPTY_SKIPPED = ("amax_history", "scale")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not self.names:
            for name in self._EMPTY_SKIPPED:
                destination.pop(prefix + name, None)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if not self.names:
            for name in self._EMPTY_SKIPPED:
                if prefix + name in missing_keys:
                    missing_keys.remove(prefix + name)

    def attach(self, layer: "Fp8Linear", index: int) -> None:
        """Give the layer at `index` its own tensors, as non-persistent buffers (moved with the
        model, never checkpointed): its micro-batch amaxes (input, weight, grad_output), its
        watched-step statistics and its position in the state (a tensor: see the module's
        docstring). The state reads them through the layer, as a move replaces them."""
        dev = layer.weight.device
        layer.register_buffer("fp8_amax", torch.zeros(3, device=dev), persistent=False)
        layer.register_buffer("fp8_stats", stats_row(dev), persistent=False)
        layer.register_buffer("fp8_pos", torch.tensor([index], device=dev), persistent=False)
        self.layers[index] = layer

    @torch.no_grad()
    def fold(self) -> None:
        """This micro-batch's amaxes, recorded by each layer, into the current history row (max,
        as a recomputed forward under activation checkpointing records the same value again);
        the layers' records start again from 0."""
        if self.layers:
            row = self.amax_history[0]
            torch.maximum(row, torch.stack([layer.fp8_amax for layer in self.layers]), out=row)
            for layer in self.layers:
                layer.fp8_amax.zero_()

    def watch(self, on: bool) -> None:
        self.watching = on
        if on:
            self.stats.start()

    @torch.no_grad()
    def update(self) -> None:
        """The scales from the history, after folding in the layers' records (fold)."""
        self.fold()
        if self.scale.numel() and not self.current:  # nothing to update: no layer, or no history
            update_delayed_scaling(self.amax_history, self.scale, self.fp8_max, self.margin,
                                   self.algo)


def fp8_mm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
           out_dtype: torch.dtype, emulate: bool, fast_accum: bool) -> torch.Tensor:
    """(a / scale_a) @ (b / scale_b) for FP8 a [M, K] (row-major) and b [K, N] (column-major);
    emulated: a and b hold FP8 values in fp32 (products of two FP8 values are exact in fp32)."""
    if emulate:
        return ((a.float() @ b.float()) / (scale_a * scale_b)).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=scale_a.reciprocal(), scale_b=scale_b.reciprocal(),
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


class _Fp8Matmul(torch.autograd.Function):
    """y = x @ w.t() from the FP8 operands cast outside (x2 and weight are inputs only for the
    gradients). Backward casts grad_output, records its amax (and statistics when watched) into
    the layer's own tensors, and runs the two backward GEMMs in FP8.

    xq: x2 in FP8, row-major; x_t: its transpose, row-major (None when emulating);
    wq: the weight in FP8 [N, K], row-major; w_t: its transpose [K, N], row-major (None when
    emulating); s_in, s_w, s_g: the scales of this pass (s_g unused under current scaling,
    where grad_output is scaled from its own amax); amax, stats: the layer's own records;
    meta: (record, watching, bwd_dtype, emulate, out_dtype, current)."""

    @staticmethod
    def forward(ctx, x2, weight, xq, x_t, wq, w_t, s_in, s_w, s_g, amax, stats, meta):
        emulate, out_dtype = meta[3], meta[4]
        y = fp8_mm(xq, s_in, wq.t(), s_w, out_dtype, emulate, fast_accum=True)
        # Column-major operands for the backward GEMMs: the transposed copies, seen transposed.
        ctx.save_for_backward(xq if emulate else x_t.t(), wq if emulate else w_t.t(),
                              s_in, s_w, s_g)
        # Not saved tensors: this backward writes them in place.
        ctx.amax, ctx.stats, ctx.meta = amax, stats, meta
        ctx.x_dtype, ctx.w_dtype = x2.dtype, weight.dtype
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x_cm, w_cm, s_in, s_w, s_g = ctx.saved_tensors
        record, watching, bwd_dtype, emulate, _, current = ctx.meta
        # grad_out can be strided (a compiled backward, a transposed use of the output):
        # _scaled_mm needs its first operand row-major, cast_fp8 makes it so.
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        if current:
            gq, gq_t, a_g, s_g = cast_fp8_current(g2, bwd_dtype, not emulate, emulate)
        else:
            gq, gq_t, a_g = cast_fp8(g2, s_g, bwd_dtype, not emulate, emulate)
        if record and not current:
            row = ctx.amax[GRAD_OUTPUT:]
            torch.maximum(row, _finite(a_g).reshape(1), out=row)
        if record and watching:
            sat, und = quant_stats(g2, s_g, bwd_dtype)
            ctx.stats[N_FWD:].copy_(torch.stack([s_g, a_g, sat, und]))
        grad_x = fp8_mm(gq, s_g, w_cm, s_w, ctx.x_dtype, emulate, fast_accum=False)
        grad_w = fp8_mm(gq.t() if emulate else gq_t, s_g, x_cm, s_in, ctx.w_dtype, emulate,
                        fast_accum=False)
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None, None


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
        state.attach(new, index)
        new.fp8_weight = new.fp8_weight_t = new.fp8_weight_scale = new.fp8_weight_amax = None
        return new

    def allocate_weight_cache(self) -> None:
        """Tensors for the FP8 weight kept across the micro-batches of a step. Plain attributes,
        not buffers: they are not state (never checkpointed, rebuilt from the weight)."""
        st, w = self.fp8_state, self.weight
        # Emulated: the FP8 values held in fp32 (cast_fp8's `emulate`).
        self.fp8_weight = torch.empty(w.shape, dtype=torch.float32 if st.emulate else
                                      st.fwd_dtype, device=w.device)
        self.fp8_weight_t = None if st.emulate else \
            torch.empty(w.shape[::-1], dtype=st.fwd_dtype, device=w.device)
        self.fp8_weight_scale = torch.ones((), device=w.device)
        self.fp8_weight_amax = torch.zeros((), device=w.device)

    @torch.no_grad()
    def cast_weight(self) -> None:
        """Cast the weight into the cache with the scale the forward would use."""
        st = self.fp8_state
        wq, _, a_w, s_w = self._cast_weight(st, st.scale[self.fp8_index, WEIGHT], False)  # eager
        self.fp8_weight.copy_(wq)
        if self.fp8_weight_t is not None:
            self.fp8_weight_t.copy_(self.fp8_weight.t())
        self.fp8_weight_scale.copy_(s_w)
        self.fp8_weight_amax.copy_(a_w)

    def _cast_weight(self, st: Fp8State, s_w: torch.Tensor, transpose: bool):
        """(weight in FP8, its transpose or None, its amax, the scale it was cast with): with
        the delayed scale `s_w`, or under current scaling with its own."""
        w = self.weight.detach()
        if st.current:
            return cast_fp8_current(w, st.fwd_dtype, transpose, st.emulate)
        return (*cast_fp8(w, s_w, st.fwd_dtype, transpose, st.emulate), s_w)

    def _weight_fp8(self, st: Fp8State, s_w: torch.Tensor):
        """(weight in FP8, its transpose or None, the scale it was cast with, its amax)."""
        if st.cache_weights:
            return self.fp8_weight, self.fp8_weight_t, self.fp8_weight_scale, \
                self.fp8_weight_amax
        wq, w_t, a_w, s_w = self._cast_weight(st, s_w, transpose=not st.emulate)
        return wq, w_t, s_w, a_w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        st = self.fp8_state
        if not st.enabled:
            return F.linear(x, self.weight, self.bias)
        # Only training passes move the scales; evaluation in FP8 reads them.
        record = self.training and torch.is_grad_enabled()
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        # A copy: the state is updated in place after this micro-batch, backward needs these.
        scales = st.scale.index_select(0, self.fp8_pos).reshape(3)
        s_in, s_g = scales[INPUT], scales[GRAD_OUTPUT]
        if st.current:
            xq, x_t, a_in, s_in = cast_fp8_current(x2.detach(), st.fwd_dtype,
                                                   not st.emulate, st.emulate)
        else:
            xq, x_t, a_in = cast_fp8(x2.detach(), s_in, st.fwd_dtype, not st.emulate,
                                     st.emulate)
        wq, w_t, s_w, a_w = self._weight_fp8(st, scales[WEIGHT])
        if record:
            with torch.no_grad():
                if not st.current:
                    row = self.fp8_amax[INPUT:WEIGHT + 1]
                    torch.maximum(row, _finite(torch.stack([a_in, a_w])), out=row)
                if st.watching:
                    sat_in, und_in = quant_stats(x2, s_in, st.fwd_dtype)
                    sat_w, und_w = quant_stats(self.weight, s_w, st.fwd_dtype)
                    self.fp8_stats[:N_FWD].copy_(torch.stack(
                        [s_in, s_w, a_in, a_w, sat_in, und_in, sat_w, und_w]))
        meta = (record, st.watching, st.bwd_dtype, st.emulate, out_dtype, st.current)
        y = _Fp8Matmul.apply(x2, self.weight, xq, x_t, wq, w_t, s_in, s_w, s_g,
                             self.fp8_amax, self.fp8_stats, meta)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8_index={self.fp8_index}"


class Native(Fp8Backend):
    """FP8 Linears on torch._scaled_mm (emulated on CPU), TE delayed- or current-scaling
    semantics."""
    label = "native"
    # Every rank holds the same FP8 state: the amaxes are all-reduced (max) before each update,
    # as Transformer Engine's reduce_amax does (so DDP need not broadcast buffers). False for
    # trials (for_trials): they differ per rank.
    reduce_amax = True

    def for_trials(self) -> "Native":
        self.reduce_amax = False
        return self

    def unavailable(self, device: torch.device) -> Optional[str]:
        if not hasattr(torch, "_scaled_mm"):
            return f"torch {torch.__version__} has no torch._scaled_mm"
        return self.device_gate(device, cpu_emulation=True)

    def convert(self, model: nn.Module) -> nn.Module:
        spec = self.spec
        names = self.select(model)
        self.state = Fp8State(names, spec.format, spec.amax_history_len, spec.margin,
                              spec.amax_compute_algo, self.emulate, spec.log_layers,
                              current=spec.recipe == "current")
        param = next(model.parameters(), None)
        if param is not None:
            self.state.to(param.device)
        self.layers = []
        for i, name in enumerate(names):
            layer = Fp8Linear.from_linear(model.get_submodule(name), self.state, i, name)
            replace_module(model, name, layer)
            self.layers.append(layer)
        model.fp8_state = self.state
        self.recorder = self.state
        self.accelerator = None
        self.cast_versions: Optional[list] = None  # the weights the cache was cast from
        self.new_step = True
        return model

    def after_prepare(self, accelerator) -> None:
        """With gradient accumulation and whole weights, cast each weight once per step."""
        kind = getattr(accelerator, "distributed_type", "NO")
        if not self.layers or getattr(accelerator, "gradient_accumulation_steps", 1) < 2 or \
                getattr(kind, "value", kind) not in _WHOLE_WEIGHTS:
            return
        self.accelerator = accelerator
        for layer in self.layers:
            layer.allocate_weight_cache()
        self.state.cache_weights = True

    def _weight_versions(self) -> list:
        return [(id(lay.weight), lay.weight._version) for lay in self.layers]

    def fp8_context(self):
        """Before the first FP8 pass of a step, and after a weight changed in between (a
        rollback, a load), the weights are cast into the cache: eagerly, outside any compiled
        graph, which then has a single variant that reads the cache."""
        if self.state.cache_weights:
            versions = self._weight_versions()
            if self.new_step or versions != self.cast_versions:
                for layer in self.layers:
                    layer.cast_weight()
                self.cast_versions, self.new_step = versions, False
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def high_precision(self):
        self.state.enabled = False
        try:
            yield
        finally:
            self.state.enabled = True

    def after_backward(self) -> None:
        # Current scaling keeps no history: nothing to reduce or update. (Each rank scales its
        # own activations, as TE's current scaling does under data parallelism; the weights,
        # whole on every rank at the forward, get the same scale everywhere.)
        if not self.disabled and not self.state.current:
            self.state.fold()
            if self.reduce_amax and rank_world()[1] > 1:
                # The amax over every rank's data of this micro-batch (one small all-reduce of
                # [layers, 3] values), so that every rank computes the same scales.
                torch.distributed.all_reduce(self.state.amax_history[0],
                                             op=torch.distributed.ReduceOp.MAX)
            self.state.update()
        if self.accelerator is not None and self.accelerator.sync_gradients:
            self.new_step = True  # the optimizer steps next: the next pass casts the weights

    def raise_margin(self) -> bool:
        if self.spec.recipe == "current":
            return False
        self.state.margin += 1
        return True

    def describe(self) -> str:
        how = "emulated on CPU: numerics only, no speed-up" if self.emulate \
            else "torch._scaled_mm"
        if self.spec.recipe == "current":
            return (f"FP8 native ({how}); current scaling (each tensor scaled from its own "
                    f"amax at every cast), {self.spec.format}")
        return (f"FP8 native ({how}); delayed scaling, {self.spec.format}, margin "
                f"{self.margin()}, amax history {self.spec.amax_history_len} "
                f"({self.spec.amax_compute_algo})")

