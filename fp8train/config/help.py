"""`train_fp8.py --help`, made from the config schema. Standard library only (instant)."""
from __future__ import annotations

from .schema import GROUPS, describe_accepted, default_of, key_fields

HELP_WIDTH = 100
_HELP_TYPES = {"tuple": "[START,END]", "int": "INT", "float": "FLOAT", "bool": "BOOL",
               "str": "TEXT",
               "list": "LIST (a,b or [a, b])"}

USAGE = "usage: train_fp8.py --config FILE [--key=value | --key value ...]"


def help_text() -> str:
    """`--help`: how the command line works, then every key with its type, default and doc,
    in lines of at most HELP_WIDTH characters."""
    import textwrap
    out = [USAGE, ""]
    intro = (
        "Train a GPT-style model. Every key below can be set in the YAML file given with "
        "--config or on the command line, which wins; a key given twice on the command line "
        "takes the last value. Options are spelled --key=value or --key value (--seq-len = "
        "--seq_len). Values are read as YAML scalars (3e-4, null, [a, b]). Booleans are true "
        "or false; a bare --key means true and --no_key false (--no_fp8 = --use_fp8=false); a "
        "bare --resume means auto. Shipped configs: configs/*.yaml (configs/test_fp8.yaml runs "
        "on a CPU). Exit codes: 0 done, 2 bad config or input (one line), 3 stopped by a "
        "signal after a checkpoint (resumable), 1 anything else.")
    out += textwrap.wrap(intro, HELP_WIDTH)
    for group in GROUPS:
        out += ["", f"{group}:"]
        for f in key_fields():
            if f.metadata["group"] != group:
                continue
            default = default_of(f)
            shown = "null" if default is None else str(default).lower() \
                if isinstance(default, bool) else default
            kind = describe_accepted(f, types=_HELP_TYPES, choices="{{{}}}", join="|")
            head, tail = f"  --{f.name} {kind}", f"[default: {shown}]"
            out += [f"{head}  {tail}"] if len(head) + 2 + len(tail) <= HELP_WIDTH else \
                [head, f"      {tail}"]
            out += textwrap.wrap(f.metadata["doc"], HELP_WIDTH, initial_indent="      ",
                                 subsequent_indent="      ")
    return "\n".join(out)
