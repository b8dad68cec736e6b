"""The output layer's loss measured (scripts/bench_loss.py): the plain loss against
loss.chunked_lm_loss, each variant in a fresh process, its time and peak resident memory. How
it measures: the script's docstring. CPU tensors and Linux only."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("plain", "chunked")


def memory_mb() -> tuple[float, float]:
    """(resident now, peak resident since the last reset_peak()) in MB, from /proc (Linux)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))


def reset_peak() -> None:
    """Give freed heap pages back to the system, then restart the peak (VmHWM) at the
    resident size now: the peak after it is that of what runs after it."""
    import ctypes
    import gc
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(args) -> dict:
    """One variant, in this process: {ms, peak_extra_mb, first_ms, loss, ...}."""
    variant, compiled = args._child.split(":")
    import torch
    import torch.nn.functional as F

    from ..loss import chunked_lm_loss, default_chunk_tokens, lm_loss
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    chunk = args.chunk_tokens or default_chunk_tokens(args.vocab)

    def loss(h, w, t):
        if variant == "plain":
            return lm_loss(F.linear(h, w), t, args.penalty, 1e-4)[0]
        return chunked_lm_loss(h, w, t, args.penalty, 1e-4, chunk_tokens=args.chunk_tokens)[0]

    fn = torch.compile(loss, backend="inductor") if compiled == "1" else loss
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, args.tokens, args.hidden, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(dtype).requires_grad_(True)
    t = torch.randint(0, args.vocab, (1, args.tokens), generator=g)

    def step():
        h.grad = w.grad = None          # zero_grad(set_to_none=True), as training does
        out = fn(h, w, t)
        out.backward()
        return out.item()

    start = time.perf_counter()
    value = step()                      # the libraries' set-up; compiled: the compile
    first_ms = (time.perf_counter() - start) * 1e3
    # From here the inputs and their gradients (which every variant ends with) are resident:
    # the peak above them is the loss's own memory.
    reset_peak()
    base, _ = memory_mb()
    for _ in range(max(0, args.warmup - 1)):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        value = step()
        times.append((time.perf_counter() - start) * 1e3)
    return {"variant": variant, "compiled": compiled == "1", "ms": statistics.median(times),
            "threads": torch.get_num_threads(),
            "times_ms": times, "first_ms": first_ms, "peak_extra_mb": memory_mb()[1] - base,
            "base_mb": base, "loss": value, "chunk_tokens": chunk if variant == "chunked" else None}


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has run (user, nice, system; /proc/stat), so that the run
    can say how busy the machine was besides itself."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (fields[0] + fields[1] + fields[2]) / os.sysconf("SC_CLK_TCK")


def child_env() -> tuple[dict, str]:
    """The subprocesses' environment, with OpenMP's wait policy as
    train_fp8.py sets it (passive on a CPU machine: a busy neighbour then costs its share, not
    several times that); the policy in words."""
    from ..train import threads
    env = dict(os.environ)
    return env, threads.apply(env) or "libgomp's default wait policy"


def run_child(script: str, argv, variant: str, compiled: bool, env: dict) -> dict:
    """One variant in a fresh process: `script` (scripts/bench_loss.py) run with --_child."""
    proc = subprocess.run([sys.executable, script, *argv,
                           "--_child", f"{variant}:{int(compiled)}"],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"{variant}{' compiled' if compiled else ''}: exit {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args, argv: list, script: str) -> int:
    """Both variants (and compiled, with --compile), each in its own process; the table and
    the ratios printed, and written to --json."""
    env, policy = child_env()
    import torch
    logits_mb = args.tokens * args.vocab * 4 / 2 ** 20
    print(f"vocab {args.vocab}, hidden {args.hidden}, {args.tokens} tokens, {args.dtype} inputs, "
          f"penalty {args.penalty}; torch {torch.__version__}, {policy}; the fp32 logits of the "
          f"batch: {logits_mb:.0f} MB")
    import resource
    rows = []
    busy0, wall0 = busy_cpu_s(), time.monotonic()
    for compiled in ((False, True) if args.compile else (False,)):
        for variant in VARIANTS:
            rows.append(run_child(script, argv, variant, compiled, env))
    ours = resource.getrusage(resource.RUSAGE_CHILDREN)
    others = max(0.0, busy_cpu_s() - busy0 - ours.ru_utime - ours.ru_stime)
    wall = time.monotonic() - wall0
    print(f"{'variant':<32} {'ms/step':>9} {'peak extra MB':>14} {'loss':>10}  first step")
    for r in rows:
        per = min(r["chunk_tokens"] or args.tokens, args.tokens)
        name = r["variant"] + (" compiled" if r["compiled"] else "") + (
            f" ({-(-args.tokens // per)} x {per} rows)" if r["chunk_tokens"] else "")
        print(f"{name:<32} {r['ms']:>9.1f} {r['peak_extra_mb']:>14.0f} {r['loss']:>10.5f}  "
              f"{r['first_ms']:.0f} ms")
    for compiled in ((False, True) if args.compile else (False,)):
        plain, chunked = (next(r for r in rows if r["variant"] == v and r["compiled"] == compiled)
                          for v in VARIANTS)
        print(f"chunked / plain{' (compiled)' if compiled else ''}: time "
              f"{chunked['ms'] / plain['ms']:.2f}x, peak extra memory "
              f"{chunked['peak_extra_mb'] / max(plain['peak_extra_mb'], 1e-9):.3f}x")
    print(f"{rows[0]['threads']} torch threads; {wall:.0f} s; other processes kept "
          f"{others / wall:.2f} of the machine's {os.cpu_count()} cores busy meanwhile "
          "(/proc/stat)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "_child"},
                       "torch": torch.__version__, "results": rows, "wall_s": wall,
                       "other_cores_busy": others / wall}, f, indent=1)
    return 0
