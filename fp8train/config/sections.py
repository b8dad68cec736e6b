"""The typed section of each config group: what one component receives (`section(cfg, "eval")`
for the evaluator, "checkpoint" for the checkpointer, ...), only its keys, frozen, by their
short names inside the section: the flat key less its group's prefix (`fp8_recipe` is
`section(cfg, "fp8").recipe`), or the name in SHORT_NAMES (`batch_size` is
`section(cfg, "batch").micro`). The YAML and the command line keep the flat keys, and so do
error messages: `where(*keys)` takes the flat keys."""
from __future__ import annotations

import dataclasses

from .schema import GROUPS, Config, key_fields, origin_of

# The short names that are not the flat key less "<group>_".
SHORT_NAMES = {
    "use_fp8": "enabled", "use_wandb": "enabled",
    "batch_size": "micro", "gradient_accumulation_steps": "accumulation",
    "target_effective_batch_size": "target", "auto_batch_size": "auto",
    "max_batch_size": "max_micro", "batch_cache_dir": "cache_dir",
    "batch_timing_budget_s": "timing_budget_s", "batch_speed_tolerance": "speed_tolerance",
    "keep_checkpoints": "keep", "checkpoint_async": "in_background",
    "model": "preset", "optimizer": "name", "precision": "name",
}


def short_name(key: str, group: str) -> str:
    """`key`'s name in its section (`group`)."""
    if key in SHORT_NAMES:
        return SHORT_NAMES[key]
    return key[len(group) + 1:] if key.startswith(group + "_") else key


def _where(self, *keys: str) -> str:
    """Where the values of `keys` (flat keys) came from, for an error about them
    (Config.where)."""
    return origin_of(self.origins, self.source, keys)


def _section_class(group: str):
    fs = [f for f in key_fields() if f.metadata["group"] == group]
    cls = dataclasses.make_dataclass(
        f"{group.title()}Section", [(short_name(f.name, group), f.type) for f in fs] +
        [("source", str), ("origins", dict)], frozen=True, namespace={"where": _where})
    cls.__doc__ = f"The config's {group} keys (see docs/config.md), and where they came from."
    cls.keys = {short_name(f.name, group): f.name for f in fs}   # short name -> flat key
    return cls


SECTIONS = {g: _section_class(g) for g in GROUPS}


def section(cfg: Config, group: str):
    """The typed, frozen section of the config that one component receives: only its keys, by
    their short names (and `source` and their `origins`, with `where(*keys)`, for error
    messages)."""
    cls = SECTIONS[group]
    return cls(**{short: getattr(cfg, key) for short, key in cls.keys.items()},
               source=cfg.source,
               origins={k: v for k, v in cfg.origins.items() if k in cls.keys.values()})
