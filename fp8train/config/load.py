"""The run config: defaults, then the YAML file, then command-line overrides, then the cross-key
checks (`load_config`). Also the names other modules read from the config package, wherever
they are defined: the schema's (Config, KEYS, ...), the YAML file's, the command line's.

Only the standard library and PyYAML are imported here, so `--help` and every config error
come back instantly, before torch is loaded. Nothing here reads the filesystem but the config
file itself: the dataset, batch_cache_dir and a resume path are checked by
fp8train/train/preflight.py, which the entry point runs next.
"""
from __future__ import annotations

import os
from typing import Any

from .command_line import HelpRequested, parse_cli
from .help import help_text
from .schema import DERIVED_SECTION, GROUPS, HF_PREFIX, KEYS, Config, to_dict
from .sections import section
from .validate import validate
from .values import apply_mapping, coerce
from .yaml_files import StrictLoader, dump_yaml, read_yaml

__all__ = ["Config", "DERIVED_SECTION", "GROUPS", "KEYS", "HelpRequested", "StrictLoader",
           "apply_mapping", "dump_yaml", "help_text", "load_config", "read_yaml", "section",
           "to_dict"]


def load_config(argv: list[str]) -> Config:
    """Defaults, then the YAML file, then command-line overrides; then validate."""
    config_path, overrides = parse_cli(argv)
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}      # key -> the file or the option its value came from
    source, from_run = "<defaults>", False
    if config_path is not None:
        data = read_yaml(config_path)
        apply_mapping(values, data, config_path, origins)
        source, from_run = config_path, DERIVED_SECTION in data
    for key, value, typed in overrides:
        values[key] = coerce(KEYS[key], value, f"{typed} on the command line")
        origins[key] = typed
    if values.get("output_dir") is None:
        stem = os.path.splitext(os.path.basename(config_path))[0] if config_path else "default"
        values["output_dir"] = os.path.join("runs", stem)
    if values.get("data_dir") is None:
        values["data_dir"] = os.environ.get("FP8TRAIN_DATA_DIR") or "data"
    model = str(values.get("model", ""))
    if values.get("tokenizer") == "model" and model.startswith(HF_PREFIX):
        values["tokenizer"] = model[len(HF_PREFIX):]   # config.yaml records which tokenizer
    cfg = Config(**values, source=source, origins=origins, from_run=from_run)
    validate(cfg)
    return cfg
