"""Which Linears go to FP8, and how to say so in one line."""
from __future__ import annotations

import fnmatch
import re
from collections import OrderedDict
from dataclasses import dataclass, field

from torch import nn


@dataclass
class Selection:
    chosen: list = field(default_factory=list)           # module names converted to FP8
    skipped: dict = field(default_factory=OrderedDict)   # name -> why it stays in bf16

    @property
    def total(self) -> int:
        return len(self.chosen) + len(self.skipped)

    def describe(self) -> str:
        line = f"FP8: converted {len(self.chosen)}/{self.total} linear layers"
        if self.chosen:
            line += f" ({compact_names(self.chosen)})"
        by_reason: dict = OrderedDict()
        for name, why in self.skipped.items():
            by_reason.setdefault(why, []).append(name)
        for why, names in by_reason.items():
            line += f"; kept in high precision: {compact_names(names)} ({why})"
        return line


def shape_of(mod: nn.Linear) -> tuple:
    """(in_features, out_features, bias): what the speed of a Linear's GEMMs depends on."""
    return (mod.in_features, mod.out_features, mod.bias is not None)


def select_linears(model: nn.Module, min_size: int = 0, exclude=("lm_head",),
                   keep: dict | None = None) -> Selection:
    """FP8 GEMMs need both dims divisible by 16, and pay off only when large; the embedding is a
    lookup (never a Linear) and the LM head is excluded by default (its logits feed the loss
    directly, where FP8 error costs most). `keep` (shape -> reason) is fp8_layers auto's
    decision: eligible layers of those shapes stay in high precision, for that reason."""
    sel = Selection()
    keep = keep or {}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        if excluded(name, exclude):
            sel.skipped[name] = "excluded by fp8_exclude"
        elif mod.in_features % 16 or mod.out_features % 16:
            sel.skipped[name] = "dims not divisible by 16"
        elif mod.in_features * mod.out_features < min_size:
            sel.skipped[name] = f"smaller than fp8_min_layer_size {min_size:,}"
        elif shape_of(mod) in keep:
            sel.skipped[name] = keep[shape_of(mod)]
        else:
            sel.chosen.append(name)
    return sel


def excluded(name: str, patterns) -> bool:
    """Whether an fp8_exclude pattern names the module: by its name, or an hf: model's layer
    by its transformers name (without the `hf.` of the model holding it: "lm_head" is GPT's
    `lm_head` and a transformers model's `hf.lm_head`)."""
    names = (name, name[len(HF_MODULE):]) if name.startswith(HF_MODULE) else (name,)
    return any(fnmatch.fnmatchcase(n, pat) for n in names for pat in patterns)


HF_MODULE = "hf."   # where hf_model.HFCausalLM holds the transformers model


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def compact_names(names: list) -> str:
    """['h.0.attn.qkv', 'h.1.attn.qkv', 'h.3.attn.qkv'] -> 'h.{0-1,3}.attn.qkv'."""
    groups: dict = OrderedDict()
    for n in names:
        m = re.search(r"\.(\d+)\.", n)
        if not m:
            groups.setdefault(n, [])
            continue
        key = n[:m.start()] + ".{}." + n[m.end():]
        groups.setdefault(key, []).append(int(m.group(1)))
    out = []
    for key, idx in groups.items():
        if not idx:
            out.append(key)
            continue
        ranges = _ranges(sorted(set(idx)))
        inner = ranges if "," not in ranges else "{" + ranges + "}"
        out.append(key.replace("{}", inner))
    return ", ".join(out)


def _ranges(idx: list) -> str:
    parts, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(parts)
