"""What `dataset` names, decided by the preflight check before torch loads (standard library
only, so a bad path costs a second, not a torch import): a known name, a prepared directory (by
path, or by name under data_dir), or a plain UTF-8 text file.

A file given directly is read as text and tokenized as it is, so anything that is not plain
text (JSON lines, parquet, CSV, a compressed or binary file, a token shard) would be trained on
as its syntax or its bytes: such files are refused with the command that prepares them.
"""
from __future__ import annotations

import json
import os
import shlex

from ..config.schema import KNOWN_DATASETS
from ..errors import did_you_mean
from .catalog import LOCAL_BUILDERS

META_FILE = "meta.json"
SNIFF_BYTES = 1 << 16

# Leading bytes of formats that are not text (checked whatever the file is called).
_MAGIC = ((b"FP8TOKS\0", "a token shard"), (b"\x1f\x8b", "gzip-compressed"),
          (b"\x28\xb5\x2f\xfd", "zstd-compressed"), (b"BZh", "bzip2-compressed"),
          (b"\xfd7zXZ\0", "xz-compressed"), (b"PK\x03\x04", "a zip archive"),
          (b"PAR1", "a parquet file"), (b"\x93NUMPY", "a numpy array"),
          (b"ARROW1", "an arrow file"))
_COMPRESSED = {".gz": "gunzip -k", ".zst": "zstd -d", ".bz2": "bunzip2 -k", ".xz": "unxz -k",
               ".zip": "unzip", ".tgz": "tar xzf", ".tar": "tar xf", ".lz4": "lz4 -d",
               ".7z": "7z x"}
_STRUCTURED = {".jsonl": "JSON lines", ".json": "JSON", ".parquet": "parquet",
               ".csv": "CSV", ".tsv": "TSV", ".arrow": "arrow", ".ndjson": "JSON lines"}
_BINARY = {".bin": "a binary file", ".npy": "a numpy array", ".npz": "a numpy archive",
           ".pt": "a torch file", ".pkl": "a pickle", ".safetensors": "a safetensors file"}


def resolved_dataset(dataset: str, data_dir: str) -> str:
    """`dataset` as the run will read it: unchanged when it is a known name, or a file or a
    prepared directory as given; else the file or directory of that name under data_dir when
    there is one (so a dataset prepared with `--name NAME` is found as `dataset: NAME`, even
    beside a folder of that name in the working directory)."""
    if dataset in KNOWN_DATASETS or os.path.isabs(dataset) or os.path.isfile(dataset) or \
            os.path.isfile(os.path.join(dataset, META_FILE)):
        return dataset
    under = os.path.join(data_dir, dataset)
    return under if os.path.exists(under) else dataset


def dataset_error(dataset: str, data_dir: str, tokenizer: str) -> "str | None":
    """Why `dataset` (already resolved) cannot be trained on, in one line; None when it can."""
    if dataset in KNOWN_DATASETS:
        return None
    if os.path.isdir(dataset):
        return _directory_error(dataset, data_dir)
    if os.path.isfile(dataset):
        return _file_error(dataset, data_dir, tokenizer)
    if os.path.exists(dataset):   # a device, a pipe: read to the end, it may never end
        return f"key 'dataset': '{dataset}' is not a regular file; give a .txt file or a " \
               "prepared directory"
    return _not_found(dataset, data_dir)


# --- directories ---------------------------------------------------------------------------------

def _prepared_in(directory: str) -> list:
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [n for n in names if os.path.isfile(os.path.join(directory, n, META_FILE))]


def _directory_error(path: str, data_dir: str) -> "str | None":
    if os.path.isfile(os.path.join(path, META_FILE)):
        return None
    msg = (f"key 'dataset': directory '{path}' has no meta.json: not a dataset prepared with "
           "scripts/prepare_data.py (or its preparation did not finish)")
    inside = _prepared_in(path)
    if inside:
        first = os.path.join(path, inside[0])
        return msg + f"; it holds prepared datasets: did you mean '{first}'?"
    same = os.path.join(data_dir, os.path.basename(os.path.normpath(path)))
    if os.path.isfile(os.path.join(same, META_FILE)):
        return msg + f"; did you mean '{same}'?"
    try:
        names = [n for n in os.listdir(path) if not n.startswith(".")]
    except OSError:
        names = []
    if any(_is_shard_name(os.path.splitext(n)[0]) for n in names):
        return msg   # shards without meta.json: an unfinished preparation, which resumes
    exts = {os.path.splitext(n)[1].lower() for n in names}
    for ext in (".jsonl", ".json", ".parquet", ".txt"):
        if ext in exts:
            files = os.path.join(path, "*" + ext)
            return msg + "; prepare its files first: " + _prepare_command(
                files, os.path.basename(os.path.normpath(path)), data_dir, None)
    return msg


# --- files ---------------------------------------------------------------------------------------

def _file_error(path: str, data_dir: str, tokenizer: str) -> "str | None":
    try:
        with open(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError as e:
        return f"key 'dataset': cannot read '{path}': {e.strerror or e}"
    name = os.path.basename(path)
    stem, ext = os.path.splitext(name)
    ext = ext.lower()
    kind = next((what for magic, what in _MAGIC if head.startswith(magic)), None)
    if kind == "a token shard" or (ext == ".bin" and _is_shard_name(stem)):
        return _shard_error(path)
    if ext in _COMPRESSED or (kind or "").endswith("-compressed") or kind == "a zip archive":
        return _compressed_error(path, ext, kind, data_dir, tokenizer)
    if ext in _STRUCTURED or kind in ("a parquet file", "an arrow file"):
        what = _STRUCTURED.get(ext) or kind.split()[1]   # "a parquet file": parquet
        return _structured_error(path, what, ext, head, data_dir, tokenizer)
    if kind or ext in _BINARY:
        return (f"key 'dataset': '{path}' is {kind or _BINARY[ext]}, not text: a file given "
                "as dataset is read as UTF-8 text; give a .txt file or a prepared directory")
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return (f"key 'dataset': '{path}' is UTF-16 text: a file given as dataset is read as "
                f"UTF-8; convert it (iconv -f UTF-16 -t UTF-8 {shlex.quote(path)} > "
                f"{shlex.quote(stem + '.utf8.txt')})")
    nul = head.find(b"\0")
    if nul >= 0:
        return (f"key 'dataset': '{path}' is a binary file (a NUL byte at offset {nul:,}), not "
                "text: a file given as dataset is read as UTF-8 text; give a .txt file or a "
                "prepared directory")
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.end < len(head) or len(head) < SNIFF_BYTES:  # not just a character cut in two
            return (f"key 'dataset': cannot read '{path}' as UTF-8 text: byte "
                    f"0x{head[e.start]:02x} at offset {e.start:,} is not UTF-8; convert it "
                    f"(e.g. iconv -f latin1 -t UTF-8)")
        text = head[:e.start].decode("utf-8")
    if _looks_like_json_lines(text, len(head) == SNIFF_BYTES):
        return _structured_error(path, "JSON lines", ".jsonl", head, data_dir, tokenizer,
                                 content=True)
    return None


def _is_shard_name(stem: str) -> bool:
    split, _, number = stem.partition("_")
    return split in ("train", "val") and number.isdigit()


def _shard_error(path: str) -> str:
    directory = os.path.dirname(path) or "."
    if os.path.isfile(os.path.join(directory, META_FILE)):
        return (f"key 'dataset': '{path}' is one token shard of a prepared dataset; set dataset "
                f"to its directory: --dataset {shlex.quote(directory)}")
    return (f"key 'dataset': '{path}' is a token shard, not text, and '{directory}' has no "
            "meta.json; prepare the dataset again with scripts/prepare_data.py")


def _looks_like_json_lines(text: str, truncated: bool) -> bool:
    """Each of the first complete lines (at least two) is a JSON object: structured data,
    whatever the file is called. `truncated`: the text is the start of a longer file."""
    complete = text.splitlines()[:-1] if truncated else text.splitlines()
    lines = [line for line in complete if line.strip()][:5]
    if len(lines) < 2:
        return False
    for line in lines:
        try:
            if not isinstance(json.loads(line), dict):
                return False
        except ValueError:
            return False
    return True


def _text_field(head: bytes) -> "str | None":
    """The text field of the first JSON line: 'text' when present, else its first string field."""
    try:
        first = json.loads(head.split(b"\n", 1)[0])
    except ValueError:
        return None
    if not isinstance(first, dict):
        return None
    if isinstance(first.get("text"), str):
        return "text"
    return next((k for k, v in first.items() if isinstance(v, str)), None)


def _structured_error(path: str, what: str, ext: str, head: bytes, data_dir: str,
                      tokenizer: str, content: bool = False) -> str:
    why = (f"key 'dataset': '{path}' is {what} {'content' if content else 'data'}: a file given "
           f"as dataset is read as plain text, so its {what} syntax would be trained on")
    field = _text_field(head) if what == "JSON lines" else None
    name = _safe_name(path)
    if content or ext not in LOCAL_BUILDERS:
        target = os.path.splitext(path)[0] + ".jsonl"
        how = "rename it to .jsonl" if content else \
            f"convert it to JSON lines ({{\"text\": ...}} per document, e.g. '{target}')"
        return (f"{why}; {how}, then prepare it: "
                + _prepare_command(target, name, data_dir, tokenizer, field or "text"))
    return f"{why}; prepare it first: " + _prepare_command(path, name, data_dir, tokenizer,
                                                           field or "text")


def _compressed_error(path: str, ext: str, kind: "str | None", data_dir: str,
                      tokenizer: str) -> str:
    why = (f"key 'dataset': '{path}' is {kind or 'compressed (' + ext + ')'}: a file given as "
           "dataset is read as plain UTF-8 text")
    if ext not in _COMPRESSED:
        return f"{why}; decompress it first, then give the text file (or prepare it)"
    inner = os.path.splitext(path)[0]
    inner_ext = os.path.splitext(inner)[1].lower()
    then = f"train with --dataset {shlex.quote(inner)}" if inner_ext in ("", ".txt") else \
        "prepare it: " + _prepare_command(inner, _safe_name(inner), data_dir, tokenizer)
    return f"{why}; decompress it first ({_COMPRESSED[ext]} {shlex.quote(path)}), then {then}"


def _safe_name(path: str) -> str:
    stem = os.path.basename(path)
    while os.path.splitext(stem)[1]:
        stem = os.path.splitext(stem)[0]
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in stem) or "mycorpus"


def _prepare_command(files: str, name: str, data_dir: str, tokenizer: "str | None",
                     field: "str | None" = "text") -> str:
    cmd = ["python", "scripts/prepare_data.py", "--dataset", files]
    if field:
        cmd += ["--text_field", field]
    cmd += ["--name", name, "--tokenizer", tokenizer or "byte", "--data_dir", data_dir]
    return " ".join(shlex.quote(c) for c in cmd) + f", and train with --dataset {name}"


# --- not found -----------------------------------------------------------------------------------

def _not_found(dataset: str, data_dir: str) -> str:
    prepared = _prepared_in(data_dir)
    looks_like_path = os.path.splitext(dataset)[1] != "" or os.sep in dataset
    if looks_like_path:
        where = "" if os.path.isabs(dataset) else f" (nor in data_dir '{data_dir}')"
        msg = f"key 'dataset': file '{dataset}' not found{where}"
    else:
        msg = (f"key 'dataset': '{dataset}' is neither a known dataset "
               f"({', '.join(KNOWN_DATASETS)}) nor a path to a .txt file, and data_dir "
               f"'{data_dir}' holds no prepared dataset of that name")
    base = os.path.basename(os.path.normpath(dataset))
    if base in prepared:  # e.g. 'data/NAME' with data_dir elsewhere
        return msg + f"; did you mean '{os.path.join(data_dir, base)}'?"
    stem = os.path.splitext(base)[0]
    close = did_you_mean(stem, prepared + list(KNOWN_DATASETS))
    if close:
        hit = close if close in KNOWN_DATASETS else os.path.join(data_dir, close)
        return msg + f" (did you mean '{hit}'?)"
    if prepared:
        shown = ", ".join(prepared[:5]) + (", ..." if len(prepared) > 5 else "")
        return msg + f"; prepared in '{data_dir}': {shown}"
    return msg
