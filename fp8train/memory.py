"""Device memory between start-up's trials: what a probe or a timing left behind, freed."""
from __future__ import annotations

import gc
from typing import Optional

import torch


def release_memory(device: Optional[torch.device] = None) -> None:
    """Free what a trial left behind; with `device`, also start its peak-memory statistics
    afresh, so that the run's system/gpu_memory_peak_gb describes the run, not the trials."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        if device is not None and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
