"""Transformer Engine FP8 (DelayedScaling), applied by us rather than by Accelerate.

Accelerate's own TE path (mixed_precision="fp8" + TERecipeKwargs) has three faults in 1.x:
`to_kwargs()` drops fields equal to Accelerate's defaults, so amax_compute_algo="most_recent"
silently becomes TE's "max"; its convert_model stops at the first Linear whose dims are not
divisible by 16 (a `return` where a `continue` belongs); and `interval` /
`override_linear_precision` raise on TE 2.x. So this backend builds TE's DelayedScaling from the
config itself (every value as given, checked by a test against TE's own recipe class), swaps
the selected Linears for te.Linear, and enters TE's autocast around each forward. Accelerate
still runs the bf16 autocast and the distribution.

TE keeps its delayed-scaling state (scales, amax histories) in each module's fp8_meta and
saves it in checkpoints as `_extra_state`, so a resume continues with the same scales."""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch
from torch import nn

from ..errors import one_line
from .base import Fp8Backend, Precision
from .layers import replace_module
from .probe import ScaleProbe
from .scaling import FORMATS

# fp8_meta layout (TE 2.x): forward tensors 0 input, 1 weight; backward 0 grad_output.
_META = {"input": ("scaling_fwd", 0), "weight": ("scaling_fwd", 1),
         "grad_output": ("scaling_bwd", 0)}


def recipe_kwargs(cfg, margin: int | None = None, reduce_amax: bool = True) -> dict:
    """The DelayedScaling arguments, with the format as the name of TE's Format member.
    reduce_amax=False only for fp8_layers auto's timing, which runs on rank 0 alone: with it,
    TE would all-reduce the amaxes over ranks that never join."""
    return dict(fp8_format={"hybrid": "HYBRID", "e4m3": "E4M3"}[cfg.fp8_format],
                margin=cfg.fp8_margin if margin is None else margin, amax_history_len=cfg.fp8_amax_history_len,
                amax_compute_algo=cfg.fp8_amax_compute_algo, reduce_amax=reduce_amax)


def build_recipe(cfg, recipe_module=None, margin: int | None = None, reduce_amax: bool = True):
    """transformer_engine.common.recipe.DelayedScaling for this config."""
    if recipe_module is None:
        from transformer_engine.common import recipe as recipe_module
    kw = recipe_kwargs(cfg, margin, reduce_amax)
    kw["fp8_format"] = getattr(recipe_module.Format, kw["fp8_format"])
    return recipe_module.DelayedScaling(**kw)


class TransformerEngine(Fp8Backend):
    label = "te"

    def __init__(self, cfg, base: Precision, run_dir: Optional[str] = None):
        super().__init__(cfg, base, run_dir)
        self.te = None            # transformer_engine.pytorch, once unavailable() imported it
        self.recipes = None       # transformer_engine.common.recipe
        self.recipe = None
        self.modules: dict = {}
        self.reduce_amax = True   # False for trials (for_trials)

    def for_trials(self) -> "TransformerEngine":
        # With reduce_amax, every TE scale update all-reduces the amaxes over all ranks: in
        # trials that differ per rank (one runs out of memory part-way), the ranks would enter
        # different collectives and hang.
        self.reduce_amax = False
        return self

    def reset_trials(self) -> None:
        # The trial's modules stay in TE's process-wide amax buffers (registered once per module,
        # never removed) and every later scale update would concatenate and reduce them. Only
        # before the real model's first FP8 forward: after it, a reset would drop the real
        # modules' buffers while they keep their "registered" marker, and their scales would
        # silently stop updating.
        if self.te is not None:
            global_state_manager().reset()

    def unavailable(self, device: torch.device) -> Optional[str]:
        if device.type != "cuda":
            return "Transformer Engine needs a CUDA GPU"
        gate = self.device_gate(device, cpu_emulation=False)
        if gate:
            return gate
        try:
            import transformer_engine.pytorch as te
        except Exception as e:  # ImportError, or a TE built for another torch / CUDA
            return (f"transformer_engine cannot be imported ({one_line(e, 200, with_type=True)}); "
                    "pip install --no-build-isolation 'transformer_engine[pytorch]'")
        from transformer_engine.common import recipe as recipes
        self.te, self.recipes = te, recipes
        # TE refuses to unpickle its delayed-scaling state from a checkpoint unless told to;
        # the checkpoints resumed here are this run's own.
        os.environ.setdefault("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
        return None

    def convert(self, model: nn.Module) -> nn.Module:
        te = self.te
        self.recipe = build_recipe(self.cfg, self.recipes, margin=self.margin(),
                                   reduce_amax=self.reduce_amax)
        for name in self.select(model):
            lin = model.get_submodule(name)
            new = te.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                            params_dtype=lin.weight.dtype, device=lin.weight.device)
            with torch.no_grad():
                new.weight.copy_(lin.weight)
                if lin.bias is not None:
                    new.bias.copy_(lin.bias)
            replace_module(model, name, new)
            self.modules[name] = new
        # Recompute blocks with TE's checkpoint, which re-enters FP8 with the saved scales
        # (torch's would recompute outside TE's autocast, in high precision).
        model.checkpoint_fn = lambda block, x: te.checkpoint(block, x, use_reentrant=False)
        fwd, bwd = FORMATS[self.cfg.fp8_format]
        self.recorder = ScaleProbe(self.modules, _te_scale, {"input": fwd, "weight": fwd,
                                                          "grad_output": bwd},
                                self.cfg.fp8_log_layers)
        return model

    def _autocast(self, enabled: bool):
        autocast = getattr(self.te, "autocast", None)
        if autocast is not None:                       # newer TE; fp8_autocast is deprecated
            return autocast(enabled=enabled, recipe=self.recipe)
        return self.te.fp8_autocast(enabled=enabled, fp8_recipe=self.recipe)

    def fp8_context(self):
        return self._autocast(True)

    def raise_margin(self) -> bool:
        # Mutated in place, never replaced. TE registers each module's amax and scale buffers
        # once, under a key made from the recipe's repr at its first FP8 forward, and its scale
        # update looks the recipe up by that key (FP8GlobalStateManager.autocast_arguments,
        # filled at autocast entry) and passes its `margin` to the fused update. That entry is
        # this very object, so it sees the new margin (the repr, and so the key of later
        # autocast entries, changes too; the registered buffers keep the old key). A new recipe
        # object would change the log line and nothing else (TE's TODO #3157: same-class recipe
        # changes mid-training are not picked up). A rollback's load_state puts the checkpoint's
        # unpickled recipe into each module's fp8_meta; the next FP8 forward replaces it with
        # this one, since the two now differ.
        if self.recipe is None:   # not converted yet: the recipe is built with the margin
            return True
        self.recipe.margin = self.margin() + 1
        return True

    @contextlib.contextmanager
    def high_precision(self):
        try:
            with self._autocast(False):
                yield
        finally:
            # A forward outside FP8 marks the modules as having no FP8 state to save, and the
            # next checkpoint would drop their scales: they still have them.
            for m in self.modules.values():
                if "scaling_fwd" in getattr(m, "fp8_meta", {}):
                    m.fp8_meta["fp8_checkpoint"] = True

    def describe(self) -> str:
        kw = recipe_kwargs(self.cfg, self.margin())
        return ("FP8 Transformer Engine: DelayedScaling(" +
                ", ".join(f"{k}={v}" for k, v in kw.items()) + ")")


def global_state_manager():
    """TE's FP8GlobalStateManager: in transformer_engine.pytorch.quantization in current TE,
    in transformer_engine.pytorch.fp8 in older releases (a deprecated alias in current ones)."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return FP8GlobalStateManager


def _te_scale(module, kind: str, amax: torch.Tensor) -> torch.Tensor:
    """The scale TE applies to this tensor now: its delayed-scaling state, which it creates on
    the first FP8 forward (before that, TE's initial scale of 1)."""
    key, index = _META[kind]
    meta = getattr(module, "fp8_meta", {}).get(key)
    if meta is None:
        return torch.ones((), device=amax.device)
    return meta.scale[index].clone()  # TE updates it in place after this step

