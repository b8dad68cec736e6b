"""Trace CUDA code on a machine without CUDA: tensors on a fake "cuda" device whose ops run
through their meta functions (PyTorch's FakeTensorMode), so that shapes, dtypes, strides and
devices propagate, and the device-side checks that the meta functions carry (torch._scaled_mm's
layout, dtype and scale rules) run, without a GPU or a CUDA build of PyTorch.

What FakeTensorMode alone cannot do on a CPU-only build of PyTorch, and what this module
stands in for (each is mocking something that cannot exist here):

- A CUDA device guard. Autograd records a stream for every tensor it tracks, and Python methods
  such as `.contiguous()` switch devices, both through the device guard of the tensor's device.
  A CPU build has none for CUDA ("PyTorch is not linked with support for cuda devices"; inside
  autograd the process aborts). `fake_cuda` registers a no-op one (PyTorch's own Python
  device-guard class, given the CUDA slot of c10's guard registry) and removes it on exit.
- The CUDA queries of code that checks for a GPU: torch.autocast("cuda") (disabled without
  CUDA), torch.cuda.is_bf16_supported, get_device_capability (9.0, an H100) and
  get_device_name are patched while `fake_cuda` is active.
- Streams in backward. The autograd engine syncs the CUDA streams of a backward pass through
  "the accelerator", which a CPU build does not have ("Cannot access accelerator device when
  none is available"). Inside `host_autograd` (wrap `loss.backward()` in it) the engine and
  the C++ side see the fake tensors on the meta device and run backward as host work without
  streams, on the calling thread; Python code (and so the project's own code) still sees
  "cuda", the meta functions still check as CUDA, and tensors that C++ code would create on
  "meta" are put on cuda:0. Autocast does not apply to ops that run inside it (C++ no longer
  sees CUDA tensors): fine for a backward pass, which runs outside autocast, but a forward
  recomputed in backward (activation checkpointing) runs in fp32 there, so it cannot be
  traced faithfully.

`KernelRecorder` records each torch._scaled_mm and fused AdamW call that reaches the
dispatcher (from the project, torchao or anything else) and applies the checks that their CUDA
kernels make and their meta functions do not (aten/src/ATen/native/cuda/Blas.cpp,
FusedAdamWKernel.cu): matching inner dimensions, no e5m2 x e5m2, every operand on the same
CUDA device, row-wise scaling only with a 16-bit output, float32 found_inf, and parameters,
gradients and optimizer states of the same dtype, device, shape and strides.

Limits: no kernel runs, so no numbers are checked (every value is unknown), and nothing about
speed or memory; a meta function may accept what a kernel rejects (the checks above cover the
ones that matter here) or give different strides than the kernel; ops are traced through what
a CPU build dispatches to (scaled_dot_product_attention takes its math path, not flash or
cuDNN attention); Module.to cannot move fake parameters that an in-place op touched (torch
swaps them, and refuses tensors with weak references): build modules on the device;
torch.compile's inductor needs Triton and a GPU, and AOTAutograd's joint-graph trace runs the
autograd engine outside `host_autograd` (it fails with the accelerator error above)."""
from __future__ import annotations

import contextlib
import ctypes
import os
from dataclasses import dataclass
from typing import Iterator, Optional
from unittest import mock

import torch
import torch._subclasses.fake_tensor as fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

_DeviceType = torch._C._autograd.DeviceType


class _NoOpCudaGuard(torch._C._acc.DeviceGuard):
    """PyTorch's Python-defined device guard (no-op streams and devices), typed CUDA."""

    def type_(self):
        return _DeviceType.CUDA


def _guard_registry() -> ctypes.Array:
    """c10::impl::device_guard_impl_registry: one pointer per device type."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        return (ctypes.c_void_p * 64).in_dll(lib, "_ZN3c104impl26device_guard_impl_registryE")
    except (OSError, ValueError) as e:
        raise RuntimeError(f"this PyTorch build ({torch.__version__}) does not export c10's "
                           f"device-guard registry, which the fake CUDA device needs: {e}") from e


_guards = []  # the registered guards stay alive with the process (C++ holds a reference)


@contextlib.contextmanager
def _cuda_device_guard() -> Iterator[None]:
    reg = _guard_registry()
    cuda, pu1 = int(_DeviceType.CUDA), int(_DeviceType.PrivateUse1)
    if reg[cuda]:  # a CUDA build: PyTorch has (or fakes) one itself
        yield
        return
    if reg[pu1]:
        raise RuntimeError("a PrivateUse1 backend is registered: its device-guard slot is "
                           "needed to create the fake CUDA guard")
    guard = _NoOpCudaGuard()
    _guards.append(guard)
    if not torch._C._acc.register_python_privateuseone_device_guard(guard):
        raise RuntimeError("could not register the fake CUDA device guard")
    reg[cuda], reg[pu1] = reg[pu1], None  # move it to the CUDA slot
    try:
        yield
    finally:
        reg[cuda] = None


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """A FakeTensorMode in which tensors can live on "cuda" (see the module docstring for what is
    mocked). Only fake tensors are accepted as inputs: build everything inside."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_cuda_device_guard())
        for name, value in [("torch.cuda.amp.common.amp_definitely_not_available", False),
                            ("torch.cuda.is_bf16_supported", True),
                            ("torch.cuda.get_device_capability", (9, 0)),
                            ("torch.cuda.get_device_name", "fake CUDA device (FakeTensorMode)")]:
            stack.enter_context(mock.patch(name, lambda *a, _v=value, **k: _v))
        yield stack.enter_context(FakeTensorMode(allow_non_fake_inputs=False))


def _meta_device(args) -> torch.device:
    return torch.device("meta")


@contextlib.contextmanager
def host_autograd() -> Iterator[None]:
    """Run a backward pass (`loss.backward()` inside) on fake CUDA tensors: see the module
    docstring."""
    dispatch = FakeTensor.__dict__["__torch_dispatch__"].__func__
    normalize = FakeTensor.__dict__["_normalize_fake_device"].__func__

    # C++ asks a FakeTensor for its device through prim.device (the FakeTensor class answers
    # outside the mode, _DISPATCH_META_HANDLERS inside it); Python reads FakeTensor.device,
    # which stays "cuda".
    def torch_dispatch(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.prim.device.default:
            return torch.device("meta")
        return dispatch(cls, func, types, args, kwargs or {})

    def normalize_device(device: torch.device) -> torch.device:
        return normalize(torch.device("cuda") if device.type == "meta" else device)

    prim_device = torch.ops.prim.device.default
    # Without multithreading the engine runs every node on this thread's (CPU) queue: its
    # per-device queues are sized once per process, by the device guards present at the first
    # backward, which may have been one without the fake CUDA guard.
    with mock.patch.dict(fake_tensor._DISPATCH_META_HANDLERS, {prim_device: _meta_device}), \
            mock.patch.object(FakeTensor, "__torch_dispatch__", classmethod(torch_dispatch)), \
            mock.patch.object(FakeTensor, "_normalize_fake_device",
                              staticmethod(normalize_device)), \
            torch.autograd.set_multithreading_enabled(False):
        yield


def backward(loss: torch.Tensor) -> None:
    with host_autograd():
        loss.backward()


# --- the layout terms of torch._scaled_mm's checks (torch/_meta_registrations.py) -------------

def is_row_major(t: torch.Tensor) -> bool:
    s = t.stride()
    return s[0] > s[1] and s[1] == 1


def is_col_major(t: torch.Tensor) -> bool:
    s = t.stride()
    return s[0] == 1 and s[1] > 1


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: some permutation of t is contiguous."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


class KernelRuleError(RuntimeError):
    """A call the meta function accepts and the CUDA kernel would reject."""


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise KernelRuleError(msg)


def _on(t: Optional[torch.Tensor], device: torch.device) -> bool:
    return t is None or t.device == device


def check_scaled_mm_kernel_rules(a, b, scale_a, scale_b, bias=None, scale_result=None,
                                 out_dtype=None) -> None:
    """_scaled_mm_out_cuda's checks that meta_scaled_mm lacks (Blas.cpp, CUDA, not ROCm)."""
    dev = a.device
    _require(dev.type == "cuda", f"mat1 is on {dev}, not a CUDA device")
    for name, t in [("mat2", b), ("scale_a", scale_a), ("scale_b", scale_b), ("bias", bias),
                    ("scale_result", scale_result)]:
        _require(_on(t, dev), f"{name} is on {t.device if t is not None else None}, mat1 on "
                              f"{dev}: every _scaled_mm operand must be on the same GPU")
    _require(a.shape[1] == b.shape[0], f"mat1 and mat2 shapes cannot be multiplied "
                                       f"({a.shape[0]}x{a.shape[1]} and {b.shape[0]}x{b.shape[1]})")
    _require(not (a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2),
             "Multiplication of two Float8_e5m2 matrices is not supported")
    out = out_dtype or a.dtype
    if bias is not None:
        _require(out != torch.float32, "Bias is not supported when out_dtype is set to Float32")
        _require(bias.dtype in (torch.bfloat16, torch.float16),
                 f"Bias must be BFloat16 or Half, but got {bias.dtype}")
        _require(bias.numel() == b.shape[1], f"Bias must be size {b.shape[1]}")
    _require(scale_result is None or (scale_result.numel() == 1
                                      and scale_result.dtype == torch.float32),
             "scale_result must be a float scalar")
    rowwise = scale_a.dim() == 2 and scale_a.numel() == a.shape[0] and scale_a.numel() > 1
    if rowwise:
        # Without cuBLAS 12.9 on an sm90+ GPU, row-wise scaling goes to CUTLASS (16-bit output).
        _require(out in (torch.bfloat16, torch.float16),
                 "Only bf16 and fp16 high precision output types are supported for row-wise "
                 f"scaling, got {out}")
        _require(scale_a.stride(1) == 1 or scale_a.size(1) == 1,
                 f"expected scale_a.stride(1) to be 1, but got {scale_a.stride(1)}")
        _require(scale_b.stride(1) == 1,
                 f"expected scale_b.stride(1) to be 1, but got {scale_b.stride(1)}")


def check_fused_adamw_kernel_rules(params, grads, exp_avgs, exp_avg_sqs, state_steps,
                                   grad_scale=None, found_inf=None) -> None:
    """_fused_adamw_kernel_cuda_'s checks that its meta function lacks: the tensor lists share
    dtype, device, strided dense layout and, element by element, shape and strides
    (check_fast_path_restrictions); found_inf and grad_scale are read as float on the device."""
    dev = params[0].device
    _require(dev.type == "cuda", f"parameters on {dev}, not a CUDA device")
    # Mixed precision (states in another dtype than the parameters): each list has one dtype.
    mixed = exp_avgs[0].dtype != params[0].dtype
    lists = [("params", params), ("grads", grads), ("exp_avgs", exp_avgs),
             ("exp_avg_sqs", exp_avg_sqs)]
    for name, lst in lists:
        _require(len(lst) == len(params), f"{name}: {len(lst)} tensors for {len(params)} params")
        for i, t in enumerate(lst):
            ref = params[i]
            dtype = lst[0].dtype if mixed else ref.dtype
            _require(t.device == dev and t.dtype == dtype,
                     f"{name}[{i}] is {t.dtype} on {t.device}, expected {dtype} on {dev}")
            _require(t.shape == ref.shape and t.stride() == ref.stride(),
                     f"{name}[{i}] has shape {tuple(t.shape)} strides {t.stride()}, params[{i}] "
                     f"{tuple(ref.shape)} strides {ref.stride()}")
            _require(t.layout == torch.strided and is_dense(t),
                     f"{name}[{i}] is not dense")
    for i, s in enumerate(state_steps):
        _require(s.device == dev and s.dtype == torch.float32 and s.numel() == 1,
                 f"state_steps[{i}] is {s.dtype} {tuple(s.shape)} on {s.device}")
    for name, t in [("grad_scale", grad_scale), ("found_inf", found_inf)]:
        if t is not None:
            _require(t.dtype == torch.float32 and t.numel() == 1 and t.device == dev,
                     f"{name} must be one float32 on {dev} (the kernel reads data_ptr<float>()), "
                     f"got {t.dtype} {tuple(t.shape)} on {t.device}")


@dataclass
class Operand:
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> "Operand":
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

    @property
    def row_major(self) -> bool:
        return self.stride[0] > self.stride[1] and self.stride[1] == 1

    @property
    def col_major(self) -> bool:
        return self.stride[0] == 1 and self.stride[1] > 1


@dataclass
class ScaledMM:
    a: Operand
    b: Operand
    scale_a: Operand
    scale_b: Operand
    out: Operand
    fast_accum: bool
    bias: bool

    @property
    def rowwise(self) -> bool:
        return len(self.scale_a.shape) == 2 and self.scale_a.shape == (self.a.shape[0], 1)


@dataclass
class FusedAdamW:
    params: list
    grads: list
    state_steps: list
    found_inf: Optional[torch.Tensor]
    grad_scale: Optional[torch.Tensor]


class KernelRecorder(TorchDispatchMode):
    """Records (and checks, see check_*_kernel_rules) every aten._scaled_mm and
    aten._fused_adamw_ call; enter it inside `fake_cuda`. Ops on tensor subclasses (torchao's
    Float8TrainingTensor) are left to the subclass, whose own calls then come here."""

    def __init__(self):
        super().__init__()
        self.scaled_mm: list = []
        self.adamw: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(not issubclass(t, FakeTensor) and t is not torch.Tensor for t in types):
            return NotImplemented
        if func is torch.ops.aten._scaled_mm.default:
            return self._scaled_mm(func, *args, **kwargs)
        if func.overloadpacket is torch.ops.aten._fused_adamw_:
            params, grads, exp_avgs, exp_avg_sqs, _max_sqs, steps = args[:6]
            check_fused_adamw_kernel_rules(params, grads, exp_avgs, exp_avg_sqs, steps,
                                           kwargs.get("grad_scale"), kwargs.get("found_inf"))
            self.adamw.append(FusedAdamW(list(params), list(grads), list(steps),
                                         kwargs.get("found_inf"), kwargs.get("grad_scale")))
        return func(*args, **kwargs)

    def _scaled_mm(self, func, a, b, scale_a, scale_b, bias=None, scale_result=None,
                   out_dtype=None, use_fast_accum=False):
        check_scaled_mm_kernel_rules(a, b, scale_a, scale_b, bias, scale_result, out_dtype)
        out = func(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)
        self.scaled_mm.append(ScaledMM(Operand.of(a), Operand.of(b), Operand.of(scale_a),
                                       Operand.of(scale_b), Operand.of(out), use_fast_accum,
                                       bias is not None))
        return out
