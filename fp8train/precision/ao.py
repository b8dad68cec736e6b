"""torchao float8 training: `convert_to_float8_training` with a named recipe and our layer
filter. Scaling is dynamic (each tensor, or each row, scaled from its own amax every step), so
the delayed-scaling keys (margin, amax history) do not apply. On a CPU torchao emulates the
FP8 GEMMs (`emulate=True`), which keeps the numerics and drops the speed.

Under FSDP2 with the tensorwise recipe, the weights are all-gathered in FP8 (key
fp8_fsdp_all_gather, default on there): torchao wraps each converted weight so that FSDP2 casts
its shard to FP8 before the all-gather (half the bytes of bf16) and the gathered weight is
already the FP8 operand of the GEMM. The cast needs the amax of the whole weight; after every
optimizer step `precompute_float8_dynamic_scale_for_fsdp` computes the scales of all weights
with one all-reduce, which each shard then casts with. Without a precomputed scale (the first
step) torchao all-reduces each weight's amax inside its all-gather instead: the same scale."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..observe.console import drop_torchao_import_noise
from .base import Fp8Backend, Precision
from .probe import ScaleProbe
from .scaling import sample


def import_float8():
    # torchao's import logs a warning for each optional CUDA kernel library it cannot load (all
    # of them on a CPU machine; none is used here), and torch one for its Enum registrations.
    drop_torchao_import_noise()
    import torchao.float8 as float8
    from torchao.float8 import float8_utils
    return float8, float8_utils


def distribution() -> str:
    """How Accelerate will distribute this run's model at prepare(): "FSDP2", or what else
    (Accelerate's DistributedType: "NO", "MULTI_GPU", "FSDP" for FSDP1, ...). Known from the
    Accelerator, which is created before the model is converted. Accelerate runs FSDP only on
    CUDA: on a CPU an FSDP launch config gives MULTI_CPU (DDP)."""
    from accelerate.state import AcceleratorState, is_initialized
    if not is_initialized():
        return "no Accelerator"
    state = AcceleratorState()
    return "FSDP2" if state.is_fsdp2 else str(getattr(state.distributed_type, "value",
                                                       state.distributed_type))


def fsdp_ram_efficient_loading() -> bool:
    """The FSDP plugin's cpu_ram_efficient_loading. That loading moves the model to the meta
    device and assigns rank 0's state dict back into it, which torchao's FP8-gather weight
    wrappers (no storage of their own) cannot go through; Accelerate refuses the pair for its
    own torchao path (accelerator.py's FSDP2 checks)."""
    from accelerate.state import AcceleratorState, is_initialized
    if not is_initialized():
        return False
    plugin = AcceleratorState().fsdp_plugin
    return bool(getattr(plugin, "cpu_ram_efficient_loading", False))


# distribution() -> how the run is distributed instead, in words.
NOT_FSDP2 = {"NO": "one process", "MULTI_GPU": "DDP",
             "MULTI_CPU": "DDP on CPUs: Accelerate runs FSDP only on CUDA",
             "FSDP": "FSDP1: fsdp_version 1", "no Accelerator": "no Accelerator"}


class TorchAO(Fp8Backend):
    label = "torchao"

    def __init__(self, spec, base: Precision):
        super().__init__(spec, base)
        self.name = f"fp8-torchao-{spec.recipe} ({base.name} elsewhere)"
        self.modules: dict = {}
        self.model: Optional[nn.Module] = None   # what convert converted: FSDP2 shards it in place
        self.trials = False
        self.fsdp_all_gather = False   # decided in convert: the weights are all-gathered in FP8
        self.distributed_as = None     # distribution() as convert found it
        self.ram_efficient_loading = False   # FSDP2's cpu_ram_efficient_loading kept it off

    def for_trials(self) -> "TorchAO":
        # Trial models are never sharded: each rank runs its own whole copy.
        self.trials = True
        return self

    def decide_fsdp_all_gather(self) -> bool:
        """fp8_fsdp_all_gather's effective value: on for FSDP2 with the tensorwise recipe
        unless the key is false (validation refuses true with another recipe)."""
        if self.spec.fsdp_all_gather is False or self.spec.recipe != "tensorwise" or \
                self.trials:
            return False
        self.distributed_as = distribution()
        if self.distributed_as != "FSDP2":
            return False
        self.ram_efficient_loading = fsdp_ram_efficient_loading()
        return not self.ram_efficient_loading

    def unavailable(self, device: torch.device) -> Optional[str]:
        try:
            import_float8()
        except Exception as e:  # ImportError, or a torchao built for another torch
            return f"torchao cannot be imported ({type(e).__name__}: {e}); pip install torchao"
        return self.device_gate(device, cpu_emulation=True)

    def float8_config(self):
        float8, _ = import_float8()
        config = float8.Float8LinearConfig.from_recipe_name(self.spec.recipe)
        return dataclasses.replace(config, emulate=self.emulate,
                                   enable_fsdp_float8_all_gather=self.fsdp_all_gather)

    def convert(self, model: nn.Module) -> nn.Module:
        float8, float8_utils = import_float8()
        chosen = set(self.select(model))
        self.fsdp_all_gather = self.decide_fsdp_all_gather() and bool(chosen)
        self.model = model
        config = self.float8_config()
        float8.convert_to_float8_training(model, config=config,
                                          module_filter_fn=lambda mod, fqn: fqn in chosen)
        if self.fsdp_all_gather:
            expose_storage(model)
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

        probe = GatheredWeightProbe if self.fsdp_all_gather else ScaleProbe
        self.recorder = probe(self.modules, scale_fn, dtypes, self.spec.log_layers)
        return model

    def after_optimizer_step(self) -> None:
        if self.fsdp_all_gather:
            self.precompute_scales()

    def precompute_scales(self) -> None:
        """Each FP8-gathered weight's scale from its updated values: one all-reduce for all of
        them. Also when FP8 compute is switched off (recover): the weights are still gathered
        in FP8, and a scale left from older weights would clip the new ones."""
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
        precompute_float8_dynamic_scale_for_fsdp(self.model)

    def recover(self, how: str, why: "str | None" = None) -> "str | None":
        # A rollback has just restored older weights: the precomputed scales are stale.
        if self.fsdp_all_gather:
            self.precompute_scales()
        return super().recover(how, why)

    @contextlib.contextmanager
    def high_precision(self):
        # Route the converted layers through nn.Linear's own forward; under the FP8 all-gather
        # the weight arrives in FP8 and is dequantized first (plain_weight).
        for m in self.modules.values():
            m.forward = (lambda x, m=m: F.linear(x, plain_weight(m.weight), m.bias)) \
                if self.fsdp_all_gather else nn.Linear.forward.__get__(m)
        try:
            yield
        finally:
            for m in self.modules.values():
                del m.forward

    def cautions(self) -> list:
        out = super().cautions()
        if not self.emulate and not self.spec.compile and self.selection.chosen:
            out.append("torchao float8 without compile: its casts to FP8 run as separate "
                       "kernels around every GEMM, which usually makes the converted layers "
                       "slower than bf16; set compile: true")
        if self.spec.fsdp_all_gather and not self.fsdp_all_gather and not self.trials and \
                self.distributed_as not in (None, "FSDP2"):
            how = NOT_FSDP2.get(self.distributed_as, f"Accelerate's {self.distributed_as}")
            out.append(f"fp8_fsdp_all_gather: true does nothing here: this run is not sharded "
                       f"with FSDP2 ({how}), so no weight is all-gathered; it applies under "
                       "FSDP2 (fsdp_version: 2, on CUDA)")
        if self.ram_efficient_loading:
            out.append("fp8_fsdp_all_gather is off: the FSDP config sets "
                       "cpu_ram_efficient_loading, which torchao's FP8-gathered weights cannot go "
                       "through; the weights are all-gathered in the base precision (set "
                       "fsdp_cpu_ram_efficient_loading: false in the Accelerate config to gather "
                       "them in FP8)")
        return out

    def describe(self) -> str:
        how = "emulated on CPU: numerics only, no speed-up" if self.emulate else "CUDA"
        gather = "; FSDP2 all-gathers the weights in FP8 (scales precomputed after each " \
            "optimizer step)" if self.fsdp_all_gather else ""
        return (f"FP8 torchao ({how}); recipe {self.spec.recipe}, dynamic scaling "
                f"(fp8_margin / fp8_amax_* do not apply){gather}")

    def derived(self) -> dict:
        return {**super().derived(), "fp8_fsdp_all_gather": self.fsdp_all_gather}


def expose_storage(model: nn.Module) -> None:
    """Give each FP8-gathered weight the data_ptr() of the storage it wraps. Accelerate's FSDP2
    prepare() pairs each optimizer parameter with its sharded successor by data_ptr(), and
    torchao's wrapper tensor has no storage of its own: its data_ptr() is 0 for every converted
    weight, so all of them would be paired with the same sharded weight, which the optimizer
    would then step once per converted layer while the others never change. (Accelerate reads
    the wrapped storage itself only when it does the torchao conversion, which fp8train does
    not let it do.)"""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    for p in model.parameters():
        if isinstance(p, WeightWithDynamicFloat8CastTensor):
            (inner, *_), _ = p.__tensor_flatten__()   # the wrapped high-precision weight
            p.data_ptr = getattr(p, inner).data_ptr


def plain_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight as a plain tensor. Under the FP8 all-gather, FSDP2 hands each converted layer
    its weight as torchao's FP8 tensor, which takes part only in FP8 GEMMs: dequantized here
    (its values carry the FP8 rounding of the gather)."""
    from torchao.float8 import Float8TrainingTensor
    if isinstance(weight, Float8TrainingTensor):
        return weight.to_original_precision()
    return weight


class GatheredWeightProbe(ScaleProbe):
    """The scale read-out when the weights arrive in FP8 (the FSDP2 all-gather): the weight's
    statistics are taken from its dequantized values. Its scale is then the one the gather
    used, nothing saturates (dynamic scaling), and the values that underflowed are already 0:
    the underflow fraction is the share of zeros (a trained weight in high precision has
    essentially none)."""

    def _measure(self, module: nn.Module, kind: str, t: torch.Tensor) -> dict:
        if kind != "weight":
            return super()._measure(module, kind, t)
        w = plain_weight(t.detach())
        vals = super()._measure(module, kind, w)
        vals["underflow_weight"] = (sample(w) == 0).float().mean()
        return vals
