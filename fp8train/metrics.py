"""Throughput, MFU and memory, computed in one place, and the metrics.jsonl writer."""
from __future__ import annotations

import json
import os
from typing import Optional

# Dense bf16 tensor-core peaks (FLOP/s) from NVIDIA's datasheets, without sparsity. Matched
# against torch.cuda.get_device_name() in order: more specific names first.
PEAK_BF16_FLOPS = (
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989.4e12),      # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200 NVL", 835e12),
    ("H200", 989.4e12),      # SXM
    ("GH200", 989.4e12),
    ("B200", 2250e12),
    ("A100", 312e12),
)


def peak_flops(device_name: Optional[str]) -> Optional[float]:
    """bf16 peak of a known GPU; None for anything else (no MFU rather than a guess)."""
    if not device_name:
        return None
    for key, peak in PEAK_BF16_FLOPS:
        if key in device_name:
            return peak
    return None


def mfu(flops_per_token: float, tokens_per_sec_per_device: float,
        peak: Optional[float]) -> Optional[float]:
    if peak is None or tokens_per_sec_per_device <= 0:
        return None
    return flops_per_token * tokens_per_sec_per_device / peak


class MetricsWriter:
    """One JSON object per line in <output_dir>/metrics.jsonl (main process only)."""

    def __init__(self, path: str, enabled: bool):
        self.path, self.enabled = path, enabled

    def truncate_after(self, step: int) -> int:
        """On resume, drop rows logged after the checkpoint's step: those steps are re-run and
        would otherwise appear twice. Returns how many rows were dropped."""
        if not self.enabled or not os.path.isfile(self.path):
            return 0
        with open(self.path, encoding="utf-8") as fh:
            lines = fh.readlines()
        keep = []
        for line in lines:
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:   # a torn last line from a crash
                pass
        if len(keep) != len(lines):
            tmp = self.path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.writelines(keep)
            os.replace(tmp, self.path)
        return len(lines) - len(keep)

    def write(self, row: dict) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")
