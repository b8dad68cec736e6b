"""torch.compile as a run applies it (`compile: true`): block by block, or the whole model.

Per block (`compile_scope: blocks`, what `auto` takes): each transformer block is compiled in
place (`nn.Module.compile`, so parameter names, checkpoints and FP8 layer names stay as they
are), and all of them share one graph: dynamo guards a block on its type, its Python flags and
its tensors' shapes, not on which block it is, so the first block's compile serves every other
(a 16-block model is traced once, not 16 times: the first step's compile time falls with it).
The final norm, the output layer and the loss are a region of their own (`GPT.output_loss`), so
the fp32 logits stay inside one fused graph and never reach memory. The embedding runs eagerly
(a lookup and an add). torchtitan and Accelerate's `compile_regions` compile the same way.

The whole model (`compile_scope: model`) is one graph: the compiler sees across blocks, and
CUDA graphs (`compile_mode: reduce-overhead`, `max-autotune`) capture the whole forward. `auto`
takes it under those two modes: the CUDA graphs of separately compiled blocks overwrite each
other's outputs (pytorch#152887, open in torch 2.13).

Order: the run compiles after Accelerate's `prepare`, so under FSDP2 each block is compiled after
`fully_shard` wrapped it; dynamo leaves FSDP2's hooks (the all-gather before a block, the
reduce-scatter after) to run eagerly between the compiled blocks (torch's `skip_fsdp_hooks`,
on by default). Under DDP the blocks are compiled inside the DDP wrapper: each block's backward
produces its gradients and DDP's hooks bucket them as in eager mode. Activation checkpointing
recomputes a compiled block from outside it (model.py's `checkpoint_fn`), which gives eager's
gradients (tested) and keeps Transformer Engine's own checkpoint function usable.

Every variant a block is traced in (training, evaluation, a watched FP8 step, FP8 off) is one
more graph of the same code; torch falls back to eager, with one log line, past its recompile
limit (8 in torch 2.13), so the variants of a run are kept below it and a test counts them.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

SCOPES = ("auto", "blocks", "model")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def scope_of(model_cfg) -> str:
    """What the run compiles: "blocks", "model", or "" (compile off). `model_cfg`: the config's
    model section (or the whole config). (`blocks` with a CUDA-graph mode is refused when the
    config is read: config/validate.py.)"""
    if not model_cfg.compile:
        return ""
    if model_cfg.compile_scope != "auto":
        return model_cfg.compile_scope
    return "model" if model_cfg.compile_mode in CUDA_GRAPH_MODES else "blocks"


def _mode(model_cfg):
    mode = model_cfg.compile_mode
    return None if mode == "default" else mode


def compile_module(module: nn.Module, model_cfg) -> nn.Module:
    """`module` compiled whole in compile_mode when `compile` is on (a single layer that
    fp8_layers auto times), else itself."""
    if not model_cfg.compile:
        return module
    import torch
    return torch.compile(module, mode=_mode(model_cfg))


def inner_model(model: nn.Module) -> nn.Module:
    """The model inside its distribution wrappers (DDP's `module`); FSDP2 shards in place."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def compile_model(model: nn.Module, model_cfg,
                  eager_parts: Optional[str] = None) -> "tuple[nn.Module, str]":
    """(what the run calls, one line for the log saying what was compiled). `model`: as
    Accelerate prepared it (wrapped or not); per block, it is compiled in place and is itself
    what the run calls; whole, the compiled wrapper is. `eager_parts`: what the precision
    keeps out of the graphs (Transformer Engine's layers), said in the line."""
    scope = scope_of(model_cfg)
    if not scope:
        return model, "compile: off (eager)"
    model, how = _compile(model, model_cfg, scope)
    return model, how + (f"; {eager_parts}" if eager_parts else "")


def _compile(model: nn.Module, model_cfg, scope: str) -> "tuple[nn.Module, str]":
    import torch
    mode = _mode(model_cfg)
    mode_text = f"mode {model_cfg.compile_mode}"
    inner = inner_model(model)
    blocks = getattr(inner, "blocks", None)
    if scope == "blocks" and isinstance(blocks, nn.ModuleList) and len(blocks):
        # A model may compile its blocks its own way (an hf: model: inside its checkpointing).
        own = getattr(inner, "compile_block", None)
        for block in blocks:
            if own is not None:
                own(block, mode)
            else:
                block.compile(mode=mode)
        inner.output_loss = torch.compile(inner.output_loss, mode=mode)
        kinds = sorted({_class_name(b) for b in blocks})
        return model, (f"compile: per block ({len(blocks)} {'/'.join(kinds)} blocks, one graph "
                       f"shared by all; the output layer and loss a region of their own), "
                       f"{mode_text}")
    why = "" if model_cfg.compile_scope == "model" else \
        f" (compile_scope auto: {model_cfg.compile_mode}'s CUDA graphs need one graph)" \
        if scope == "model" else " (no block list to compile one by one)"
    return torch.compile(model, mode=mode), f"compile: the whole model{why}, {mode_text}"


def _class_name(module: nn.Module) -> str:
    """The module's own class, not the subclass a wrapper made of it (FSDP2's FSDPBlock)."""
    return next(c for c in type(module).__mro__
                if not c.__module__.startswith("torch.")).__name__


def eager():
    """A context in which every compiled region runs eagerly (torch.compiler.set_stance): text
    generation and HellaSwag feed lengths that would each compile a graph of their own."""
    import torch
    return torch.compiler.set_stance("force_eager")
