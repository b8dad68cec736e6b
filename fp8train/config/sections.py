"""The typed section of each config group: what one component receives (`section(cfg, "eval")`
for the evaluator, "checkpoint" for the checkpointer, ...), only its keys, frozen."""
from __future__ import annotations

import dataclasses
from dataclasses import fields

from .schema import GROUPS, Config, key_fields, origin_of


def _where(self, *keys: str) -> str:
    """Where the values of `keys` came from, for an error about them (Config.where)."""
    return origin_of(self.origins, self.source, keys)


def _section_class(group: str):
    fs = [f for f in key_fields() if f.metadata["group"] == group]
    cls = dataclasses.make_dataclass(
        f"{group.title()}Section", [(f.name, f.type) for f in fs] +
        [("source", str), ("origins", dict)], frozen=True, namespace={"where": _where})
    cls.__doc__ = f"The config's {group} keys (see docs/config.md), and where they came from."
    return cls


SECTIONS = {g: _section_class(g) for g in GROUPS}


def section(cfg: Config, group: str):
    """The typed, frozen section of the config that one component receives: only its keys
    (and `source` and their `origins`, with `where(*keys)`, for error messages)."""
    cls = SECTIONS[group]
    keys = [f.name for f in fields(cls) if f.name not in ("source", "origins")]
    return cls(**{k: getattr(cfg, k) for k in keys}, source=cfg.source,
               origins={k: v for k, v in cfg.origins.items() if k in keys})
