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
  is measured against the datasheet peak in fp8train/observe/metrics.py; the measured matmul ceiling
  says how much of that peak this machine reaches at all, so an MFU of 40% reads as 40 of, say,
  70 reachable, not 40 of 100.

It ends with one verdict per feature (OK / MISSING / FAILED, and why) and exits 0 whatever it
finds: a missing feature is a finding, not an error of the script. Without CUDA it says why and
reports what it can (versions, which FP8 backends import) in a few seconds.
The checks themselves are fp8train.diagnose; this file is the command.
"""
import sys

from fp8train.diagnose import main

if __name__ == "__main__":
    from fp8train.observe.console import run_main  # a closed stdout (| head): no traceback
    sys.exit(run_main(main))
