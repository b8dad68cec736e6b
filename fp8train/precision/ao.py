"""torchao float8 training: `convert_to_float8_training` with a named recipe and our layer
filter. Scaling is dynamic (each tensor, or each row, scaled from its own amax every step), so
the delayed-scaling keys (margin, amax history) do not apply. On a CPU torchao emulates the
FP8 GEMMs (`emulate=True`), which keeps the numerics and drops the speed."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Optional

import torch
from torch import nn

from .base import Fp8Backend, Precision
from .probe import ScaleProbe


def import_float8():
    # torchao logs a warning for each optional CUDA kernel library it cannot load (all of them
    # on a CPU machine); none is used here.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    import torchao.float8 as float8
    from torchao.float8 import float8_utils
    return float8, float8_utils


class TorchAO(Fp8Backend):
    label = "torchao"

    def __init__(self, cfg, base: Precision, run_dir: Optional[str] = None):
        super().__init__(cfg, base, run_dir)
        self.name = f"fp8-torchao-{cfg.fp8_recipe} ({base.name} elsewhere)"
        self.modules: dict = {}

    def unavailable(self, device: torch.device) -> Optional[str]:
        try:
            import_float8()
        except Exception as e:  # ImportError, or a torchao built for another torch
            return f"torchao cannot be imported ({type(e).__name__}: {e}); pip install torchao"
        return self.device_gate(device, cpu_emulation=True)

    def float8_config(self):
        float8, _ = import_float8()
        config = float8.Float8LinearConfig.from_recipe_name(self.cfg.fp8_recipe)
        return dataclasses.replace(config, emulate=self.emulate)

    def convert(self, model: nn.Module) -> nn.Module:
        float8, float8_utils = import_float8()
        chosen = set(self.select(model))
        config = self.float8_config()
        float8.convert_to_float8_training(model, config=config,
                                          module_filter_fn=lambda mod, fqn: fqn in chosen)
        self.modules = {n: model.get_submodule(n) for n in self.selection.chosen}
        wrong = [n for n, m in self.modules.items() if type(m) is nn.Linear]
        if wrong:
            raise RuntimeError(f"torchao did not convert {wrong}")
        dtypes = {"input": config.cast_config_input.target_dtype,
                  "weight": config.cast_config_weight.target_dtype,
                  "grad_output": config.cast_config_grad_output.target_dtype}
        dtypes = {k: v or float8_utils.e4m3_dtype for k, v in dtypes.items()}
        pow2 = config.round_scales_to_power_of_2

        def scale_fn(module, kind, amax):
            # Dynamic scaling: the scale torchao derives from this tensor's amax (for rowwise
            # recipes the smallest row scale, which is the one from the tensor's amax).
            return float8_utils.amax_to_scale(amax, dtypes[kind], pow2)

        self.recorder = ScaleProbe(self.modules, scale_fn, dtypes, self.cfg.fp8_log_layers)
        return model

    @contextlib.contextmanager
    def high_precision(self):
        # Route the converted layers through nn.Linear's own forward.
        for m in self.modules.values():
            m.forward = nn.Linear.forward.__get__(m)
        try:
            yield
        finally:
            for m in self.modules.values():
                del m.forward

    def cautions(self) -> list:
        out = super().cautions()
        if not self.emulate and not self.cfg.compile and self.selection.chosen:
            out.append("torchao float8 without compile: its casts to FP8 run as separate "
                       "kernels around every GEMM, which usually makes the converted layers "
                       "slower than bf16; set compile: true")
        return out

    def describe(self) -> str:
        how = "emulated on CPU: numerics only, no speed-up" if self.emulate else "CUDA"
        return (f"FP8 torchao ({how}); recipe {self.cfg.fp8_recipe}, dynamic scaling "
                f"(fp8_margin / fp8_amax_* do not apply)")
