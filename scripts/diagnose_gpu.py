#!/usr/bin/env python3
"""Check your GPU before you queue a job on it: what this machine can run, and how fast.

    python scripts/diagnose_gpu.py                  # checks and measured ceilings
    python scripts/diagnose_gpu.py --json gpu.json  # the same, also written as JSON
    python scripts/diagnose_gpu.py --quick          # shorter warm-up and timings, noisier numbers
    python scripts/diagnose_gpu.py --size 4096      # matmul size of the TFLOP/s ceilings

Why a script: an FP8 run that fell back to bf16, an attention kernel that is not there and a
GPU that delivers 60% of its datasheet all look alike from inside a training run: slow. Each
question is answered here once, with a real kernel on the device, because importing is not
enough (a Transformer Engine built for another CUDA imports fine and fails at its first GEMM):

- versions: GPU, driver, CUDA runtime, torch, cuDNN, NCCL;
- FP8, per backend (te, torchao, native): does it import, and does an FP8 GEMM on this GPU
  (forward and backward, the way training calls it) agree with the bf16 reference;
- attention: do SDPA's flash, memory-efficient and cuDNN kernels run here in bf16;
- ceilings: bf16 and FP8 matmul TFLOP/s, device copy and pinned host-to-device GB/s. train/mfu
  is measured against the datasheet peak in fp8train/metrics.py; the measured matmul ceiling
  says how much of that peak this machine reaches at all, so an MFU of 40% reads as 40 of, say,
  70 reachable, not 40 of 100.

It ends with one verdict per feature (OK / MISSING / FAILED, and why) and exits 0 whatever it
finds: a missing feature is a finding, not an error of the script. Without CUDA it says why and
reports what it can (versions, which FP8 backends import) in a few seconds.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BACKENDS = ("te", "torchao", "native")
ATTENTION = (("flash", "FLASH_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"),
             ("cudnn", "CUDNN_ATTENTION"))
INSTALL = {"te": "pip install --no-build-isolation 'transformer_engine[pytorch]'",
           "torchao": "pip install torchao"}

# FP8 checks: 256 x 256 x 256 GEMMs on standard-normal operands, judged by the relative
# Frobenius error against the same computation in bf16. E4M3 keeps 3 mantissa bits and E5M2
# (gradients, hybrid format) 2, so quantization alone costs about 4% in the forward GEMM and 6%
# in the gradient GEMMs (measured with the CPU emulation); a wrong layout, scale or dtype is off
# by 100% or more. The tolerances sit between the two.
CHECK_DIM = 256
FWD_TOL, GRAD_TOL = 0.10, 0.15
ATTN_TOL = 0.02   # bf16 flash/efficient/cuDNN against fp32 math attention (bf16 rounding: ~0.4%)

# FP8 dense tensor-core peak = 2x the bf16 one on every FP8-capable GPU in metrics.py's table
# (Ada, Hopper, Blackwell), so the bf16 table serves for both.
FP8_PEAK_FACTOR = 2


def one_line(e: BaseException, limit: int = 240) -> str:
    text = f"{type(e).__name__}: {' '.join(str(e).split())}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


class CheckFailed(Exception):
    """A check ran and gave the wrong answer (as opposed to raising inside a library)."""


def run_check(fn, *args) -> dict:
    """fn(*args) -> dict of details; {"ok": True, ...details} or {"ok": False, "error": ...}.
    Every exception is caught: one failing check must not hide the others."""
    try:
        result = {"ok": True, **fn(*args)}
    except Exception as e:
        result = {"ok": False, "error": one_line(e)}
    finally:
        _free_cuda_memory()
    return result


def _free_cuda_memory() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------- versions

def collect_versions() -> dict:
    import torch
    import torch.distributed as dist
    v = {"python": platform.python_version(), "torch": torch.__version__,
         "cuda_runtime": torch.version.cuda, "cudnn": None, "nccl": None,
         "nccl_available": bool(dist.is_available() and dist.is_nccl_available())}
    try:
        code = torch.backends.cudnn.version()
        v["cudnn"] = _cudnn_version(code) if code else None
    except Exception as e:   # a cuDNN that cannot be loaded is worth saying
        v["cudnn_error"] = one_line(e)
    try:
        nccl = torch.cuda.nccl.version()
        v["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:        # CPU builds have no NCCL: nccl stays None
        pass
    v["driver"], v["driver_source"] = driver_version()
    return v


def _cudnn_version(code: int) -> str:
    # cuDNN 9 encodes major*10000 + minor*100 + patch, cuDNN 8 and older major*1000 + ...
    major, rest = (code // 10000, code % 10000) if code >= 90000 else (code // 1000, code % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def driver_version() -> tuple:
    """(version, where it came from). nvidia-smi gives the driver's own version (550.54.15);
    without it torch only knows the CUDA version the driver supports (12.4)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            if r.returncode == 0 and r.stdout.split():
                return r.stdout.split()[0], "nvidia-smi"
        except (OSError, subprocess.SubprocessError):
            pass
    import torch
    get = getattr(torch._C, "_cuda_getDriverVersion", None)   # CUDA builds only
    if get is not None:
        try:
            code = get()
            if code:
                return (f"supports CUDA {code // 1000}.{code % 1000 // 10}",
                        "torch (no nvidia-smi)")
        except Exception:
            pass
    return None, None


# ------------------------------------------------------------------------------------ device

def device_info() -> dict:
    """The CUDA device this process would train on, or why there is none."""
    import torch
    if not torch.cuda.is_available():
        try:   # is_available() is silent; init() raises with the actual reason
            torch.cuda.init()
            why = "torch.cuda.is_available() is False"
        except Exception as e:
            why = " ".join(str(e).split())[:200]
        if torch.version.cuda is None:
            reason = f"torch {torch.__version__} is a CPU-only build ({why})"
        else:
            reason = (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but "
                      f"sees no GPU ({why}; CUDA_VISIBLE_DEVICES="
                      f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        return {"cuda": False, "reason": reason}
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {"cuda": True, "reason": None, "index": index, "count": torch.cuda.device_count(),
            "name": props.name, "capability": [props.major, props.minor],
            "memory_gib": props.total_memory / 2**30, "sm_count": props.multi_processor_count}


# --------------------------------------------------------------------------------------- FP8

def fp8_imports() -> dict:
    """Per backend: does it import here (no device needed)."""
    return {"te": _import_check(_import_te), "torchao": _import_check(_import_torchao),
            "native": _import_check(_import_native)}


def _import_check(fn) -> dict:
    try:
        return {"imports": True, "version": fn(), "error": None}
    except Exception as e:
        return {"imports": False, "version": None, "error": _import_error(e)}


def _import_error(e: Exception) -> str:
    top = (getattr(e, "name", None) or "").split(".")[0]
    for label, module in (("te", "transformer_engine"), ("torchao", "torchao")):
        if isinstance(e, ModuleNotFoundError) and top == module:
            return f"{module} is not installed ({INSTALL[label]})"
    return f"import failed ({one_line(e)})"   # e.g. a build for another torch or CUDA


def _import_te() -> str:
    importlib.import_module("transformer_engine.pytorch")
    return f"transformer_engine {sys.modules['transformer_engine'].__version__}"


def _import_torchao() -> str:
    from fp8train.precision.ao import import_float8   # quiets torchao's optional-kernel logs
    import_float8()
    return f"torchao {sys.modules['torchao'].__version__}"


def _import_native() -> str:
    import torch
    if not hasattr(torch, "_scaled_mm"):
        raise ImportError(f"torch {torch.__version__} has no torch._scaled_mm")
    return f"torch {torch.__version__}, torch._scaled_mm"


def fp8_gate(device_report: dict) -> str | None:
    """Why no FP8 GEMM can run on this device, or None when one can."""
    if not device_report["cuda"]:
        return f"no CUDA device: {device_report['reason']}"
    import torch
    from fp8train.precision.base import cuda_fp8_gate   # the trainer's own rule (cc >= 8.9)
    return cuda_fp8_gate(torch.device("cuda", device_report["index"]))


def fp8_section(device_report: dict) -> dict:
    """Imports everywhere; the real FP8 GEMM checks only where FP8 can run."""
    backends = fp8_imports()
    gate = fp8_gate(device_report)
    checks = {"te": check_te, "torchao": check_torchao, "native": check_native}
    for name, entry in backends.items():
        entry["gemm"] = None
        if entry["imports"] and gate is None:
            import torch
            entry["gemm"] = run_check(checks[name], torch.device("cuda", device_report["index"]))
    return {"gate": gate, "backends": backends}


def _operands(device):
    """x [M, K], w [N, K] (a Linear's weight) and grad_output [M, N], bf16, fixed seed."""
    import torch
    gen = torch.Generator().manual_seed(0)
    n = CHECK_DIM
    return [torch.randn(n, n, generator=gen).to(device=device, dtype=torch.bfloat16)
            for _ in range(3)]


def rel_err(got, ref) -> float:
    got, ref = got.detach().float(), ref.detach().float()
    return float((got - ref).norm() / ref.norm())


def _judge(result: dict) -> dict:
    bad = [f"{key} relative error {result[key]:.3g} > {tol}" for key, tol in
           (("fwd_err", FWD_TOL), ("grad_err", GRAD_TOL)) if key in result
           and not result[key] <= tol]   # "not <=" so that NaN fails too
    if bad:
        raise CheckFailed(f"{result['what']}: " + "; ".join(bad) + " against bf16")
    return result


def check_native(device) -> dict:
    """The native backend's two kinds of GEMM through its own fp8_mm: forward (E4M3 x E4M3, fast
    accumulation) and grad_input (E5M2 x E4M3, full accumulation), with per-tensor scales.
    torch._scaled_mm also exists on CPU, so the CPU test runs this for real."""
    import torch
    from fp8train.precision.native import fp8_mm
    from fp8train.precision.scaling import E4M3, E5M2, FP8_MAX, quantize
    x, w, g = _operands(device)

    def scale(t, dtype):
        return (FP8_MAX[dtype] / t.float().abs().amax()).float()

    s_x, s_w, s_g = scale(x, E4M3), scale(w, E4M3), scale(g, E5M2)
    xq, wq, gq = quantize(x, s_x, E4M3), quantize(w, s_w, E4M3), quantize(g, s_g, E5M2)
    # _scaled_mm wants its second operand column-major, as native.py arranges it.
    y = fp8_mm(xq, s_x, wq.t(), s_w, torch.bfloat16, emulate=False, fast_accum=True)
    gx = fp8_mm(gq, s_g, wq.t().contiguous().t(), s_w, torch.bfloat16, emulate=False,
                fast_accum=False)
    return _judge({"what": "torch._scaled_mm forward + grad_input GEMMs",
                   "fwd_err": rel_err(y, x @ w.t()), "grad_err": rel_err(gx, g @ w)})


def check_torchao(device) -> dict:
    """A Linear converted by torchao's convert_to_float8_training (the config's default recipe),
    forward and backward. On CPU torchao emulates the FP8 GEMMs (the CPU test runs that)."""
    import dataclasses

    import torch
    from torch import nn

    from fp8train.config import Config
    from fp8train.precision.ao import import_float8
    float8, _ = import_float8()
    recipe = Config().fp8_recipe
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    emulated = device.type != "cuda"
    if emulated:
        config = dataclasses.replace(config, emulate=True)
    x, w, g = _operands(device)
    model = nn.Sequential(nn.Linear(CHECK_DIM, CHECK_DIM, bias=False)).to(device, torch.bfloat16)
    with torch.no_grad():
        model[0].weight.copy_(w)
    float8.convert_to_float8_training(model, config=config)
    if type(model[0]) is nn.Linear:
        raise CheckFailed("convert_to_float8_training left the Linear unconverted")
    xr = x.clone().requires_grad_()
    y = model(xr)
    y.backward(g)
    grad_err = max(rel_err(xr.grad, g @ w), rel_err(model[0].weight.grad, g.t() @ x))
    return _judge({"what": f"{type(model[0]).__name__} ({recipe}"
                           f"{', emulated' if emulated else ''}) forward + backward",
                   "fwd_err": rel_err(y, x @ w.t()), "grad_err": grad_err})


def check_te(device) -> dict:
    """te.Linear forward and backward under TE's autocast with the DelayedScaling recipe a
    default training config builds (fp8train.precision.te.build_recipe). Three steps, the last
    one judged: the first runs at TE's initial scale of 1, the later ones with scales from the
    amax history, which is the delayed-scaling machinery training depends on."""
    import torch

    from fp8train.config import Config
    from fp8train.precision.te import build_recipe, recipe_kwargs
    te = importlib.import_module("transformer_engine.pytorch")
    cfg = Config()
    recipe = build_recipe(cfg)
    x, w, g = _operands(device)
    lin = te.Linear(CHECK_DIM, CHECK_DIM, bias=False, params_dtype=torch.bfloat16,
                    device=device)
    with torch.no_grad():
        lin.weight.copy_(w)
    autocast = getattr(te, "autocast", None)   # newer TE; fp8_autocast is the older name
    for _ in range(3):
        ctx = (autocast(enabled=True, recipe=recipe) if autocast is not None
               else te.fp8_autocast(enabled=True, fp8_recipe=recipe))
        xr = x.clone().requires_grad_()
        lin.weight.grad = None
        with ctx:
            y = lin(xr)
        y.backward(g)
    grad_err = max(rel_err(xr.grad, g @ w), rel_err(lin.weight.grad, g.t() @ x))
    kw = recipe_kwargs(cfg)
    return _judge({"what": f"te.Linear forward + backward, DelayedScaling({kw['fp8_format']}, "
                           f"history {kw['amax_history_len']})",
                   "fwd_err": rel_err(y, x @ w.t()), "grad_err": grad_err})


# --------------------------------------------------------------------------------- attention

def check_attention(device) -> dict:
    """Each SDPA kernel, forced with sdpa_kernel, in bf16, forward and backward."""
    import torch
    from torch.nn.attention import SDPBackend
    out = {}
    for key, member in ATTENTION:
        backend = getattr(SDPBackend, member, None)
        if backend is None:
            out[key] = {"ok": False, "missing": True,
                        "error": f"torch {torch.__version__} has no SDPBackend.{member}"}
        else:
            out[key] = run_check(_sdpa_once, device, backend)
    return out


def _sdpa_once(device, backend) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8, 512, 64, generator=gen).to(device, torch.bfloat16)
               .requires_grad_() for _ in range(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                o.backward(torch.ones_like(o))   # training needs the backward kernel too
        except RuntimeError as e:
            # torch gives the reasons a kernel was refused as warnings, then a bare
            # "No available kernel"
            why = [" ".join(str(w.message).split()) for w in caught]
            raise RuntimeError("; ".join(why[:3]) or str(e)) from None
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    err = rel_err(o, ref)
    if not err <= ATTN_TOL:
        raise CheckFailed(f"output relative error {err:.3g} > {ATTN_TOL} against fp32 math")
    return {"rel_err": err}


# --------------------------------------------------------------------------------- ceilings

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


def timing_plan(size: int, quick: bool) -> dict:
    if quick:
        return {"size": size, "matmul_iters": 10, "copy_iters": 5, "warmup_s": 0.1,
                "copy_bytes": 256 << 20, "h2d_bytes": 64 << 20}
    return {"size": size, "matmul_iters": 50, "copy_iters": 20, "warmup_s": 1.0,
            "copy_bytes": 1 << 30, "h2d_bytes": 256 << 20}


def measure_ceilings(device, plan: dict, fp8_gate_reason: str | None) -> dict:
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
    from fp8train.metrics import peak_flops, peak_note
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


# ---------------------------------------------------------------------------------- verdicts

def verdicts(report: dict) -> list:
    """One row per feature: OK (works here), MISSING (not installed, no device, hardware too
    old) or FAILED (present, but its check raised or gave wrong numbers), and why."""
    rows = []

    def add(feature, status, reason):
        rows.append({"feature": feature, "status": status, "reason": reason})

    dev, versions, fp8 = report["device"], report["versions"], report["fp8"]
    no_cuda = None if dev["cuda"] else "no CUDA device"   # the first row says why
    if dev["cuda"]:
        add("CUDA device", "OK", f"{dev['name']}, compute capability "
            f"{dev['capability'][0]}.{dev['capability'][1]}, {dev['memory_gib']:.1f} GiB")
        add("FP8 hardware", "MISSING" if fp8["gate"] else "OK",
            fp8["gate"] or "compute capability >= 8.9")
    else:
        add("CUDA device", "MISSING", dev["reason"])
        add("FP8 hardware", "MISSING", no_cuda)
    for name in BACKENDS:
        b = fp8["backends"][name]
        if not b["imports"]:
            add(f"FP8 {name}", "MISSING", b["error"])
        elif b["gemm"] is None:
            add(f"FP8 {name}", "MISSING", f"imports ({b['version']}), but no FP8 GEMM can run: "
                f"{no_cuda or fp8['gate']}")
        elif b["gemm"]["ok"]:
            g = b["gemm"]
            add(f"FP8 {name}", "OK", f"{g['what']}: relative error forward {g['fwd_err']:.3f}, "
                f"gradients {g['grad_err']:.3f} (tolerance {FWD_TOL}, {GRAD_TOL})")
        else:
            add(f"FP8 {name}", "FAILED", b["gemm"]["error"])
    attention = report.get("attention") or {}
    for key, _ in ATTENTION:
        a = attention.get(key)
        label = f"SDPA {key} attention"
        if a is None:
            add(label, "MISSING", no_cuda or "not checked")
        elif a["ok"]:
            add(label, "OK", "bf16 forward + backward ran and matches fp32 math "
                f"(relative error {a['rel_err']:.3g})")
        else:
            add(label, "MISSING" if a.get("missing") else "FAILED", a["error"])
    if versions["nccl_available"]:
        add("NCCL", "OK", f"NCCL {versions['nccl'] or '(version unknown)'} in torch.distributed")
    else:
        add("NCCL", "MISSING", f"torch {versions['torch']} has no NCCL backend (multi-GPU runs "
            "need it)")
    ceilings = report.get("ceilings") or {}
    for key, label, unit, peak in (("bf16_matmul", "bf16 matmul ceiling", "TFLOP/s", "bf16"),
                                   ("fp8_matmul", "FP8 matmul ceiling", "TFLOP/s", "FP8"),
                                   ("d2d_copy", "device copy bandwidth", "GB/s", None),
                                   ("h2d_pinned", "host-to-device bandwidth", "GB/s", None)):
        c = ceilings.get(key)
        if c is None:
            add(label, "MISSING", no_cuda or "not measured")
        elif c.get("ok"):
            value = c["tflops"] if unit == "TFLOP/s" else c["gbps"]
            pct = f", {c['pct_of_peak']:.0f}% of the {peak} peak" if "pct_of_peak" in c else ""
            add(label, "OK", f"{value:,.1f} {unit}{pct}")
        elif "skipped" in c:
            add(label, "MISSING", c["skipped"])
        else:
            add(label, "FAILED", c["error"])
    return rows


# -------------------------------------------------------------------------------- formatting

def _row(label: str, text: str) -> str:
    return f"  {label:<17}{text}"


def format_environment(report: dict) -> str:
    dev, v = report["device"], report["versions"]
    lines = ["Environment"]
    if dev["cuda"]:
        cap = f"{dev['capability'][0]}.{dev['capability'][1]}"
        lines.append(_row("GPU", f"{dev['name']} (device {dev['index']} of {dev['count']}), "
                          f"compute capability {cap}, {dev['memory_gib']:.1f} GiB, "
                          f"{dev['sm_count']} SMs"))
    else:
        lines.append(_row("GPU", f"no CUDA device: {dev['reason']}"))
    lines.append(_row("driver", f"{v['driver']} ({v['driver_source']})" if v["driver"]
                      else "not found (no nvidia-smi, no CUDA driver visible to torch)"))
    lines.append(_row("CUDA runtime", f"{v['cuda_runtime']} (torch build)" if v["cuda_runtime"]
                      else "none (CPU-only torch build)"))
    lines.append(_row("torch", v["torch"]))
    lines.append(_row("cuDNN", v["cudnn"] or v.get("cudnn_error") or "none"))
    nccl = v["nccl"] or "none"
    lines.append(_row("NCCL", f"{nccl}; torch.distributed NCCL backend "
                      f"{'available' if v['nccl_available'] else 'not available'}"))
    lines.append(_row("Python", v["python"]))
    return "\n".join(lines)


def format_fp8(report: dict) -> str:
    fp8 = report["fp8"]
    gate = fp8["gate"]
    if gate is None:
        cap = report["device"]["capability"]
        head = f"FP8 (needs compute capability >= 8.9; this GPU has {cap[0]}.{cap[1]})"
    elif not report["device"]["cuda"]:
        head = "FP8 (needs a CUDA GPU of compute capability >= 8.9; no CUDA device: imports only)"
    else:
        head = f"FP8 ({gate}; imports only)"
    lines = [head]
    for name in BACKENDS:
        b = fp8["backends"][name]
        if not b["imports"]:
            text = f"does not import: {b['error']}"
        elif b["gemm"] is None:
            text = f"imports ({b['version']}); no FP8 GEMM run"
        elif b["gemm"]["ok"]:
            g = b["gemm"]
            text = (f"imports ({b['version']}); {g['what']}: relative error forward "
                    f"{g['fwd_err']:.3f}, gradients {g['grad_err']:.3f} (tolerance {FWD_TOL}, "
                    f"{GRAD_TOL}): OK")
        else:
            text = f"imports ({b['version']}); FP8 GEMM FAILED: {b['gemm']['error']}"
        lines.append(_row(name, text))
    return "\n".join(lines)


def format_attention(report: dict) -> str:
    lines = ["Attention (F.scaled_dot_product_attention, bf16, forward + backward)"]
    for key, member in ATTENTION:
        a = report["attention"][key]
        text = (f"runs (relative error {a['rel_err']:.3g} against fp32 math)" if a["ok"]
                else f"{'missing' if a.get('missing') else 'FAILED'}: {a['error']}")
        lines.append(_row(key, text))
    return "\n".join(lines)


def format_ceilings(report: dict) -> str:
    c = report["ceilings"]
    plan = c["plan"]
    size = plan["size"]
    lines = [f"Ceilings (matmuls {size}^3, median of {plan['matmul_iters']}; copies median of "
             f"{plan['copy_iters']}; each after ~{plan['warmup_s']:g} s of warm-up)",
             f"  peak: {c['peak_note']} (fp8train/metrics.py)"]

    def failed(entry):
        return entry.get("skipped") or f"FAILED: {entry['error']}"

    bf16 = c["bf16_matmul"]
    if bf16["ok"]:
        text = f"{bf16['tflops']:8.1f} TFLOP/s"
        if "pct_of_peak" in bf16:
            text += (f"  {bf16['pct_of_peak']:.0f}% of the {c['peak_bf16_tflops']:g} TFLOP/s "
                     "bf16 dense peak")
    else:
        text = failed(bf16)
    lines.append(_row("bf16 matmul", text))
    fp8 = c["fp8_matmul"]
    if fp8["ok"]:
        text = f"{fp8['tflops']:8.1f} TFLOP/s"
        if "pct_of_peak" in fp8:
            text += (f"  {fp8['pct_of_peak']:.0f}% of the {c['peak_fp8_tflops']:g} TFLOP/s FP8 "
                     f"dense peak ({FP8_PEAK_FACTOR}x bf16)")
        if "speedup_vs_bf16" in fp8:
            text += f"; {fp8['speedup_vs_bf16']:.2f}x the bf16 matmul"
        if "pct_of_bf16_peak" in fp8:
            text += (f"; {fp8['pct_of_bf16_peak']:.0f}% of the bf16 peak, which is what "
                     "train/mfu of an FP8 run is measured against")
    else:
        text = failed(fp8)
    lines.append(_row("FP8 matmul", text))
    for key, label in (("d2d_copy", "device copy"), ("h2d_pinned", "host->device")):
        e = c[key]
        if e["ok"]:
            text = (f"{e['gbps']:8.1f} GB/s  ({_size(e['bytes'])}"
                    f"{', read + write' if key == 'd2d_copy' else ', pinned'})")
        else:
            text = failed(e)
        lines.append(_row(label, text))
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:g} MiB"


def format_verdicts(rows: list) -> str:
    lines = ["Verdict"]
    for r in rows:
        lines.append(f"  {r['feature']:<26}{r['status']:<9}{r['reason']}")
    return "\n".join(lines)


def format_report(report: dict) -> str:
    """Everything main prints, from a report dict (the tests feed it made-up GPU numbers)."""
    parts = [format_environment(report), format_fp8(report)]
    if report.get("attention"):
        parts.append(format_attention(report))
    if report.get("ceilings"):
        parts.append(format_ceilings(report))
    parts.append(format_verdicts(report["verdicts"]))
    return "\n\n".join(parts)


# -------------------------------------------------------------------------------------- main

def _positive_multiple_of_16(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n <= 0 or n % 16:
        raise argparse.ArgumentTypeError(f"{text!r}: needs a positive multiple of 16 "
                                         "(an FP8 GEMM requirement)")
    return n


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Check this machine's GPU for fp8train: versions, FP8 backends (a real FP8 "
        "GEMM each), SDPA attention kernels, and measured matmul / bandwidth ceilings against "
        "the datasheet peak. Always exits 0: missing features are reported, not errors.")
    p.add_argument("--json", metavar="PATH", help="also write everything as JSON to PATH")
    p.add_argument("--size", type=_positive_multiple_of_16, default=8192, metavar="N",
                   help="matmul size N (N x N x N) for the TFLOP/s ceilings (default 8192)")
    p.add_argument("--quick", action="store_true",
                   help="0.1 s warm-up, fewer timed iterations and smaller copies (noisier "
                   "ceilings, a few seconds faster)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    print("fp8train GPU check (scripts/diagnose_gpu.py)\n", flush=True)
    report = {"args": {"size": args.size, "quick": args.quick},
              "versions": collect_versions(), "device": device_info()}
    print(format_environment(report) + "\n", flush=True)
    report["fp8"] = fp8_section(report["device"])
    print(format_fp8(report) + "\n", flush=True)
    dev = report["device"]
    if dev["cuda"]:
        import torch
        device = torch.device("cuda", dev["index"])
        report["attention"] = check_attention(device)
        print(format_attention(report) + "\n", flush=True)
        measured = measure_ceilings(device, timing_plan(args.size, args.quick),
                                    report["fp8"]["gate"])
        report["ceilings"] = judge_ceilings(dev["name"], measured)
        print(format_ceilings(report) + "\n", flush=True)
    report["verdicts"] = verdicts(report)
    print(format_verdicts(report["verdicts"]), flush=True)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(_json_safe(report), fh, indent=2)
                fh.write("\n")
        except OSError as e:
            print(f"error: cannot write {args.json}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"\nwrote {args.json}")
    return 0


def _json_safe(obj):
    # NaN / inf (a check whose error was not finite) are not JSON: written as strings.
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


if __name__ == "__main__":
    sys.exit(main())
