#!/usr/bin/env python3
"""Time and peak memory of the output layer's loss, forward and backward, at a large vocabulary:
the plain loss, lm_loss(F.linear(h, W), t) with the whole micro-batch's logits, against
chunked_lm_loss(h, W, t), a chunk of tokens at a time (fp8train/loss.py).

    python scripts/bench_loss.py                    # Llama 3's vocabulary, 1,024 tokens: 20-40 s
    python scripts/bench_loss.py --tokens 4096 --steps 1          # 8 chunks of 512 rows
    python scripts/bench_loss.py --vocab 152064 --hidden 512 --compile

Each variant runs in a fresh subprocess: it allocates h (tokens x hidden) and W (vocab x hidden),
both requiring grad, and t, runs one step (the libraries' set-up; compiled, the compile), hands
freed heap memory back (malloc_trim) and restarts the kernel's peak resident size (VmHWM, through
/proc/self/clear_refs); then --warmup - 1 and --steps steps of forward + backward, the gradients
set to None before each as training does. "peak extra" is that peak less the resident size at
the restart, when h, W and their gradients were resident: the memory of the loss itself. Large
blocks (the logits) are mmapped and handed back on free, so resident memory follows the tensors.
The time is the median of the timed steps. The subprocesses run with OpenMP's wait policy as
train_fp8.py sets it on a CPU machine (passive); the last line says how busy other processes
kept the machine meanwhile. CPU tensors and Linux only: nothing here says anything about a GPU.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("plain", "chunked")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary (Llama 3's) [128256]")
    p.add_argument("--hidden", type=int, default=64, help="hidden size C (the GEMMs' share of "
                   "the time; the memory is the logits') [64]")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per micro-batch, B x T "
                   "(run as B=1) [1024]")
    p.add_argument("--chunk-tokens", type=int, help="rows per chunk [the loss's default: "
                   "default_chunk_tokens(vocab), 512 at 128256]")
    p.add_argument("--penalty", choices=("none", "z_loss", "logit_l2"), default="none",
                   help="penalty_type, weight 1e-4 [none]")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of h and W (the loss is fp32 either way) [fp32]")
    p.add_argument("--steps", type=int, default=2, help="timed steps [2]")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed steps first, the first (set-up or compile) included [1]")
    p.add_argument("--compile", action="store_true",
                   help="also each variant under torch.compile (inductor); its first step, the "
                   "compile, is reported apart")
    p.add_argument("--threads", type=int, help="torch threads in each subprocess [torch's "
                   "default]")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("vocab", "hidden", "tokens", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.warmup < 1 or (args.chunk_tokens is not None and args.chunk_tokens < 1):
        p.error("--warmup and --chunk-tokens must be at least 1")
    return args


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

    from fp8train.loss import chunked_lm_loss, default_chunk_tokens, lm_loss
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
    """The subprocesses' environment: this checkout importable, and OpenMP's wait policy as
    train_fp8.py sets it (passive on a CPU machine: a busy neighbour then costs its share, not
    several times that); the policy in words."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from fp8train.train import threads
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env, threads.apply(env) or "libgomp's default wait policy"


def run_child(argv, variant: str, compiled: bool, env: dict) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv,
                           "--_child", f"{variant}:{int(compiled)}"],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"{variant}{' compiled' if compiled else ''}: exit {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args._child:
        print(json.dumps(child(args)))
        return 0
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
            rows.append(run_child(argv, variant, compiled, env))
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


if __name__ == "__main__":
    from fp8train.observe.console import run_main  # a closed stdout (| head): no traceback
    sys.exit(run_main(main))
