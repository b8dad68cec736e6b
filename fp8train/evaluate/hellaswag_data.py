"""HellaSwag's examples, read and checked without torch: the training's preflight reads them
before data, model and batch probe are built, and scripts/evaluate.py before its checkpoint.

Three sources, all readable offline:
- the original jsonl of github.com/rowanz/hellaswag (hellaswag_val.jsonl: one JSON object per
  line with ctx, endings, label as an integer);
- the hub's parquet files (Rowan/hellaswag's data/validation-00000-of-00001.parquet, or
  default/validation/0000.parquet of the hub's parquet conversion; labels as strings), a file
  or a folder holding them (a copy of the dataset's repository);
- without a path, the hub's Rowan/hellaswag through `datasets`, which reads its local cache
  (HF_HOME, HF_DATASETS_CACHE: a copy of another machine's cache works) when offline mode is set
  (FP8TRAIN_OFFLINE=1, HF_HUB_OFFLINE=1, ...) or the hub does not answer, without retrying.

Each example must be HellaSwag's: a text `ctx`, exactly four text `endings` and a `label` that
is 0, 1, 2 or 3 (an integer, or its string form as the hub writes it). Anything else is
refused, in one line naming the file and line (jsonl) or row (parquet), rather than coerced.
"""
from __future__ import annotations

import json
import os

from ..errors import BadInput, one_line

HUB_DATASET = "Rowan/hellaswag"
ENDINGS = 4
LABELS = {**{i: i for i in range(ENDINGS)}, **{str(i): i for i in range(ENDINGS)}}
JSONL = (".jsonl", ".json")

_cache: dict = {}


def load_examples(path: str | None, limit: int | None = None,
                  option: str = "hellaswag_path") -> list[dict]:
    """The examples ({"ctx", "endings", "label"}), the first `limit` of them, from the file or
    folder at `path`, else from the hub (or its local cache). BadInput (one line, naming the
    file and line, or `option`: how the command in use takes a path) when they cannot be read
    or are not HellaSwag's. Read once per process for the same file and limit."""
    key = _cache_key(path, limit)
    if key not in _cache:
        rows = _read_path(path) if path else _read_hub(option)
        out = []
        for where, row in rows:
            if limit is not None and len(out) >= limit:
                break
            out.append(example(row, where))
        if not out:
            raise BadInput(f"{path or HUB_DATASET}: no HellaSwag examples")
        _cache[key] = out
    return _cache[key]


def source_name(path: str | None) -> str:
    return path or HUB_DATASET


def _cache_key(path, limit):
    if not path:
        return (None, limit)
    try:
        st = os.stat(path)
    except OSError:
        return (path, limit, None)
    return (os.path.realpath(path), limit, st.st_size, st.st_mtime_ns)


def _read_path(path: str):
    if os.path.isdir(path):
        # The repository's data/validation-00000-of-00001.parquet, or the hub's converted
        # layout (its parquet branch): default/validation/0000.parquet.
        found = sorted(os.path.join(d, f) for d, _, files in os.walk(path) for f in files
                       if f.endswith(".parquet") and (f.startswith("validation") or
                                                      os.path.basename(d) == "validation"))
        if not found:
            raise BadInput(f"'{path}': a folder without the hub's validation parquet (Rowan/"
                           "hellaswag's data/validation-00000-of-00001.parquet, or "
                           "default/validation/0000.parquet of its parquet conversion); give "
                           "that file, the folder holding it, or hellaswag_val.jsonl")
        return (row for f in found for row in _read_parquet(f))
    if not os.path.exists(path):
        raise BadInput(f"'{path}' does not exist")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        return _read_parquet(path)
    if ext in JSONL:
        return _read_jsonl(path)
    raise BadInput(f"'{path}': HellaSwag is read from .jsonl (github.com/rowanz/hellaswag's "
                   "hellaswag_val.jsonl) or .parquet (the hub's Rowan/hellaswag), not "
                   f"'{ext or 'a file without an extension'}'")


def _read_jsonl(path: str):
    """(where, row) per non-blank line; a UTF-8 byte-order mark is skipped."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise BadInput(f"cannot read '{path}': {one_line(e)}") from None
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    if data.lstrip()[:1] == b"[":
        raise BadInput(f"{path}:1: a JSON array; HellaSwag's file is JSON lines, one example "
                       "object per line (hellaswag_val.jsonl of github.com/rowanz/hellaswag)")
    lines = data.split(b"\n")
    for i, raw in enumerate(lines, 1):
        where = f"{path}:{i}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadInput(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                           f"{e.start + 1})") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            cut = i == len(lines) and not data.endswith(b"\n")
            raise BadInput(f"{where}: not JSON ({e.msg}: column {e.colno})"
                           + ("; the file ends inside this record: truncated?" if cut else "")
                           ) from None
        yield where, row


def _read_parquet(path: str):
    """(where, row) per row of a parquet file, the hub's columns."""
    try:
        import pyarrow.parquet as pq
        table = pq.ParquetFile(path)
        names = table.schema_arrow.names
    except ImportError:
        raise BadInput(f"'{path}': reading parquet needs pyarrow (pip install pyarrow; "
                       "datasets installs it)") from None
    except Exception as e:  # not parquet, truncated, unreadable
        raise BadInput(f"{path}: not a readable parquet file ({one_line(e, 200)})") from None
    missing = [c for c in ("ctx", "endings", "label") if c not in names]
    if missing:
        raise BadInput(f"{path}: not HellaSwag's parquet: no column {', '.join(missing)} "
                       f"(columns: {', '.join(names)})")
    row_number = 0
    try:
        for batch in table.iter_batches(columns=["ctx", "endings", "label"]):
            for row in batch.to_pylist():
                yield f"{path}: row {row_number}", row
                row_number += 1
    except Exception as e:  # a file cut short after its footer was read
        raise BadInput(f"{path}: row {row_number}: cannot be read ({one_line(e, 200)})") from None


def _read_hub(option: str):
    """The hub's validation split through `datasets`: offline, or with the hub unreachable, from
    the local cache alone (the datasets library is told so before it is imported, else it
    retries each file for half a minute)."""
    from ..hub import hub_unreachable, offline_variable
    why = offline_variable()
    why = f"offline mode is set ({why})" if why else None
    if why is None:
        unreachable = hub_unreachable()
        why = f"the hub cannot be reached ({unreachable})" if unreachable else None
    if why is not None:
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        import datasets
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)
        datasets.disable_progress_bars()
        split = datasets.load_dataset(HUB_DATASET, split="validation")
    except Exception as e:
        cause = f"it is not in the local HuggingFace cache and {why}" if why else one_line(e)
        raise BadInput(f"HellaSwag from the hub ({HUB_DATASET}): {cause}; give {option} a local "
                       "copy: hellaswag_val.jsonl (github.com/rowanz/hellaswag) or the hub's "
                       "validation parquet") from None
    for i, row in enumerate(split):
        yield f"{HUB_DATASET} validation row {i}", row


def example(row, where: str) -> dict:
    """The example of one record, checked: BadInput naming `where` when it is not HellaSwag's."""
    def bad(what):
        return BadInput(f"{where}: not a HellaSwag example ({what})")
    if not isinstance(row, dict):
        raise bad(f"a JSON {type(row).__name__}, not an object with ctx, endings and label")
    missing = [k for k in ("ctx", "endings", "label") if k not in row]
    if missing:
        raise bad(f"no {', '.join(missing)}; it needs ctx, endings and label")
    ctx, endings, label = row["ctx"], row["endings"], row["label"]
    if not isinstance(ctx, str):
        raise bad(f"ctx is {_shown(ctx)}, not text")
    if not isinstance(endings, list) or len(endings) != ENDINGS or \
            not all(isinstance(t, str) for t in endings):
        raise bad(f"endings is {_shown(endings)}; it must be a list of {ENDINGS} strings")
    if not isinstance(label, (int, str)) or isinstance(label, bool) or label not in LABELS:
        test = " (the test split has no labels: use the validation split)" if label == "" else ""
        raise bad(f"label is {_shown(label)}; it must be 0, 1, 2 or 3 (or \"0\" to \"3\"){test}")
    return {"ctx": ctx, "endings": list(endings), "label": LABELS[label]}


def _shown(value) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, (bytes, bytearray)) \
        else repr(value)
    kind = {list: "a list", str: "a string", bool: "a boolean", float: "a number",
            int: "a number", dict: "an object"}.get(type(value), type(value).__name__)
    if isinstance(value, list):
        kind = f"a list of {len(value)}"
    return f"{kind} {text[:60]}{'...' if len(text) > 60 else ''}"
