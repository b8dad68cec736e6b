"""Ceilings: bf16 and FP8 matmul TFLOP/s, device copy and pinned host-to-device GB/s, each timed
with CUDA events after a warm-up, and set against the datasheet peak in fp8train/observe/metrics.py.
train/mfu is measured against that peak; the measured matmul ceiling says how much of it this
machine reaches at all, so an MFU of 40% reads as 40 of, say, 70 reachable, not 40 of 100."""
from __future__ import annotations

import statistics
import time

from .checks import run_check

# FP8 dense tensor-core peak = 2x the bf16 one on every FP8-capable GPU in metrics.py's table
# (Ada, Hopper, Blackwell), so the bf16 table serves for both.
FP8_PEAK_FACTOR = 2


def timing_plan(size: int, quick: bool) -> dict:
    """Matmul size, timed iterations, warm-up seconds and copy sizes (--quick: fewer, smaller)."""
    if quick:
        return {"size": size, "matmul_iters": 10, "copy_iters": 5, "warmup_s": 0.1,
                "copy_bytes": 256 << 20, "h2d_bytes": 64 << 20}
    return {"size": size, "matmul_iters": 50, "copy_iters": 20, "warmup_s": 1.0,
            "copy_bytes": 1 << 30, "h2d_bytes": 256 << 20}


def cuda_median_ms(fn, iters: int, warmup_s: float) -> float:
    """Median milliseconds of fn() over `iters` calls, each between two CUDA events, after
    about warmup_s seconds of calls: the first calls pay for cuBLAS heuristics and allocations,
    and clocks move (boost, then the power limit) during the first second of load; training
    runs at the settled rate."""
    import torch
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    for _ in range(min(10_000, int(warmup_s / one))):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def measure_matmul(device, size: int, fp8: bool, iters: int, warmup_s: float) -> dict:
    """TFLOP/s of one size^3 GEMM: bf16 torch.mm, or torch._scaled_mm on E4M3 operands with
    fast accumulation and bf16 output (the native backend's forward GEMM)."""
    import torch
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
    if fp8:
        a = a.to(torch.float8_e4m3fn)
        b = b.to(torch.float8_e4m3fn).t()   # column-major, as _scaled_mm wants it
        one = torch.ones((), device=device, dtype=torch.float32)

        def fn():
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                             use_fast_accum=True)
    else:
        c = torch.empty_like(a)

        def fn():
            torch.mm(a, b, out=c)
    ms = cuda_median_ms(fn, iters, warmup_s)
    return {"tflops": 2 * size**3 / (ms / 1e3) / 1e12, "ms": ms}


def measure_copy(device, nbytes: int, iters: int, warmup_s: float) -> dict:
    """Device-to-device copy_ of nbytes; GB/s counts the bytes read plus the bytes written."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = cuda_median_ms(lambda: dst.copy_(src), iters, warmup_s)
    return {"gbps": 2 * nbytes / (ms / 1e3) / 1e9, "ms": ms, "bytes": nbytes}


def measure_h2d(device, nbytes: int, iters: int, warmup_s: float) -> dict:
    """Pinned host memory to the device (how training batches travel); GB/s of bytes moved."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ms = cuda_median_ms(lambda: dst.copy_(src, non_blocking=True), iters, warmup_s)
    return {"gbps": nbytes / (ms / 1e3) / 1e9, "ms": ms, "bytes": nbytes}


def measure_ceilings(device, plan: dict, fp8_gate_reason: str | None) -> dict:
    """Every ceiling of `plan` on `device`; the FP8 matmul is skipped (and says why) where no
    FP8 GEMM can run. A measurement that raises is a failed entry, not the end of the rest."""
    import torch
    with torch.cuda.device(device):
        m = {"plan": plan}
        m["bf16_matmul"] = run_check(measure_matmul, device, plan["size"], False,
                                     plan["matmul_iters"], plan["warmup_s"])
        if fp8_gate_reason is None:
            m["fp8_matmul"] = run_check(measure_matmul, device, plan["size"], True,
                                        plan["matmul_iters"], plan["warmup_s"])
        else:
            m["fp8_matmul"] = {"ok": False, "skipped": fp8_gate_reason}
        m["d2d_copy"] = run_check(measure_copy, device, plan["copy_bytes"], plan["copy_iters"],
                                  plan["warmup_s"])
        m["h2d_pinned"] = run_check(measure_h2d, device, plan["h2d_bytes"], plan["copy_iters"],
                                    plan["warmup_s"])
    return m


def judge_ceilings(device_name: str, measured: dict) -> dict:
    """The measurements next to metrics.py's datasheet peak: percentages, FP8 speed-up."""
    from ..observe.metrics import peak_flops, peak_note
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in measured.items()}
    peak = peak_flops(device_name)
    out["peak_note"] = peak_note(device_name, fp8=False)
    out["peak_bf16_tflops"] = peak / 1e12 if peak else None
    out["peak_fp8_tflops"] = FP8_PEAK_FACTOR * peak / 1e12 if peak else None
    bf16, fp8 = out.get("bf16_matmul", {}), out.get("fp8_matmul", {})
    if peak and bf16.get("ok"):
        bf16["pct_of_peak"] = 100 * bf16["tflops"] / out["peak_bf16_tflops"]
    if fp8.get("ok"):
        if peak:
            fp8["pct_of_peak"] = 100 * fp8["tflops"] / out["peak_fp8_tflops"]
            # train/mfu of an FP8 run is against the bf16 peak (metrics.py): its ceiling here
            fp8["pct_of_bf16_peak"] = 100 * fp8["tflops"] / out["peak_bf16_tflops"]
        if bf16.get("ok"):
            fp8["speedup_vs_bf16"] = fp8["tflops"] / bf16["tflops"]
    return out
