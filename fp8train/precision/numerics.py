"""The numerics gate of fp8 auto (choose.py): does a recipe compute this model's Linears close
enough to the base precision?

For each eligible shape, one layer with the model's own weights is run in FP8 (a timing copy of
the candidate backend) and as a plain nn.Linear in the base precision (autocast, as Accelerate
runs it), on the same input rows and output gradient: `warmup` training steps of the FP8 layer
first (delayed scaling then has a history), then one step of each. The relative errors
||fp8 - base|| / ||base|| of the output and of the input gradient, worst over the shapes, are
the candidate's; choose.py holds them to its bounds.

The inputs are the model's own: `capture` runs one forward and backward of the freshly
initialised model on a real micro-batch of the training data and keeps, for the first layer of
each shape, its weights, the rows it was fed and the gradient that reached its output. Their
distributions are the model's (a normalised residual stream into qkv and fc, the attention
output into proj, SwiGLU's or GELU's skewed output into the MLP's proj, and gradients as small
as the loss makes them), which is what decides whether a recipe's scaling underflows or
saturates; Gaussian noise of unit variance (`gaussian`, the fallback) would pass a recipe that
this model's tensors break. At most `ROWS` rows per shape."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from ..memory import release_memory
from .layers import shape_of
from .timing import autocast_dtype, fp8_layer

ROWS = 8192


@dataclass
class Sample:
    """What one layer of a shape computes on: its weights, input rows and output gradient."""
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    x: torch.Tensor
    grad: torch.Tensor


def capture(model: nn.Module, tokens: torch.Tensor, base, shapes, rows: int = ROWS) -> dict:
    """{shape: Sample} of the first Linear of each of `shapes` in `model` (on its device, in
    training mode), from one forward and backward on `tokens` (B, T+1: inputs and next-token
    targets) in the base precision `base`."""
    device = next(model.parameters()).device
    wanted, taken, hooks, samples = set(shapes), {}, [], {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and shape_of(module) in wanted and \
                shape_of(module) not in taken:
            taken[shape_of(module)] = module
    for shape, module in taken.items():
        def keep(mod, args, out, shape=shape):
            if shape in samples:   # activation checkpointing's recompute: already kept
                return
            x = args[0].detach().reshape(-1, mod.in_features)[:rows].float()
            samples[shape] = Sample(mod.weight.detach().float().clone(),
                                    None if mod.bias is None else mod.bias.detach().float().clone(),
                                    x, None)
            out.register_hook(lambda g: _set_grad(samples[shape], g, rows))
        hooks.append(module.register_forward_hook(keep))
    dtype = autocast_dtype(base)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
    tokens = tokens.to(device)
    try:
        model.train()
        with autocast:
            loss = model(tokens[:, :-1], tokens[:, 1:])[0]
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    return {s: v for s, v in samples.items() if v.grad is not None}


def sample_model(make_model: Callable[[], nn.Module], train_tokens, micro: int, seq_len: int,
                 prec, shapes, device: torch.device) -> dict:
    """`capture` on a freshly initialised model (`make_model()`, moved to `device`) fed the
    first training sequences of `train_tokens` (a 1-D token array), as many as ROWS rows need
    and at most the micro-batch, in the base precision of `prec` (an FP8 backend); the RNG is
    left as it was."""
    import numpy as np
    n = min(micro, -(-ROWS // seq_len))
    tokens = torch.as_tensor(np.asarray(train_tokens[:n * (seq_len + 1)], dtype=np.int64))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = make_model().to(device)
        try:
            return capture(model, tokens.view(n, -1), prec.base, shapes)
        finally:
            del model


def _set_grad(sample: Sample, g: torch.Tensor, rows: int) -> None:
    sample.grad = g.detach().reshape(-1, g.shape[-1])[:rows].float()


def gaussian(shapes, device: torch.device, tokens: int) -> dict:
    """{shape: Sample} of unit-variance noise and a fresh layer's initialisation (the fallback
    when no model sample is at hand)."""
    out = {}
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = min(tokens, ROWS)
    for i, o, bias in shapes:
        layer = nn.Linear(i, o, bias=bias)
        out[(i, o, bias)] = Sample(
            layer.weight.detach(), layer.bias.detach() if bias else None,
            torch.randn(rows, i, generator=gen), torch.randn(rows, o, generator=gen))
    return {s: _on(v, device) for s, v in out.items()}


def _on(s: Sample, device) -> Sample:
    return Sample(s.weight.to(device), None if s.bias is None else s.bias.to(device),
                  s.x.to(device), s.grad.to(device))


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||; inf when it is not finite (a NaN must fail the check, not pass it)."""
    err = float(torch.linalg.vector_norm(a.float() - b.float()) /
                torch.linalg.vector_norm(b.float()).clamp_min(1e-30))
    return err if math.isfinite(err) else math.inf


def checker(samples: dict, device: torch.device, warmup: int = 3) -> Callable:
    """numerics_for(backend) -> (output error, input-gradient error), worst over `samples`
    ({shape: Sample}), on `device` (a CPU emulates the FP8 GEMMs: the tests)."""

    def numerics_for(backend) -> "tuple[float, float]":
        worst = [0.0, 0.0]
        dtype = autocast_dtype(backend.base)
        cuda = device.type == "cuda"
        for shape, sample in samples.items():
            with torch.random.fork_rng(devices=[device] if cuda else []), \
                    (torch.cuda.device(device) if cuda else contextlib.nullcontext()):
                torch.manual_seed(0)
                trial, layer = fp8_layer(shape, backend, device)
                ref = nn.Linear(shape[0], shape[1], bias=shape[2], device=device)
                with torch.no_grad():
                    for m in (layer, ref):
                        m.weight.copy_(sample.weight)
                        if shape[2]:
                            m.bias.copy_(sample.bias)
                try:
                    for _ in range(warmup):
                        _run(layer, sample.x, sample.grad, dtype, trial)
                    y, gx = _run(layer, sample.x, sample.grad, dtype, trial)
                    y_ref, gx_ref = _run(ref, sample.x, sample.grad, dtype, None)
                    worst[0] = max(worst[0], rel_error(y, y_ref))
                    worst[1] = max(worst[1], rel_error(gx, gx_ref))
                finally:
                    del trial, layer
                    backend.reset_trials()   # the trial's TE state, before the real model
                    release_memory(device if cuda else None)
        return worst[0], worst[1]

    return numerics_for


def _run(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, dtype, fp8):
    x = x.detach().clone().requires_grad_(True)
    autocast = torch.autocast(x.device.type, dtype=dtype) if dtype else contextlib.nullcontext()
    with autocast, (fp8.forward_context(training=True) if fp8 else contextlib.nullcontext()):
        y = layer(x)
    y.backward(g.to(y.dtype))
    if fp8 is not None:
        fp8.after_backward()
    layer.zero_grad(set_to_none=True)
    return y.detach().float(), x.grad.float()
