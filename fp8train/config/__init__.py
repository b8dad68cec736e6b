"""The run config: its keys, reading it from YAML and the command line, its checks, its reference
page. Nothing is imported here; every module imports only the standard library, PyYAML and
fp8train's errors.py, so that `--help` and every config error come back before
torch loads.

- schema.py: every key (type, default, bounds, one-line doc, group, whether a resumed run may
  change it: RESUME_FREE), the frozen `Config`, the typed section each component receives.
- help.py: `--help`'s text, made from the schema.
- load.py: `load_config(argv)`: defaults, then the YAML file, then the command line, then the
  cross-key checks; also the names other modules read from the config package.
- yaml_files.py: YAML read strictly (the 1.2 core schema, unique keys) with one-line errors
  (`read_yaml`), the resolved config written back the same, secrets redacted (`dump_yaml`),
  and a run's saved config read as this version means it (`upgrade_saved`).
- command_line.py: `--config FILE` and `--key=value` overrides, the friendly spellings, the
  command line's slips.
- values.py: each value checked against its key (`coerce`, `apply_mapping`), unknown keys with
  their did-you-mean.
- requires.py: the table of keys that apply only with others (every `fp8_*` key with
  `use_fp8: true`, ...), walked by validate.py; where each key was set (`origin_layer`).
- validate.py: the checks that involve more than one key (values only: the paths a config names
  are checked by fp8train/train/preflight.py).
- reference.py: docs/config.md, generated from the schema.
"""
