"""Values as they are read, each checked against its key: one value (`coerce`: type, bounds,
canonical form), a YAML mapping's keys and values (`apply_mapping`), and the error for a key that
does not exist, with its did-you-mean (`unknown_key`)."""
from __future__ import annotations

import math
import re
from typing import Any, Optional

from ..errors import BadInput, did_you_mean
from .schema import DERIVED_SECTION, KEYS, base_type, describe_accepted, is_optional


def coerce(f, value: Any, source: str) -> Any:
    """Check one value against its key's type and bounds; return it in canonical form."""
    name, base = f.name, base_type(f)

    def bad(why=None):
        got = repr(value) if not isinstance(value, str) else f"'{value}'"
        raise BadInput(f"{source}: key '{name}' must be {describe_accepted(f)}, got {got}"
                          + (f" ({why})" if why else ""))
    m = f.metadata

    if value is None:
        if is_optional(f):
            return None
        bad()
    if base == "bool":
        if not isinstance(value, bool):
            bad()
    elif base == "int":
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)      # 1e6, 3.0: integral, so the integer that was meant
        if isinstance(value, bool) or not isinstance(value, int):
            bad("not a whole number" if isinstance(value, float) else None)
    elif base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            bad()
        value = float(value) + 0.0      # + 0.0: -0.0 becomes 0.0
        if not math.isfinite(value):
            bad()
    elif base == "str":
        if isinstance(value, (bool, int, float)):
            bad("YAML read a number or true/false: quote it to mean text")
        if not isinstance(value, str) or not value:
            bad()
        if value != value.strip():
            bad("leading or trailing whitespace")
    elif base == "tuple":    # a pair of step numbers: [5, 8] in YAML, --key=5,8 or [5,8]
        if isinstance(value, str):
            value = [v.strip() for v in value.strip("[]").split(",")]
            value = [int(v) if re.fullmatch(r"\d+", v) else v for v in value]
        if not isinstance(value, list) or len(value) != 2 or \
                not all(isinstance(v, int) and not isinstance(v, bool) for v in value) or \
                not 1 <= value[0] <= value[1]:
            bad()
        value = list(value)
    elif base == "list":
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or \
                not all(isinstance(v, str) and v and v == v.strip() for v in value):
            bad("each item a non-empty string; quote numbers and true/false")
    if m.get("choices") and value not in m["choices"]:
        close = did_you_mean(value, m["choices"])
        bad(f"did you mean '{close}'?" if close else None)
    if base in ("int", "float"):
        if m.get("gt") is not None and not value > m["gt"]:
            bad()
        if m.get("min") is not None and value < m["min"]:
            bad()
        if m.get("max") is not None and value > m["max"]:
            bad()
    return value


def _suggest(key: str) -> Optional[str]:
    spelled = key.strip().lower().replace("-", "_")
    if spelled in KEYS:
        return spelled
    return did_you_mean(spelled, KEYS)


def unknown_key(key: str, source: str, prefix: str = "") -> BadInput:
    """The error for a key (or, with `prefix` "--", a command-line option) that is not one."""
    close = _suggest(key)
    hint = f" (did you mean '{prefix}{close}'?)" if close else ""
    what = "option" if prefix else "key"
    return BadInput(f"unknown {what} '{prefix}{key}' in {source}{hint}")


def apply_mapping(values: dict, data: dict, source: str,
                  origins: Optional[dict] = None) -> None:
    """Check the keys and values of a YAML mapping into `values`; `origins` (when given)
    records `source` as where each key came from."""
    for key, value in data.items():
        if key == DERIVED_SECTION:
            continue
        if not isinstance(key, str) or key not in KEYS:
            raise unknown_key(str(key), source)
        if isinstance(value, dict):
            raise BadInput(f"{source}: key '{key}' must be {describe_accepted(KEYS[key])}, got a "
                              f"mapping (keys are flat: no nesting)")
        values[key] = coerce(KEYS[key], value, source)
        if origins is not None:
            origins[key] = source
