"""Timing one Linear of each shape on the device, as the run would run it: the measurement behind
fp8_layers: auto (policy.py) and fp8_recipe / fp8_backend: auto (choose.py).

- A step is one layer's forward, backward and the backend's after_backward, fed `tokens` rows
  (micro-batch x seq_len), under the base precision's autocast with fp32 master weights, as
  Accelerate runs it; compiled with static shapes when the run compiles, since torchao's and the
  native casts pay off only fused (Transformer Engine's layers run eagerly, as in the run).
- The base precision is timed once per shape, however many FP8 candidates are compared with it;
  each candidate once per shape. After a candidate, dynamo forgets its compiled layers
  (`forget`): the next candidate compiles afresh, never counts against another's recompile
  limit, and CUDA graph pools (reduce-overhead) are freed. Every graph compiled is counted.
- Device time: CUDA events around `iters` steps that Python queues while the GPU is still busy
  with work queued before them, so that the events time the GPU's work and not Python's
  queuing; Python's time to queue one step is measured too. Their ratio (host / device) is
  reported: at or above 1 the GPU was waiting for Python (host-bound), the timing describes the
  launch overhead more than the layer, and the tables say so. The median of `repeats` rounds.
- On a CPU (the tests; the run itself times nothing there) the host's clock is both.
- The RNG is left as it was."""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from ..memory import release_memory

Shape = tuple   # (in_features, out_features, bias)

# Host / device above this: the measurement is host-bound, said in the tables.
HOST_BOUND = 0.8


@dataclass(frozen=True)
class Timed:
    seconds: float        # one step on the device
    host_seconds: float   # Python's time to queue one step

    @property
    def host_ratio(self) -> float:
        return self.host_seconds / self.seconds if self.seconds > 0 else math.inf


def autocast_dtype(base) -> Optional[torch.dtype]:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(base.mixed_precision)


def fp8_layer(shape: Shape, backend, device: torch.device) -> "tuple[object, nn.Module]":
    """(a timing copy of the backend, one Linear of `shape` that it converted)."""
    i, o, bias = shape
    trial = backend.timing_copy()
    why = trial.unavailable(device)
    if why:
        raise RuntimeError(f"FP8 {trial.label} cannot run: {why}")
    holder = nn.Module()
    holder.layer = nn.Linear(i, o, bias=bias, device=device)
    trial.convert(holder)
    return trial, holder.layer


def layer_step(layer: nn.Module, x: torch.Tensor, base, fp8=None,
               compiled: Optional[Callable] = None) -> Callable[[], None]:
    """One training step of `layer` on `x`: `compiled(layer)` when given (the run compiles),
    else eager; `fp8` the (timing copy of the) backend whose context and after_backward run."""
    dtype = autocast_dtype(base)
    grad: list = []
    run = compiled(layer) if compiled is not None else layer

    def step() -> None:
        autocast = torch.autocast(x.device.type, dtype=dtype) if dtype else \
            contextlib.nullcontext()
        with autocast, (fp8.forward_context(training=True) if fp8 else contextlib.nullcontext()):
            y = run(x)
        if not grad:
            grad.append(torch.randn_like(y))
        y.backward(grad[0])
        if fp8 is not None:
            fp8.after_backward()

    step.layer = run   # what is timed (compiled or not)
    return step


class LayerTimer:
    """Times shapes in the base precision (`base`) and converted by FP8 backends (`fp8`) on
    `device` at `tokens` rows; `spec`: the FP8 spec (compile, compile_mode)."""

    def __init__(self, device: torch.device, tokens: int, base, spec, warmup: int = 3,
                 repeats: int = 5, iters: int = 10):
        self.device, self.tokens, self.base_prec, self.spec = device, tokens, base, spec
        self.warmup, self.repeats, self.iters = warmup, repeats, iters
        self.graphs = 0          # graphs compiled so far (one per compiled layer: its fwd + bwd)
        self._base: dict = {}    # shape -> Timed: the base precision, once
        self._busy = None        # (a matrix, seconds of one product of it), on CUDA
        self._host = 0.0         # Python's time to queue the last round

    def base(self, shape: Shape) -> Timed:
        if shape not in self._base:
            i, o, bias = shape
            with self._scope():
                step = self._step(nn.Linear(i, o, bias=bias, device=self.device), None)
                self._base[shape] = self._time(step)
                del step
        return self._base[shape]

    def fp8(self, backend, shape: Shape) -> Timed:
        with self._scope():
            trial, layer = fp8_layer(shape, backend, self.device)
            try:
                return self._time(self._step(layer, trial))
            finally:
                del layer
                backend.reset_trials()     # the timing layer's TE state, before the real model

    def forget(self) -> None:
        """Dynamo forgets the compiled timing layers (and their CUDA graph pools)."""
        if self.spec.compile:
            torch.compiler.reset()
        release_memory(self.device if self.device.type == "cuda" else None)

    # --- how -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _scope(self):
        cuda = self.device.type == "cuda"
        with torch.random.fork_rng(devices=[self.device] if cuda else []), \
                (torch.cuda.device(self.device) if cuda else contextlib.nullcontext()):
            yield

    def _step(self, layer: nn.Module, fp8) -> Callable[[], None]:
        dtype = autocast_dtype(self.base_prec) or torch.float32
        x = torch.randn(self.tokens, layer.in_features, device=self.device, dtype=dtype,
                        requires_grad=True)
        compiled = None
        if self.spec.compile and (fp8 is None or fp8.eager_under_compile is None):
            mode = None if self.spec.compile_mode == "default" else self.spec.compile_mode
            compiled = lambda m: torch.compile(m, mode=mode, dynamic=False)   # noqa: E731
            self.graphs += 1
        return layer_step(layer, x, self.base_prec, fp8, compiled)

    def _time(self, step: Callable[[], None]) -> Timed:
        for _ in range(self.warmup):   # compilation, allocator growth, FP8 scale history
            step()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        # The first round only measures how long Python takes to queue one (_keep_busy).
        rounds = [self._round(step, cuda) for _ in range(self.repeats + 1)][1:]
        return Timed(statistics.median(r.seconds for r in rounds),
                     statistics.median(r.host_seconds for r in rounds))

    def _round(self, step, cuda: bool) -> Timed:
        if not cuda:
            t0 = time.perf_counter()
            for _ in range(self.iters):
                step()
            s = (time.perf_counter() - t0) / self.iters
            return Timed(s, s)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        self._keep_busy()
        start.record()
        t0 = time.perf_counter()
        for _ in range(self.iters):
            step()
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
        self._host = host
        return Timed(start.elapsed_time(end) / 1e3 / self.iters, host / self.iters)

    def _keep_busy(self) -> None:
        """Queue matrix products that keep the GPU busy for about 1.5x the time Python took to
        queue the last round, so that the round's steps are all queued before the GPU reaches
        them: the events then time the GPU alone."""
        if self._busy is None:
            a = torch.randn(2048, 2048, device=self.device, dtype=torch.bfloat16)
            for _ in range(3):
                a @ a
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(10):
                a @ a
            e.record()
            e.synchronize()
            self._busy = (a, max(s.elapsed_time(e) / 1e3 / 10, 1e-6))
        a, one = self._busy
        for _ in range(min(4096, math.ceil(1.5 * self._host / one))):
            a @ a
