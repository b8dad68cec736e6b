"""What a precision backend is to the training loop.

A backend is applied from outside the model (as torchtitan's model converters are): it tells
Accelerate which mixed precision to run, converts the model before `prepare()`, wraps each
forward pass in whatever context it needs, and reports its scale factors at the log interval.
The loop calls these hooks and never asks which backend it has."""
from __future__ import annotations

import contextlib
import dataclasses
from collections import OrderedDict
from typing import Callable, Optional

import torch
from torch import nn


class Precision:
    name = "fp32"                 # what config.yaml and the logs call it
    mixed_precision = "no"        # Accelerator(mixed_precision=...)
    fp8 = False
    fallback_from: Optional[str] = None  # set when FP8 was asked for and could not run
    margin_added = 0              # recovery remedies in effect (see recover)
    disabled = False
    auto = False                  # fp8 auto: its backend and recipe are chosen at start (choose)
    # What of the model torch.compile does not trace under this precision (said in the
    # compile line), or None: everything compiles.
    eager_under_compile: Optional[str] = None

    def unavailable(self, device: torch.device) -> Optional[str]:
        """Why this backend cannot run on `device`, or None when it can."""
        return None

    def accelerator_kwargs(self) -> dict:
        return {"mixed_precision": self.mixed_precision}

    def set_tokens(self, tokens: int, info: Optional[Callable[[str], None]] = None) -> None:
        """The rows one forward pass feeds each Linear (micro-batch x seq_len), known once the
        batch plan is, and where to report; called by the trainer before `convert`. FP8's
        fp8_layers: auto times the layer shapes at this size; without it (the micro-batch
        probe's throw-away models) nothing is timed."""

    def convert(self, model: nn.Module) -> nn.Module:
        """Change the model in place before Accelerate prepares it; returns it."""
        return model

    def fresh(self, device: torch.device) -> "Precision":
        """A new precision of this kind and with these settings, as `build_precision` made
        this one for `device`: one per throw-away trial (the micro-batch probe's)."""
        return type(self)()

    def for_trials(self) -> "Precision":
        """This backend set up for throw-away trials that each rank runs on its own (the
        micro-batch probe, fp8_layers auto's timing): no collectives across ranks, since the
        ranks' trials differ in number and size (a trial that runs out of memory stops part-way).
        Returns self."""
        return self

    def reset_trials(self) -> None:
        """Forget what throw-away trials left in process-wide state (Transformer Engine registers
        every FP8 module it runs in global amax buffers that its scale update walks at every
        step). Called after each trial, before the real model is converted."""

    def after_prepare(self, accelerator) -> None:
        """Called once the model and optimizer went through accelerator.prepare()."""

    def forward_context(self, training: bool):
        """Entered around every forward pass (training=False: evaluation)."""
        return contextlib.nullcontext()

    def sampling_context(self):
        """Entered around text generation: sample lengths are arbitrary, so FP8 GEMMs (which
        need dimensions divisible by 16) are never used there."""
        return self.forward_context(training=False)

    def after_backward(self) -> None:
        """Called after each micro-batch's backward (delayed-scaling updates live here)."""

    def after_optimizer_step(self) -> None:
        """Called after each optimizer step, once the weights changed (what is derived from
        the new weights for the next step's forward lives here)."""

    def watch(self, on: bool) -> None:
        """Record scale statistics during the next steps (on) or stop recording (off). Only the
        steps that are logged are watched, so other steps pay nothing."""

    def stats(self) -> "OrderedDict[str, torch.Tensor]":
        """Metric name -> 0-d device tensor for the watched step; read with one host sync."""
        return OrderedDict()

    def recover(self, how: str, why: Optional[str] = None) -> str | None:
        """The remedy after a rollback for non-finite steps, or for FP8's loss gap (`how`:
        fp8_recovery; `why`: the reason FP8 is switched off, when it is, instead of the
        rollback's); returns what changed, or None when there is nothing to change."""
        return None

    def status(self) -> dict:
        """The FP8 remedies in effect, for the recovery rows: {"fp8_margin", "fp8_on"} (0 once
        switched off); {} without FP8."""
        return {}

    def high_precision(self):
        """A context in which the converted layers compute like plain Linears (the loss-gap
        check's reference, evaluation)."""
        return contextlib.nullcontext()

    def hand_over(self, tokens: int) -> str | None:
        """fp8_until: the converted layers compute in the base precision from now on, `tokens`
        having been trained in FP8 (kept for the report); returns what changed, or None when
        FP8 is not on."""
        return None

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this precision, as JSON: the remedies in effect, FP8
        switched off and why, fp8_until's hand-over. Empty without FP8."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """On resume (and after a rollback): apply a checkpoint's `state_dict` again. Remedies
        only add up: a rollback to a checkpoint from before a remedy keeps the remedy."""

    def describe(self) -> str:
        return self.name

    def conversion(self) -> list:
        """What `convert` did, as lines for the log: which layers, and how (FP8); [] when it
        changed nothing."""
        return []

    def report(self, model: nn.Module):
        """What the end-of-run verdict needs of this precision and the finished `model`
        (unwrapped), as plain data: verdict.py's Fp8Facts (its `verdict` is the numbers)."""
        from .verdict import facts_of
        return facts_of(self, model)

    def cautions(self) -> list:
        """What the run must be told once, after `convert`: settings that make this backend
        slower than it should be, or FP8 asked for where it does nothing."""
        return []

    def derived(self) -> dict:
        """What config.yaml (and W&B) record as the precision actually used."""
        return {"precision": self.name,
                "fp8": f"off (fallback: {self.fallback_from})" if self.fallback_from else "off"}


class LayerStats:
    """Per-layer FP8 statistics recorded during a watched step, and their aggregates.

    Per layer: fwd_scale_input, fwd_scale_weight, bwd_scale_grad_output, amax_input,
    amax_weight, amax_grad_output, and saturated_/underflow_ fractions for the three tensors.
    Aggregates: fp8/fwd_scale and fp8/bwd_scale are geometric means over layers (scales span
    orders of magnitude), fp8/amax the largest input amax, fp8/saturated and fp8/underflow the
    mean fractions over every sampled tensor."""

    def __init__(self, per_layer: bool = True):
        self.per_layer = per_layer
        self.rows: "OrderedDict[str, dict]" = OrderedDict()

    def record(self, layer: str, **values: torch.Tensor) -> None:
        self.rows.setdefault(layer, {}).update(
            {k: v.detach().float().reshape(()) for k, v in values.items()})

    def clear(self) -> None:
        self.rows.clear()

    def collect(self) -> "OrderedDict[str, torch.Tensor]":
        out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        if not self.rows:
            return out
        fwd, bwd, amax, sat, under = [], [], [], [], []
        for layer, vals in self.rows.items():
            if self.per_layer:
                for k, v in vals.items():
                    out[f"fp8/{layer}/{k}"] = v
            fwd += [vals[k] for k in ("fwd_scale_input", "fwd_scale_weight") if k in vals]
            bwd += [vals[k] for k in ("bwd_scale_grad_output",) if k in vals]
            amax += [vals[k] for k in ("amax_input",) if k in vals]
            sat += [v for k, v in vals.items() if k.startswith("saturated_")]
            under += [v for k, v in vals.items() if k.startswith("underflow_")]
        agg = OrderedDict()
        if fwd:
            agg["fp8/fwd_scale"] = _geomean(fwd)
        if bwd:
            agg["fp8/bwd_scale"] = _geomean(bwd)
        if amax:
            agg["fp8/amax"] = torch.stack(amax).max()
        if sat:
            agg["fp8/saturated"] = torch.stack(sat).mean()
        if under:
            agg["fp8/underflow"] = torch.stack(under).mean()
        agg.update(out)
        return agg


# A watched step's statistics: one row per layer, FWD_STATS + BWD_STATS, in the order LayerStats
# reports them.
FWD_STATS = ("fwd_scale_input", "fwd_scale_weight", "amax_input", "amax_weight",
             "saturated_input", "underflow_input", "saturated_weight", "underflow_weight")
BWD_STATS = ("bwd_scale_grad_output", "amax_grad_output", "saturated_grad_output",
             "underflow_grad_output")
N_FWD = len(FWD_STATS)


def stats_row(device) -> torch.Tensor:
    """A layer's row of watched-step statistics (zeros: nothing recorded)."""
    return torch.zeros(N_FWD + len(BWD_STATS), device=device)


class WatchedStats(LayerStats):
    """The statistics of a watched step, read from `layers`: one row per layer (stats_row, the
    layer's `fp8_stats`, read through the layer as moving the model replaces it), each a tensor
    of its own that its layer writes in place, forward and backward, in compiled
    graphs too. One tensor per layer, not one shared buffer: DDP's compiled graphs are split at
    bucket boundaries, and a tensor written by several of them would be saved for backward by
    one and changed by the next (autograd's version check fails), or, functionalized per graph,
    written back stale. `ran` (a Python flag, set outside any graph when the watch starts: a
    Python store inside a checkpointed block would break the compiled graph) says the rows hold
    this step's values."""

    def __init__(self, names: list, layers: list, per_layer: bool):
        super().__init__(per_layer)
        self.names, self.layers = names, layers
        self.ran = False

    def start(self) -> None:
        """A watched step starts: the rows are zeroed and will hold its values."""
        self.clear()
        self.ran = True
        for layer in self.layers:
            layer.fp8_stats.zero_()

    def clear(self) -> None:
        super().clear()
        self.ran = False

    def collect(self) -> "OrderedDict[str, torch.Tensor]":
        if self.ran and self.layers:
            # a snapshot: the layers keep writing
            vals = torch.stack([layer.fp8_stats for layer in self.layers])
            for i, name in enumerate(self.names):
                row = self.rows.setdefault(name, {})
                row.update({k: vals[i, j] for j, k in enumerate(FWD_STATS + BWD_STATS)})
        return super().collect()


def _geomean(values: list) -> torch.Tensor:
    v = torch.stack(values).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.exp(torch.log(v).mean())


class Fp8Backend(Precision):
    """What the FP8 backends share: the base precision for everything that is not converted,
    the layer selection, the hardware gate, and a recorder of scale statistics (anything with
    watch(on) and a LayerStats `stats`)."""
    fp8 = True
    label = "fp8"

    def __init__(self, spec, base: Precision):
        """`spec`: its settings (spec.Fp8Spec); `base`: the precision of all it leaves alone."""
        self.spec, self.base = spec, base
        self.mixed_precision = base.mixed_precision
        self.name = f"fp8-{self.label} ({base.name} elsewhere)"
        self.emulate = False      # CPU: FP8 GEMMs emulated in fp32
        self.selection = None
        self.recorder = None
        self.disabled = False     # FP8 switched off by a recovery: high precision from then on
        self.handed_over = False  # ... by fp8_until
        self.handed_over_tokens: Optional[int] = None   # the tokens trained in FP8 by then
        self.off_reason = "after non-finite steps (fp8_recovery)"   # why, once disabled
        self.fp8_choice: Optional[dict] = None   # fp8 auto's choice and table (choose.py)
        self.margin_added = 0
        self.tokens: Optional[int] = None   # set_tokens; None: fp8_layers auto times nothing
        self.info: Callable[[str], None] = lambda msg: None
        self.timer = None         # fp8_layers auto: shape -> (base s, fp8 s); None: CUDA events
        self.layer_policy = spec.layers   # what the layer policy did, for config.yaml
        # On resume, the layers the checkpoint's run converted ("all" for runs from before the
        # policy existed): its weights only load into the same set, whatever timing says now.
        self.resumed_layers: "list | str | None" = None

    @property
    def auto(self) -> bool:
        """fp8 auto: this backend and recipe are provisional, still to be chosen (choose.py)."""
        return self.spec.decided == "provisional"

    def model_sample(self, make_model: Callable[[], nn.Module], train_tokens, micro: int,
                     seq_len: int, device: torch.device) -> Callable:
        """fp8 auto's numerics input, `sample(shapes)`: the Linears' activations of a fresh
        model (`make_model()`) on the first sequences, in the base precision (numerics.py)."""
        from .numerics import sample_model
        return lambda shapes: sample_model(make_model, train_tokens, micro, seq_len, self,
                                           shapes, device)

    def set_tokens(self, tokens: int, info: Optional[Callable[[str], None]] = None) -> None:
        self.tokens = tokens
        if info is not None:
            self.info = info

    def resume_layers(self, saved: dict) -> None:
        """Take fp8_layers auto's decision from the `derived` values of the checkpoint being
        resumed, instead of timing again."""
        if self.spec.layers == "auto" and not str(saved.get("fp8", "off")).startswith("off"):
            self.resumed_layers = saved.get("fp8_layer_names", "all")

    def select(self, model: nn.Module):
        from .layers import select_linears
        from .policy import layer_decision
        mode = self.spec.layers
        if self.resumed_layers is not None:
            sel = select_linears(model, 0, self.spec.exclude)
            if self.resumed_layers != "all":
                for name in [n for n in sel.chosen if n not in self.resumed_layers]:
                    sel.chosen.remove(name)
                    sel.skipped[name] = "kept in high precision, as in the resumed checkpoint"
            self.selection, self.layer_policy = sel, "auto (the resumed checkpoint's decision)"
            return sel.chosen
        keep = layer_decision(self, model) if mode == "auto" else {}
        min_size = self.spec.min_layer_size if mode == "min_size" else 0
        self.selection = select_linears(model, min_size, self.spec.exclude, keep)
        return self.selection.chosen

    def conversion(self) -> list:
        return [self.selection.describe(), self.describe()] if self.selection is not None \
            else [self.describe()]

    def fresh(self, device: torch.device) -> "Fp8Backend":
        backend = type(self)(self.spec, self.base.fresh(device))
        backend.unavailable(device)   # as build_precision asks it (a CPU: emulated)
        return backend

    def timing_copy(self) -> "Fp8Backend":
        """A fresh backend of this kind for timing one layer (fp8_layers auto): it converts
        every layer it is given and logs no per-layer scales. `unavailable` must be called on it
        before `convert`, as for any backend."""
        spec = dataclasses.replace(self.spec, layers="all", min_layer_size=0, exclude=(),
                                   log_layers=False)
        return type(self)(spec, self.base).for_trials()

    def device_gate(self, device: torch.device, cpu_emulation: bool) -> Optional[str]:
        if device.type == "cuda":
            return cuda_fp8_gate(device)
        if device.type == "cpu" and cpu_emulation:
            self.emulate = True
            return None
        return f"{self.label} FP8 needs a CUDA GPU" if device.type == "cpu" else \
            f"no FP8 on {device.type}"

    def forward_context(self, training: bool):
        if self.disabled or not (training or self.spec.eval):
            return self.high_precision()
        return self.fp8_context()

    def fp8_context(self):
        """Entered around a forward pass in FP8."""
        return contextlib.nullcontext()

    def raise_margin(self) -> bool:
        """fp8_margin + 1 from the next scale update on; False if this backend has no margin."""
        return False

    def margin(self) -> int:
        return self.spec.margin + self.margin_added

    def recover(self, how: str, why: Optional[str] = None) -> str | None:
        if self.disabled:
            return None
        if how == "margin" and self.raise_margin():
            self.margin_added += 1
            return f"fp8_margin {self.margin() - 1} -> {self.margin()}"
        self.disabled = True
        if why:
            self.off_reason = why
        why = "" if how == "bf16" else f" ({self.label} has no margin to raise)"
        return f"FP8 switched off{why}: the converted layers compute in {self.base.name} from here"

    def hand_over(self, tokens: int) -> str | None:
        if self.disabled:
            return None
        self.disabled = self.handed_over = True   # the cool-down in the base precision
        self.handed_over_tokens = tokens
        return f"FP8 handed over to {self.base.name}: the converted layers compute in " \
            f"{self.base.name} from here"

    def status(self) -> dict:
        return {"fp8_margin": self.margin(), "fp8_on": int(not self.disabled)}

    def state_dict(self) -> dict:
        return {"margin_added": self.margin_added, "off": self.disabled,
                "off_reason": self.off_reason, "handed_over": self.handed_over,
                "handed_over_tokens": self.handed_over_tokens}

    def load_state_dict(self, state: dict) -> None:
        for _ in range(int(state.get("margin_added", 0)) - self.margin_added):
            if self.raise_margin():
                self.margin_added += 1
        self.disabled = self.disabled or bool(state.get("off", False))
        self.handed_over = self.handed_over or bool(state.get("handed_over", False))
        if not state.get("handed_over", False):
            # A checkpoint from before the hand-over (a rollback past it): FP8 stays off, and
            # the tokens it was handed over at are not this run's any more.
            self.handed_over_tokens = None
        elif self.handed_over_tokens is None:
            self.handed_over_tokens = state.get("handed_over_tokens")
        if state.get("off") and state.get("off_reason"):
            self.off_reason = state["off_reason"]

    def high_precision(self):
        """A context in which the converted layers compute like plain Linears (evaluation)."""
        raise NotImplementedError

    def sampling_context(self):
        return self.high_precision()

    def watch(self, on: bool) -> None:
        # Switched off by a recovery: its layers compute in high precision, nothing to record.
        self.recorder.watch(on and not self.disabled)

    def stats(self) -> "OrderedDict[str, torch.Tensor]":
        if self.disabled:   # nothing recorded since (an earlier watched step's rows are stale)
            return OrderedDict()
        return self.recorder.stats.collect()

    def cautions(self) -> list:
        if self.selection is not None and not self.selection.chosen:
            return [f"FP8 ({self.label}) converted none of the model's "
                    f"{self.selection.total} Linear layers (the line above says why): the run "
                    f"trains in {self.base.name} throughout and logs no fp8/ metrics"]
        return []

    def derived(self) -> dict:
        emulated = " (emulated on CPU)" if self.emulate else ""
        off = f" (until fp8_until, then {self.base.name})" if self.handed_over else \
            f" (switched off {self.off_reason})" if self.disabled else ""
        return {"precision": self.base.name, "fp8": self.label + emulated + off,
                "fp8_backend": self.label, "fp8_recipe": self.spec.recipe,
                **({"fp8_choice": self.fp8_choice} if self.fp8_choice else {}),
                "fp8_layers": len(self.selection.chosen), "fp8_layer_policy": self.layer_policy,
                "fp8_layer_names": list(self.selection.chosen)}


def cuda_fp8_gate(device: torch.device) -> Optional[str]:
    """FP8 tensor cores exist from compute capability 8.9 (Ada, Hopper) on."""
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return (f"FP8 needs compute capability 8.9 or newer (H100/H200, L40, RTX 4090); "
                f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}")
    return None
