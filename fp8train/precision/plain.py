"""The non-FP8 precisions: fp32, bf16 autocast, fp16 autocast with loss scaling."""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

from .base import Precision


class FP32(Precision):
    name = "fp32"
    mixed_precision = "no"


class BF16(Precision):
    """bf16 autocast (Accelerate), fp32 master weights and optimizer state."""
    name = "bf16"
    mixed_precision = "bf16"

    def unavailable(self, device: torch.device) -> Optional[str]:
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return f"bf16 is not supported on {torch.cuda.get_device_name(device)}"
        return None


class FP16(Precision):
    """fp16 autocast with dynamic loss scaling: Accelerate's GradScaler scales the loss in
    backward, unscales before clipping and skips steps whose gradients overflowed."""
    name = "fp16"
    mixed_precision = "fp16"

    def __init__(self):
        self.scaler = None

    def unavailable(self, device: torch.device) -> Optional[str]:
        if device.type != "cuda":
            # Accelerate would silently run fp16 on CPU as plain fp32.
            return "fp16 with loss scaling needs a CUDA GPU"
        return None

    def after_prepare(self, accelerator) -> None:
        self.scaler = accelerator.scaler

    def stats(self) -> "OrderedDict[str, torch.Tensor]":
        out = OrderedDict()
        scale = getattr(self.scaler, "_scale", None)  # a device tensor: no sync to read it here
        if scale is not None:
            out["train/loss_scale"] = scale.detach().float().reshape(())
        return out
