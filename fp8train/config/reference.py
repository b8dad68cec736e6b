"""The config reference, docs/config.md, generated from the config schema
(fp8train/config/schema.py):

    python -m fp8train.config.reference > docs/config.md

One table per group, in the order `--help` shows them: the key, its type or allowed values,
its default, whether a resumed run may change it, and its doc. A test compares docs/config.md
with this output, so the page cannot drift from the schema. Standard library and the schema
only (no torch), like `--help`.
"""
from __future__ import annotations

from .requires import rules_of
from .schema import GROUPS, describe_accepted, default_of, key_fields

COMMAND = "python -m fp8train.config.reference > docs/config.md"

INTRO = """\
# Config keys

Every key of a run config, generated from the schema in `fp8train/config/schema.py` by
`{command}`; a test fails when this page and the schema
differ. `python train_fp8.py --help` prints the same keys with their docs and defaults.

Keys are flat (no nesting). Each one can be set in the YAML file given with `--config` or on
the command line as `--key=value` or `--key value`, and the command line wins (see
[usage.md](usage.md#the-command-line)). A config written by a run (`<output_dir>/config.yaml`)
can be fed back with `--config`; its `derived:` section is ignored on load. Unknown keys,
values outside the bounds below, a key given twice in a file and the other slips listed in
[usage.md](usage.md#the-command-line) stop the run with exit 2 and one line naming the key and
where its value came from. Files are read as YAML 1.2: `true`/`false` are the only booleans
(`yes`, `on` are text), `3e-3` is a number, an integer may be written `1e6` or `3.0`.

**Applies only with.** A key that does something only with another key's value says so at the
end of its meaning (every `fp8_*` key with `use_fp8: true`, every `muon_*` key with `optimizer:
muon`, ...). Given a value of its own while that other key says otherwise, it would do nothing,
and the run stops with exit 2 and one line naming both; unless the other key was set later (a
config's FP8 keys under `--no_fp8` on the command line is a switch, not a mistake). A run's own
`config.yaml` fed back counts as defaults here. The table is `fp8train/config/requires.py`.

**Change on resume.** "yes": a resumed run may take a new value (how the run is carried out,
not what it trains). "no": the key changes what is trained, and resuming with a new value is
refused with exit 2 and one line listing every change, unless `--allow_config_change` is given
(see [reliability.md](reliability.md#resuming-with-a-changed-config)). The batch keys may
change as long as the effective batch (micro × accumulation × processes) stays the same.

Groups: {groups}.
"""

OUTRO = """\
`data_dir` defaults to `$FP8TRAIN_DATA_DIR`, else `./data`; `tinyshakespeare` is looked up
there as `tinyshakespeare/` (prepared) or `tinyshakespeare.txt`, `fineweb-edu` and
`openwebtext` as prepared directories ([data.md](data.md)). Set `FP8TRAIN_OFFLINE=1` (or
`HF_HUB_OFFLINE=1`) to never try a download.
"""

_TYPES = {"int": "integer", "float": "number", "bool": "true \\| false", "str": "string",
          "list": "list of strings", "tuple": "`[START, END]` (steps, 1 ≤ START ≤ END)"}


def _code(text: str) -> str:
    return f"`{text}`"


def _yaml_value(value) -> str:
    """A default as it is written in a YAML config."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    return str(value)


def allowed(f) -> str:
    """The key's type or allowed values, with the bounds validation checks."""
    return describe_accepted(f, types=_TYPES, choices="{}", choice=_code, join=" \\| ", ge="≥",
                     le="≤", bounds_sep=", ", optional=" \\| `null`")


def _cell(text: str) -> str:
    """A doc string as a table cell: `|` would end the cell, `<name>` would read as HTML."""
    return text.replace("|", "\\|").replace("<", "\\<").replace("\n", " ")


def row(f) -> str:
    meta = f.metadata
    resume = {"free": "yes", "locked": "no"}[meta["resume"]]
    needs = " and ".join(r.said for r in rules_of(f.name))
    needs = f"; applies only with {needs}" if needs else ""
    cells = [_code(f.name), allowed(f), _code(_yaml_value(default_of(f))), resume,
             _cell(meta["doc"] + needs)]
    return "| " + " | ".join(cells) + " |"


def render() -> str:
    fields = key_fields()
    groups = [g for g in GROUPS if any(f.metadata["group"] == g for f in fields)]
    lines = [INTRO.format(command=COMMAND,
                          groups=", ".join(f"[{g}](#{g})" for g in groups))]
    for group in groups:
        lines.append(f"## {group}\n")
        lines.append("| key | type or values | default | change on resume | meaning |")
        lines.append("| --- | --- | --- | --- | --- |")
        lines.extend(row(f) for f in fields if f.metadata["group"] == group)
        lines.append("")
    lines.append(OUTRO)
    return "\n".join(lines)


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
