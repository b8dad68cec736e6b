"""The typed section of each config group: what one component receives (`section(cfg, "eval")`
for the evaluator, "checkpoint" for the checkpointer, ...), only its keys, frozen."""
from __future__ import annotations

import dataclasses
from dataclasses import fields

from .schema import GROUPS, Config, key_fields


def _section_class(group: str):
    fs = [f for f in key_fields() if f.metadata["group"] == group]
    cls = dataclasses.make_dataclass(
        f"{group.title()}Section", [(f.name, f.type) for f in fs] + [("source", str)],
        frozen=True)
    cls.__doc__ = f"The config's {group} keys (see docs/config.md), and where they came from."
    return cls


SECTIONS = {g: _section_class(g) for g in GROUPS}


def section(cfg: Config, group: str):
    """The typed, frozen section of the config that one component receives: only its keys
    (and `source`, for error messages)."""
    cls = SECTIONS[group]
    return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})
