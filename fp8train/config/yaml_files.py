"""Config files in YAML: read strictly (`read_yaml`), with one-line errors for every way a file can
be wrong, and the resolved config written back (`dump_yaml`) so that it reads back the same.

PyYAML follows YAML 1.1, where `yes`, `no`, `on`, `off` are booleans, `010` is 8, `1:30` is 90,
`2024-01-01` is a date and `3e-3` is a string. Config files (and command-line values, read as
YAML scalars) use the YAML 1.2 core schema instead: true/false, null, decimal (or 0x/0o)
integers, and floats with or without a dot; everything else is a string.
"""
from __future__ import annotations

import os
import re
from typing import Any, Optional

import yaml

from ..errors import BadInput, one_line
from ..errors import redact
from .schema import DERIVED_SECTION, FP8_RECIPES, GROUPS, Config, key_fields


class ConfigSlip(yaml.YAMLError):
    """Valid YAML that a config file must not contain (a key given twice, a merge key)."""

    def __init__(self, problem: str, mark):
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader with the YAML 1.2 core schema's scalars, and mappings whose keys are
    unique (PyYAML keeps the last of two, silently) and not merge keys."""

    def construct_mapping(self, node, deep=False):
        lines: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise ConfigSlip("merge keys (<<) are not supported: write each key",
                                 key_node.start_mark)
            key = self.construct_object(key_node, deep=True)
            try:
                if key in lines:
                    raise ConfigSlip(f"key '{key}' is given twice (first on line {lines[key]})",
                                     key_node.start_mark)
                lines[key] = key_node.start_mark.line + 1
            except TypeError:       # an unhashable key: PyYAML's own error says which
                break
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text.lstrip("+"))
        base = 16 if digits[:2] == "0x" else 8 if digits[:2] == "0o" else 10
        return sign * int(digits[2:] if base != 10 else digits, base)

    def construct_yaml_float(self, node):
        text = self.construct_scalar(node).lower()
        if text.endswith(("inf", "nan")):
            return float(text.replace(".", ""))
        return float(text)


StrictLoader.yaml_implicit_resolvers = {}
for _tag, _pattern, _first in (
        ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
        ("null", r"^(?:~|null|Null|NULL|)$", "~nN"),
        ("int", r"^[-+]?[0-9]+$|^0o[0-7]+$|^0x[0-9a-fA-F]+$", "-+0123456789"),
        ("float", r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$"
                  r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$", "-+.0123456789"),
        ("merge", r"^<<$", "<")):
    StrictLoader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_pattern),
                                       list(_first) + ([""] if _tag == "null" else []))
StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)


def yaml_scalar(text: str) -> Any:
    """A command-line value read as a YAML scalar, as in a config file."""
    return yaml.load(text, Loader=StrictLoader)


class StrictDumper(yaml.SafeDumper):
    """Writes what StrictLoader reads back the same: PyYAML's dumper quotes by YAML 1.1, so it
    would leave `3e-4` or `0o7` plain, and the loader above would read a number."""


def _represent_str(dumper, value: str):
    try:
        plain_is_text = isinstance(yaml_scalar(value), str)
    except yaml.YAMLError:
        plain_is_text = True     # not a plain scalar at all: the dumper quotes it by itself
    return dumper.represent_scalar("tag:yaml.org,2002:str", value,
                                   style=None if plain_is_text else "'")


StrictDumper.add_representer(str, _represent_str)


def read_yaml(path: str, what: str = "config file",
              expected: str = "a mapping of key: value") -> dict:
    """Read a YAML mapping from `path`, with one-line errors for every way a file can be
    wrong. `what` and `expected` name the kind of file in those errors."""
    if not path:
        raise BadInput(f"{what}: empty path")
    if not os.path.exists(path):
        raise BadInput(f"{what} '{path}' not found")
    if os.path.isdir(path):
        raise BadInput(f"{what} '{path}' is a directory, expected a YAML file")
    try:
        with open(path, encoding="utf-8-sig") as fh:     # -sig: a byte-order mark is fine
            text = fh.read()
    except UnicodeDecodeError as e:
        raise BadInput(f"cannot read {what} '{path}': not UTF-8 text (byte "
                          f"0x{e.object[e.start]:02x} at offset {e.start})") from None
    except OSError as e:
        raise BadInput(f"cannot read {what} '{path}': {e.strerror or e}") from None
    try:
        data = yaml.load(text, Loader=StrictLoader)
    except ConfigSlip as e:
        raise BadInput(f"{path}: line {e.problem_mark.line + 1}: {e.problem}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if isinstance(e, yaml.composer.ComposerError) and e.context:
            problem = f"{e.context}, {problem}"     # "expected a single document, but ..."
        if "'\\t'" in problem:
            problem += " (YAML indents with spaces, never tabs)"
        raise BadInput(f"{path}: not valid YAML{where}: {problem}") from None
    except ValueError as e:   # an explicit tag on a value it cannot hold: `!!int abc`
        raise BadInput(f"{path}: not valid YAML: {one_line(e, 200)}") from None
    if data is None:
        raise BadInput(f"{path}: file is empty, expected {expected}")
    if not isinstance(data, dict):
        raise BadInput(f"{path}: expected {expected}, got a {type(data).__name__}")
    return data


def dump_yaml(cfg: Config, derived: Optional[dict] = None) -> str:
    """The resolved config as YAML, grouped as in --help, with derived values at the end.
    Secret values from the environment (fp8train/errors.py) are "***" in it: they are
    replaced before YAML quotes or folds them, and once more in the text."""
    lines = [f"# resolved config (from {redact(cfg.source)}); feed it back with --config"]
    by_group = {g: [f for f in key_fields() if f.metadata["group"] == g] for g in GROUPS}
    for group, fs in by_group.items():
        lines.append(f"# {group}")
        for f in fs:
            lines.append(yaml.dump({f.name: redact(getattr(cfg, f.name))}, Dumper=StrictDumper,
                                   default_flow_style=True, width=1000).strip()
                         .removeprefix("{").removesuffix("}"))
    text = "\n".join(lines) + "\n"
    if derived:
        text += "# written by the trainer; ignored when this file is loaded\n"
        text += yaml.dump({DERIVED_SECTION: redact(derived)}, Dumper=StrictDumper,
                          sort_keys=False)
    return redact(text)


def upgrade_saved(values: dict) -> dict:
    """A run's saved config.yaml as this version reads it: files written before fp8_recipe
    named every backend's recipe recorded torchao's default ('tensorwise') under te and
    native too, where it meant their delayed scaling."""
    backend = values.get("fp8_backend")
    if backend in FP8_RECIPES and backend != "torchao" and \
            values.get("fp8_recipe") == "tensorwise":
        values = dict(values, fp8_recipe=FP8_RECIPES[backend][0])
    return values
