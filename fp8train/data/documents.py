"""The documents scripts/prepare_data.py tokenizes, through `datasets.load_dataset`: a known
name (fineweb-edu, openwebtext: catalog.py), tinyshakespeare, any hub dataset, or local .txt /
.jsonl / .json / .parquet files (globs allowed), optionally streamed; read in batches of
documents, a read error or a row without text as bad input. `datasets` is imported only when
documents are loaded.
"""
from __future__ import annotations

import glob
import os
from typing import Iterator

from ..errors import BadInput, did_you_mean, one_line
from .catalog import KNOWN, LOCAL_BUILDERS
from .corpus import corpus_path
from ..hub import hub_unreachable, offline


def load_documents(a, log=print):
    """(an iterable dataset of rows, the text field) for the PrepareArgs `a`."""
    kwargs = dict(split=a.split, streaming=a.streaming)
    hub = False
    if a.dataset in KNOWN:
        path, config, split, field = KNOWN[a.dataset]
        args, kwargs["split"] = (path, a.config_name or config), split
        text_field, hub = field, True
    elif a.dataset == "tinyshakespeare":
        data_dir = a.data_dir or os.environ.get("FP8TRAIN_DATA_DIR") or "data"
        args = ("text",)
        kwargs.update(data_files=corpus_path("tinyshakespeare", data_dir, log),
                      sample_by="document")
        text_field = "text"
    elif looks_local(a.dataset):
        builder, files = _local_files(a.dataset)
        args = (builder,)
        kwargs.update(data_files=files, split="train")
        if builder == "text":
            kwargs["sample_by"] = "document"  # one document per file, not per line
        text_field = "text" if builder == "text" else a.text_field
    else:
        args = (a.dataset, a.config_name)
        text_field, hub = a.text_field, True
    unreachable = _hub_access(a.dataset, log) if hub else None
    import datasets
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors come back as ours
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(*args, **kwargs)
    except Exception as e:  # hub offline, unknown dataset, unreadable file
        why = one_line(e)
        if hub and unreachable:
            why = ("not in the local HuggingFace cache, and the hub cannot be reached: "
                   f"{unreachable}")
        elif hub and offline():
            why = "not in the local HuggingFace cache, and offline mode is set"
        raise BadInput(f"--dataset '{a.dataset}': cannot load it ({why})"
                          + _did_you_mean(a.dataset)) from None
    columns = ds.column_names if not a.streaming else (
        list(ds.features) if ds.features is not None else None)
    if columns is not None and text_field not in columns:
        raise BadInput(f"--text_field: '{text_field}' is not a column of '{a.dataset}' "
                          f"(columns: {', '.join(columns)})")
    return ds, text_field


def _hub_access(dataset: str, log) -> "str | None":
    """Offline, or with the hub unreachable, the datasets library is told to use its cache
    alone (it reads this when imported, and it is imported only after this): its client would
    otherwise retry each file for about half a minute, a line per retry. Returns why the hub
    is unreachable, if it is."""
    unreachable = None
    if not offline():
        unreachable = hub_unreachable()
        if unreachable is None:
            return None
        log(f"the HuggingFace hub cannot be reached ({unreachable}): looking for '{dataset}' "
            "in the local cache only")
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    return unreachable


def _did_you_mean(name: str) -> str:
    close = did_you_mean(name, [*KNOWN, "tinyshakespeare"])
    return f"; did you mean '{close}'?" if close else ""


def looks_local(name: str) -> bool:
    return os.path.exists(name) or any(c in name for c in "*?[") or \
        os.path.splitext(name)[1].lower() in LOCAL_BUILDERS or \
        name.startswith((".", "/", "~")) or name.count("/") > 1


def _local_files(dataset: str):
    """(the datasets builder, the files) for a file, a glob or a directory of text files."""
    if os.path.isdir(dataset):
        files = sorted(os.path.join(dataset, f) for f in os.listdir(dataset)
                       if os.path.splitext(f)[1].lower() in LOCAL_BUILDERS)
        if not files:
            raise BadInput(f"--dataset: directory '{dataset}' has no .txt, .jsonl, .json or "
                              ".parquet files")
    else:
        files = sorted(glob.glob(dataset)) if any(c in dataset for c in "*?[") else [dataset]
        files = [f for f in files if os.path.isfile(f)]
        if not files:
            raise BadInput(f"--dataset: no file matches '{dataset}'")
    exts = {os.path.splitext(f)[1].lower() for f in files}
    if len(exts) != 1 or next(iter(exts)) not in LOCAL_BUILDERS:
        raise BadInput(f"--dataset: '{dataset}' must be .txt, .jsonl, .json or .parquet "
                          f"files of one kind (found {', '.join(sorted(exts))})")
    return LOCAL_BUILDERS[exts.pop()], files


def _rows(ds, dataset: str) -> Iterator[dict]:
    """The rows, with a read error (a malformed line of a streamed file) as bad input."""
    it, i = iter(ds), 0
    while True:
        try:
            row = next(it)
        except StopIteration:
            return
        except Exception as e:  # the datasets library's parsers raise many kinds
            raise BadInput(f"--dataset '{dataset}': cannot read it after {i:,} rows "
                              f"({one_line(e, 200, with_type=True)})") from None
        yield row
        i += 1


def doc_batches(ds, dataset: str, field: str, batch: int, skip: int) -> Iterator[list]:
    buf = []
    for i, row in enumerate(_rows(ds, dataset)):
        if i < skip:
            continue
        text = row.get(field)
        if text is None:
            raise BadInput(f"--text_field: row {i} has no '{field}'")
        if not isinstance(text, str):
            raise BadInput(f"--text_field: '{field}' of row {i} is {type(text).__name__}, "
                              "not text")
        buf.append(text)
        if len(buf) == batch:
            yield buf
            buf = []
    if buf:
        yield buf

