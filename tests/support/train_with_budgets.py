"""train_fp8.py with a memory budget per rank for the batch probe, installed from outside the
package: the tests of ranks that fit different micro-batches run this instead of train_fp8.py
(fp8train itself has one budget, probe_memory_limit_gb, the same on every rank).

    FP8TRAIN_RANK_BUDGETS_GB="0.25,0.05"   rank i probes within the i-th value in GB (the last
                                           one repeats); a value that is not a number fails
                                           that rank's probe with a ValueError
"""
import dataclasses
import os
import sys

ENV = "FP8TRAIN_RANK_BUDGETS_GB"


def install(spec: str) -> None:
    """Wrap the probe's device_budget so that each rank's probe_memory_limit_gb is its value
    from `spec`, read when the probe asks for its budget (a bad value fails inside the probe,
    where a rank's errors are shared with the others)."""
    from fp8train.batch import fit
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    real = fit.device_budget

    def device_budget(cfg, device, rank):
        limit_gb = float(parts[min(rank, len(parts) - 1)])
        return real(dataclasses.replace(cfg, probe_memory_limit_gb=limit_gb), device, rank)

    fit.device_budget = device_budget


if __name__ == "__main__":
    if os.environ.get(ENV):
        install(os.environ[ENV])
    from fp8train.train.cli import main
    sys.exit(main())
