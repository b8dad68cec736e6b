"""Throughput, MFU and memory, computed in one place, and the metrics.jsonl writer."""
from __future__ import annotations

import json
import os
from typing import Optional

# Dense bf16 tensor-core peaks (FLOP/s) from NVIDIA's datasheets, without sparsity, matched
# against torch.cuda.get_device_name() in order: more specific names first ("GH200" before
# "H200", "H100 PCIe" before "H100"). FP8 runs are measured against these bf16 peaks too (see
# peak_note): an FP8 MFU against the FP8 peak would halve the number for the same speed and
# hide whether FP8 made training faster.
PEAK_BF16_FLOPS = (
    ("GB200", "GB200", None),             # not a B200: no datasheet figure here, so no MFU
    ("GH200", "GH200", 989.4e12),
    ("H200 NVL", "H200 NVL", 835e12),
    ("H200", "H200 SXM", 989.4e12),
    ("H100 NVL", "H100 NVL", 835e12),
    ("H100 PCIe", "H100 PCIe", 756e12),
    ("H100", "H100 SXM", 989.4e12),      # "NVIDIA H100 80GB HBM3"
    ("B200", "B200", 2250e12),
    ("A100", "A100", 312e12),            # SXM and PCIe alike
)


def peak_flops(device_name: Optional[str]) -> Optional[float]:
    """bf16 dense peak of a known GPU; None for anything else (no MFU rather than a guess)."""
    found = _peak_entry(device_name)
    return found[2] if found else None


def is_mig(device_name: Optional[str]) -> bool:
    """A MIG slice ("NVIDIA H100 80GB HBM3 MIG 3g.40gb") has a fraction of the GPU's SMs: the
    datasheet peak of the whole GPU would understate its MFU by that fraction."""
    return bool(device_name) and " MIG " in f" {device_name} "


def _peak_entry(device_name: Optional[str]):
    if is_mig(device_name):
        return None
    for entry in PEAK_BF16_FLOPS:
        if device_name and entry[0] in device_name:
            return entry
    return None


def peak_note(device_name: Optional[str], fp8: bool) -> str:
    """Which peak train/mfu is measured against, said once at start and kept in config.yaml."""
    if is_mig(device_name):
        return (f"no MFU: '{device_name}' is a MIG slice, and the peak table holds whole GPUs; "
                "tokens/s is still measured")
    found = _peak_entry(device_name)
    if found is None or found[2] is None:
        return (f"no MFU: '{device_name}' is not in the peak table (H100/H200/GH200/B200/"
                "A100); tokens/s is still measured")
    note = f"MFU against the {found[1]} bf16 dense peak, {found[2] / 1e12:g} TFLOP/s"
    if fp8:
        note += " (FP8 run: MFU is against the bf16 peak, not the FP8 one)"
    return note


def mfu(flops_per_token: float, tokens_per_sec_per_device: float,
        peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation: the model's training FLOPs actually done per second on one
    device over that device's peak. Recomputation (activation checkpointing) is not counted:
    it is work, not progress."""
    if peak is None or tokens_per_sec_per_device <= 0:
        return None
    return flops_per_token * tokens_per_sec_per_device / peak


def throughput(tokens_per_step: int, steps: int, seconds: float, world: int,
               flops_per_token: float, peak: Optional[float]) -> dict:
    """train/tokens_per_sec (all devices), per device, step time and MFU over an interval of
    `steps` optimizer steps that took `seconds` of training time (eval excluded)."""
    tok_s = tokens_per_step * steps / seconds if seconds > 0 else 0.0
    row = {"train/tokens_per_sec": tok_s, "train/tokens_per_sec_per_device": tok_s / world,
           "train/step_time": seconds / steps if steps else 0.0}
    m = mfu(flops_per_token, tok_s / world, peak)
    if m is not None:
        row["train/mfu"] = m
    return row


class MetricsWriter:
    """One JSON object per line in a run-directory file (metrics.jsonl, samples.jsonl), written
    by the main process only."""

    def __init__(self, path: str, enabled: bool, warn=None):
        self.path, self.enabled = path, enabled
        self.warn = warn or (lambda msg: None)
        self.lost = 0   # rows that could not be written (disk full): said once, then counted

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
        if not self.enabled:
            return
        try:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")
        except OSError as e:
            if not self.lost:
                self.warn(f"cannot write {self.path} ({e.strerror or e}); its rows are lost "
                          "until it can be written again (training goes on)")
            self.lost += 1
