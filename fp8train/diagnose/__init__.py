"""The GPU check behind scripts/diagnose_gpu.py: what this machine can run, and how fast.

    checks       running one check: every exception caught, CUDA memory freed after it
    environment  versions (torch, CUDA, cuDNN, NCCL, driver) and the CUDA device or why none
    fp8_probes   per FP8 backend: does it import, does a real FP8 GEMM match bf16
    attention    SDPA's flash, memory-efficient and cuDNN kernels, bf16 forward + backward
    ceilings     measured matmul TFLOP/s and copy GB/s, against metrics.py's datasheet peak
    verdicts     one OK / MISSING / FAILED row per feature, and why
    report       the printed sections and the JSON file
    cli          the argparse command line and main()

Only the standard library is imported at import time (`--help` is instant); torch and the
FP8 libraries are imported inside the functions that use them.
"""
from .cli import main

__all__ = ["main"]
