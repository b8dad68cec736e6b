"""Transformer Engine FP8, applied by us rather than by Accelerate, with TE's delayed, current
or block scaling recipe (fp8_recipe: delayed | current | block).

Accelerate's own TE path (mixed_precision="fp8" + TERecipeKwargs) has three faults in 1.x:
`to_kwargs()` drops fields equal to Accelerate's defaults, so amax_compute_algo="most_recent"
silently becomes TE's "max"; its convert_model stops at the first Linear whose dims are not
divisible by 16 (a `return` where a `continue` belongs); and `interval` /
`override_linear_precision` raise on TE 2.x. So this backend builds TE's recipe from the config
itself (every value as given, checked by a test against TE's own recipe classes), swaps the
selected Linears for te.Linear, and enters TE's autocast around each forward. Accelerate still
runs the bf16 autocast and the distribution.

The recipes (transformer_engine.common.recipe, TE 2.x):
- delayed: DelayedScaling. Each tensor's scale comes from an amax history that TE keeps in
  each module's fp8_meta and saves in checkpoints as `_extra_state`, so a resume continues
  with the same scales.
- current: Float8CurrentScaling. One scale per tensor, fp8_max / amax of that very tensor, at
  every cast: no history, no margin, nothing to checkpoint.
- block: Float8BlockScaling. One scale per tile, from the tile's own amax: 1 x 128 tiles for
  inputs and gradients, 128 x 128 for weights, scales rounded down to powers of two (TE's
  defaults). TE runs it from compute capability 9.0 (9.x only before TE 2.9) with a torch
  built for CUDA 12.9 or newer (torch.version.cuda); recipe_unavailable asks TE."""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Optional

import torch
from torch import nn

from ..errors import BadInput, one_line
from .base import Fp8Backend, Precision
from .layers import replace_module
from .probe import ScaleProbe
from .scaling import BLOCK, FORMATS, FP8_MAX, te_scale

# fp8_meta layout (TE 2.x): forward tensors 0 input, 1 weight; backward 0 grad_output.
_META = {"input": ("scaling_fwd", 0), "weight": ("scaling_fwd", 1),
         "grad_output": ("scaling_bwd", 0)}

# fp8_recipe -> TE's recipe class, the TE release that added it, and TE's check of whether
# this GPU runs it: a function of transformer_engine.pytorch (return_reason=True) from TE 2.9,
# a classmethod of FP8GlobalStateManager (no arguments) before.
RECIPES = {"delayed": ("DelayedScaling", "1.0", "is_fp8_available"),
           "current": ("Float8CurrentScaling", "2.2", "is_fp8_available"),
           "block": ("Float8BlockScaling", "2.3", "is_fp8_block_scaling_available")}
_FORMAT_NAMES = {"hybrid": "HYBRID", "e4m3": "E4M3"}
_TE_PIP = "pip install --no-build-isolation 'transformer_engine[pytorch]'"


def recipe_kwargs(spec, margin: int | None = None, reduce_amax: bool = True) -> dict:
    """The DelayedScaling arguments, with the format as the name of TE's Format member.
    reduce_amax=False only for fp8_layers auto's timing, which runs on rank 0 alone: with it,
    TE would all-reduce the amaxes over ranks that never join."""
    return dict(fp8_format=_FORMAT_NAMES[spec.format],
                margin=spec.margin if margin is None else margin,
                amax_history_len=spec.amax_history_len,
                amax_compute_algo=spec.amax_compute_algo, reduce_amax=reduce_amax)


def build_recipe(spec, recipe_module=None, margin: int | None = None, reduce_amax: bool = True):
    """The transformer_engine.common.recipe object for spec.recipe, with the config's
    fp8_format. A recipe TE refuses to build is a BadInput (one line, TE's reason)."""
    if recipe_module is None:
        from transformer_engine.common import recipe as recipe_module
    cls = getattr(recipe_module, RECIPES[spec.recipe][0])
    kw = recipe_kwargs(spec, margin, reduce_amax) if spec.recipe == "delayed" else {}
    kw["fp8_format"] = getattr(recipe_module.Format, _FORMAT_NAMES[spec.format])
    # Current and block scaling get the format alone: margin and reduce_amax are DelayedScaling
    # fields (TE's pydantic dataclasses would drop them without a word). Current scaling has
    # nothing to reduce across data-parallel ranks: each rank scales its own tensors at every
    # cast (the weights, and so their scales, are the same on every rank). TE reduces a
    # current-scaling amax only over the tensor-parallel group under sequence parallelism
    # (module/linear.py sets the quantizer's amax_reduction_group to tp_group) and over the
    # shard group of FSDP2 DTensor weights it quantizes at init (module/base.py), neither of
    # which fp8train uses; autocast's amax_reduction_group feeds only delayed scaling's global
    # amax buffers. Block scales are local to their tile by construction.
    # Both accept hybrid and e4m3 in every TE 2.x: their __post_init__ refuses only E5M2, or
    # a bad NVTE_* environment variable that TE reads as a default. Float8BlockScaling's own
    # default format is E4M3, Float8CurrentScaling's HYBRID; fp8train passes fp8_format as set.
    try:
        return cls(**kw)
    except Exception as e:   # pydantic's ValidationError, carrying the recipe's own assertion
        raise BadInput(
            f"{spec.where('fp8_format', 'fp8_recipe')}: key 'fp8_format': Transformer Engine's "
            f"{cls.__name__} (fp8_recipe: {spec.recipe}) cannot be built with fp8_format "
            f"'{spec.format}': {_validation_message(e)}") from None


def _validation_message(e: Exception) -> str:
    errors = getattr(e, "errors", None)   # pydantic: the first error's message, without links
    if callable(errors):
        try:
            return one_line(Exception(errors()[0]["msg"]), 200)
        except Exception:  # not pydantic's after all
            pass
    return one_line(e, 200)


def recipe_unavailable(te, recipe_module, recipe: str) -> Optional[str]:
    """Why this GPU cannot run fp8_recipe `recipe`, as Transformer Engine itself says (the
    current CUDA device; `te` is transformer_engine.pytorch), or None when it can."""
    cls, since, check = RECIPES[recipe]
    if not hasattr(recipe_module, cls):
        version = getattr(sys.modules.get("transformer_engine"), "__version__", "unknown")
        return (f"this Transformer Engine ({version}) has no {cls} (fp8_recipe: {recipe}, "
                f"added in TE {since}); upgrade it: {_TE_PIP.replace('install', 'install -U')}")
    try:
        fn = getattr(te, check, None)
        ok, why = fn(return_reason=True) if fn is not None else \
            getattr(global_state_manager(), check)()
    except Exception as e:  # a TE that cannot query this device: a reason, not a traceback
        return f"Transformer Engine's {check} failed ({one_line(e, 200, with_type=True)})"
    if ok:
        return None
    return (f"{' '.join(str(why).split()) or 'no reason given'} (Transformer Engine's {check}, "
            f"for {cls})")


class TransformerEngine(Fp8Backend):
    label = "te"
    # TE's modules are not traced by torch.compile (their forward is dynamo-disabled): a
    # compiled block breaks around each of them, and they run eagerly.
    eager_under_compile = ("Transformer Engine's layers run eagerly between the compiled pieces "
                           "of each block")

    def __init__(self, spec, base: Precision):
        super().__init__(spec, base)
        self.te = None            # transformer_engine.pytorch, once unavailable() imported it
        self.recipes = None       # transformer_engine.common.recipe
        self.recipe = None
        self.modules: dict = {}
        self.reduce_amax = True   # False for trials (for_trials)

    @property
    def delayed(self) -> bool:
        return self.spec.recipe == "delayed"

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
                    f"{_TE_PIP}")
        from transformer_engine.common import recipe as recipes
        why = recipe_unavailable(te, recipes, self.spec.recipe)
        if why:
            return why
        build_recipe(self.spec, recipes)   # a format the recipe refuses: exit 2 before any work
        self.te, self.recipes = te, recipes
        if self.delayed:
            # TE refuses to unpickle its delayed-scaling state from a checkpoint unless told to;
            # the checkpoints resumed here are this run's own. The other recipes save nothing.
            os.environ.setdefault("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
        return None

    def convert(self, model: nn.Module) -> nn.Module:
        te = self.te
        self.recipe = build_recipe(self.spec, self.recipes, margin=self.margin(),
                                   reduce_amax=self.reduce_amax)
        linear = te.Linear if self.delayed else stateless_linear(te.Linear)
        for name in self.select(model):
            lin = model.get_submodule(name)
            new = linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                         params_dtype=lin.weight.dtype, device=lin.weight.device)
            with torch.no_grad():
                new.weight.copy_(lin.weight)
                if lin.bias is not None:
                    new.bias.copy_(lin.bias)
            replace_module(model, name, new)
            self.modules[name] = new
        # Recompute blocks with TE's checkpoint, which re-enters FP8 with the saved scales
        # (torch's would recompute outside TE's autocast, in high precision).
        model.checkpoint_fn = lambda block, *args: te.checkpoint(block, *args,
                                                                 use_reentrant=False)
        self.recorder = scale_probe(self.modules, self.spec, self.recipe)
        return model

    def _autocast(self, enabled: bool):
        autocast = getattr(self.te, "autocast", None)
        if autocast is not None:                       # newer TE; fp8_autocast is deprecated
            return autocast(enabled=enabled, recipe=self.recipe)
        return self.te.fp8_autocast(enabled=enabled, fp8_recipe=self.recipe)

    def fp8_context(self):
        return self._autocast(True)

    def raise_margin(self) -> bool:
        # Current and block scaling have no margin (each scale fits its tensor or tile as it is
        # cast): recover("margin") switches FP8 off instead, as it does for torchao.
        if not self.delayed:
            return False
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
            # next checkpoint would drop their delayed-scaling scales: they still have them.
            # Current and block scaling keep none (their fp8_meta holds stateless recipe states
            # and TE saves nothing for them), so there is nothing to keep marked.
            if self.delayed:
                for m in self.modules.values():
                    if "scaling_fwd" in getattr(m, "fp8_meta", {}):
                        m.fp8_meta["fp8_checkpoint"] = True

    def describe(self) -> str:
        if self.delayed:
            kw = recipe_kwargs(self.spec, self.margin())
            return ("FP8 Transformer Engine: DelayedScaling(" +
                    ", ".join(f"{k}={v}" for k, v in kw.items()) + ")")
        r = self.recipe
        if r is None:
            return (f"FP8 Transformer Engine: {RECIPES[self.spec.recipe][0]}"
                    f"(fp8_format={_FORMAT_NAMES[self.spec.format]})")
        fmt = r.fp8_format.name
        pow2 = "power-of-2" if r.fp8_quant_fwd_inp.power_2_scale else "float32"
        if self.spec.recipe == "current":
            return (f"FP8 Transformer Engine: Float8CurrentScaling(fp8_format={fmt}): each "
                    f"tensor scaled from its own amax at every cast, {pow2} scales "
                    "(fp8_margin / fp8_amax_* do not apply)")
        tiles = {k: _tile_name(d) for k, d in (("x", r.x_block_scaling_dim),
                                               ("w", r.w_block_scaling_dim),
                                               ("g", r.grad_block_scaling_dim))}
        return (f"FP8 Transformer Engine: Float8BlockScaling(fp8_format={fmt}): one scale per "
                f"{tiles['x']} block of inputs, {tiles['g']} of grad_output, {tiles['w']} of "
                f"weights, {pow2} scales (fp8_margin / fp8_amax_* do not apply)")


def _tile(dim: int) -> tuple:
    """A TE block_scaling_dim as a tile: 1 is 1 x 128 along the last dim, 2 is 128 x 128."""
    return (BLOCK, BLOCK) if dim == 2 else (1, BLOCK)


def _tile_name(dim: int) -> str:
    return "x".join(map(str, _tile(dim)))


def stateless_linear(linear_cls):
    """te.Linear for a recipe with no state to checkpoint (current, block): it saves no
    `_extra_state` and restores nothing (an empty one, from a checkpoint written before, is
    ignored). TE from 2.18 saves an empty tensor for these recipes
    itself (module/base.py get_extra_state, for recipes pytorch/_extra_state.py classes as
    STATELESS). TE 2.2 to 2.17 pickle {"recipe": the recipe object, "extra_fp8_variables":
    ...} instead, whose globals (Float8CurrentScaling, QParams, MMParams, ...) fp8train's
    checkpoint scan (safe_load.TE_EXTRA_STATE_GLOBALS: delayed scaling's only) refuses, and
    which nothing needs; and TE 2.2 and 2.3 unpickle whatever set_extra_state is given, an
    empty tensor included (pickle.loads of no bytes fails). So nothing is unpickled here."""
    cached = _STATELESS.get(linear_cls)
    if cached is None:
        class StatelessLinear(linear_cls):
            # No `_extra_state` key in the state dict at all: an empty tensor per layer (what TE
            # 2.18+ writes itself) has no storage, so every layer's would look like one shared
            # tensor to Accelerate's safetensors writer, which keeps one of them, and the
            # strict load of the checkpoint (resume, rollback) would then miss the others.
            def get_extra_state(self) -> torch.Tensor:
                return torch.empty(0, dtype=torch.uint8)

            def set_extra_state(self, state) -> None:
                pass   # a stateless recipe's scales come from the tensors themselves

            def _save_to_state_dict(self, destination, prefix, keep_vars):
                super()._save_to_state_dict(destination, prefix, keep_vars)
                destination.pop(prefix + "_extra_state", None)

            def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs):
                super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                              missing_keys, unexpected_keys, error_msgs)
                if prefix + "_extra_state" in missing_keys:
                    missing_keys.remove(prefix + "_extra_state")
        cached = _STATELESS[linear_cls] = StatelessLinear
    return cached


_STATELESS: dict = {}


def scale_probe(modules: dict, spec, recipe) -> ScaleProbe:
    """The per-layer scale read-out for the recipe in use (metric names as for every backend).
    delayed: the scale in TE's fp8_meta. current: TE's current-scaling scale of the tensor
    itself, fp8_max / amax, with the recipe's power-of-2 rounding and amax epsilon. block: the
    same per tile (the probe reports the median tile scale)."""
    fwd, bwd = FORMATS[spec.format]
    dtypes = {"input": fwd, "weight": fwd, "grad_output": bwd}
    if spec.recipe == "delayed":
        return ScaleProbe(modules, _te_scale, dtypes, spec.log_layers)
    # te.Linear sets its current-scaling quantizers' power-of-2 and epsilon from these QParams
    # (module/linear.py, _customize_quantizers_float8_current_scaling), and block scaling's
    # quantizers are built from them (quantization.py, Float8BlockScalingRecipeState).
    qparams = {"input": recipe.fp8_quant_fwd_inp, "weight": recipe.fp8_quant_fwd_weight,
               "grad_output": recipe.fp8_quant_bwd_grad}

    def scale_fn(module, kind: str, amax: torch.Tensor) -> torch.Tensor:
        q = qparams[kind]
        return te_scale(amax, FP8_MAX[dtypes[kind]], q.power_2_scale, q.amax_epsilon)

    tiles = None
    if spec.recipe == "block":
        tiles = {"input": _tile(recipe.x_block_scaling_dim),
                 "weight": _tile(recipe.w_block_scaling_dim),
                 "grad_output": _tile(recipe.grad_block_scaling_dim)}
    return ScaleProbe(modules, scale_fn, dtypes, spec.log_layers, tiles)


def global_state_manager():
    """TE's FP8GlobalStateManager: in transformer_engine.pytorch.quantization in current TE,
    in transformer_engine.pytorch.fp8 in older releases (a deprecated alias in current ones)."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return FP8GlobalStateManager


def _te_scale(module, kind: str, amax: torch.Tensor) -> torch.Tensor:
    """The scale TE applies to this tensor now under delayed scaling: its state, which it
    creates on the first FP8 forward (before that, TE's initial scale of 1)."""
    key, index = _META[kind]
    meta = getattr(module, "fp8_meta", {}).get(key)
    if meta is None:
        return torch.ones((), device=amax.device)
    return meta.scale[index].clone()  # TE updates it in place after this step
