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
import os
import sys


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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    from fp8train.analysis import loss_bench
    if args._child:
        import json
        print(json.dumps(loss_bench.child(args)))
        return 0
    return loss_bench.run(args, argv, os.path.abspath(__file__))


if __name__ == "__main__":
    from fp8train.observe.console import run_main  # a closed stdout (| head): no traceback
    sys.exit(run_main(main))
