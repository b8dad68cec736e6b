"""Bad-input cases: data. See tests/e2e/test_bad_input.py for how a case is run and judged.

Most are refused while the config is validated (no torch import): files given as `dataset` that
are not plain UTF-8 text, names that are not found, and HellaSwag files that are not HellaSwag's
as users have them (read in the preflight, before data, model and batch probe). The last ones
need the data loaded: token ids outside the vocabulary, and batches or windows larger than the
data."""
import bz2
import gzip
import json
import lzma

import numpy as np
from support.bad_input_kit import Case, prepared

JSONL = "".join(json.dumps({"id": i, "text": "Some document. " * 20}) + "\n" for i in range(50))
HELLA = json.dumps({"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 0}) + "\n"
ON = ["--hellaswag_interval=2", "--hellaswag_path={d}/h.jsonl"]
TEXT = "To be, or not to be, that is the question.\n" * 100


def out_of_vocab_body(d):
    """A shard whose header is right but whose body holds id 300 (vocabulary 257): what a
    hand-written or damaged shard looks like."""
    shard = prepared(d) / "train_000000.bin"
    raw = bytearray(shard.read_bytes())
    raw[1024 + 2 * 1500:1024 + 2 * 1501] = np.array([300], dtype=np.uint16).tobytes()
    shard.write_bytes(bytes(raw))


def prepared_in_store(d):
    prepared(d / "store", name="mycorpus")


def cases_for_structured_files():
    """Every kind of structured or compressed file, given directly: refused with the command
    that prepares it (or what to do first), never trained on as raw text."""
    return [
        Case("dataset-jsonl-given-directly", ["--dataset={d}/c.jsonl"], files={"c.jsonl": JSONL},
             expect=("key 'dataset': '{d}/c.jsonl' is JSON lines data",
                     "python scripts/prepare_data.py --dataset {d}/c.jsonl --text_field text "
                     "--name c --tokenizer byte")),
        Case("dataset-jsonl-other-text-field", ["--dataset={d}/c.jsonl"],
             files={"c.jsonl": '{"id": 1, "content": "a b c"}\n{"id": 2, "content": "d"}\n'},
             expect="--text_field content"),
        Case("dataset-ndjson-given-directly", ["--dataset={d}/c.ndjson"],
             files={"c.ndjson": JSONL}, expect="'{d}/c.ndjson' is JSON lines data"),
        Case("dataset-json-given-directly", ["--dataset={d}/c.json"],
             files={"c.json": json.dumps([{"text": "x " * 100}] * 5)},
             expect=("'{d}/c.json' is JSON data", "scripts/prepare_data.py --dataset {d}/c.json")),
        Case("dataset-parquet-given-directly", ["--dataset={d}/c.parquet"],
             files={"c.parquet": b"PAR1" + b"\x15\x04" * 100 + b"PAR1"},
             expect=("'{d}/c.parquet' is parquet data",
                     "scripts/prepare_data.py --dataset {d}/c.parquet")),
        Case("dataset-parquet-under-another-name", ["--dataset={d}/c.data"],
             files={"c.data": b"PAR1" + b"\x15\x04" * 100 + b"PAR1"},
             expect="'{d}/c.data' is parquet data"),
        Case("dataset-csv-given-directly", ["--dataset={d}/c.csv"],
             files={"c.csv": "id,text\n" + "".join(f"{i},hello world\n" for i in range(50))},
             expect=("'{d}/c.csv' is CSV data", "convert it to JSON lines")),
        Case("dataset-tsv-given-directly", ["--dataset={d}/c.tsv"],
             files={"c.tsv": "id\ttext\n" + "".join(f"{i}\thello\n" for i in range(50))},
             expect="'{d}/c.tsv' is TSV data"),
        Case("dataset-jsonl-content-in-a-txt", ["--dataset={d}/c.txt"], files={"c.txt": JSONL},
             expect=("'{d}/c.txt' is JSON lines content", "rename it to .jsonl")),
        Case("dataset-gzip-txt", ["--dataset={d}/c.txt.gz"],
             files={"c.txt.gz": gzip.compress(TEXT.encode())},
             expect=("'{d}/c.txt.gz' is gzip-compressed", "gunzip -k {d}/c.txt.gz",
                     "then train with --dataset {d}/c.txt")),
        Case("dataset-gzip-jsonl", ["--dataset={d}/c.jsonl.gz"],
             files={"c.jsonl.gz": gzip.compress(JSONL.encode())},
             expect=("'{d}/c.jsonl.gz' is gzip-compressed",
                     "prepare it: python scripts/prepare_data.py --dataset {d}/c.jsonl")),
        Case("dataset-gzip-named-txt", ["--dataset={d}/c.txt"],
             files={"c.txt": gzip.compress(TEXT.encode())},
             expect="'{d}/c.txt' is gzip-compressed"),
        Case("dataset-zstd", ["--dataset={d}/c.txt.zst"],
             files={"c.txt.zst": b"\x28\xb5\x2f\xfd" + b"\0" * 64},
             expect=("'{d}/c.txt.zst' is zstd-compressed", "zstd -d")),
        Case("dataset-bzip2", ["--dataset={d}/c.txt.bz2"],
             files={"c.txt.bz2": bz2.compress(TEXT.encode())},
             expect="'{d}/c.txt.bz2' is bzip2-compressed"),
        Case("dataset-xz", ["--dataset={d}/c.txt.xz"],
             files={"c.txt.xz": lzma.compress(TEXT.encode())},
             expect="'{d}/c.txt.xz' is xz-compressed"),
        Case("dataset-zip", ["--dataset={d}/c.zip"], files={"c.zip": b"PK\x03\x04" + b"\0" * 64},
             expect="'{d}/c.zip' is a zip archive"),
    ]


CASES = cases_for_structured_files() + [
    # binary files and text that is not UTF-8 ---------------------------------------------------
    Case("dataset-token-shard-given-directly", ["--dataset={d}/prep/train_000000.bin"],
         setup=prepared,
         expect="'{d}/prep/train_000000.bin' is one token shard of a prepared dataset; set "
                "dataset to its directory: --dataset {d}/prep"),
    Case("dataset-token-shard-without-meta", ["--dataset={d}/prep/train_000000.bin"],
         setup=lambda d: (prepared(d) / "meta.json").unlink(),
         expect="'{d}/prep/train_000000.bin' is a token shard, not text, and '{d}/prep' has "
                "no meta.json"),
    Case("dataset-bin-file", ["--dataset={d}/tokens.bin"],
         files={"tokens.bin": np.arange(5000, dtype=np.uint16).tobytes()},
         expect="'{d}/tokens.bin' is a binary file, not text"),
    Case("dataset-npy-file", ["--dataset={d}/tokens.npy"],
         files={"tokens.npy": b"\x93NUMPY\x01\x00" + b" " * 100},
         expect="'{d}/tokens.npy' is a numpy array, not text"),
    Case("dataset-txt-with-nul-bytes", ["--dataset={d}/c.txt"],
         files={"c.txt": TEXT.encode() + b"\0\0\0" + TEXT.encode()},
         expect="'{d}/c.txt' is a binary file (a NUL byte at offset 4,300)"),
    Case("dataset-txt-utf16", ["--dataset={d}/c.txt"], files={"c.txt": TEXT.encode("utf-16")},
         expect="'{d}/c.txt' is UTF-16 text"),
    Case("dataset-not-a-regular-file", ["--dataset=/dev/zero"],
         expect="key 'dataset': '/dev/zero' is not a regular file"),
    Case("dataset-txt-latin1-names-the-byte", ["--dataset={d}/c.txt"],
         files={"c.txt": "caf\xe9\n".encode("latin-1") * 100},
         expect="cannot read '{d}/c.txt' as UTF-8 text: byte 0xe9 at offset 3"),

    # names and paths: resolved against data_dir, with suggestions -------------------------------
    Case("dataset-prepared-name-typo", ["--dataset=mycorpsu", "--data_dir={d}/store"],
         setup=prepared_in_store,
         expect=("'mycorpsu' is neither a known dataset", "did you mean '{d}/store/mycorpus'?")),
    Case("dataset-readme-path-with-other-data-dir", ["--dataset=data/mycorpus",
                                                     "--data_dir={d}/store"],
         setup=prepared_in_store,
         expect="file 'data/mycorpus' not found (nor in data_dir '{d}/store'); did you mean "
                "'{d}/store/mycorpus'?"),
    Case("dataset-unknown-name-lists-prepared", ["--dataset=zzzzzz", "--data_dir={d}/store"],
         setup=prepared_in_store, expect="prepared in '{d}/store': mycorpus"),
    Case("dataset-is-the-data-dir", ["--dataset={d}/store"], setup=prepared_in_store,
         expect="directory '{d}/store' has no meta.json: not a dataset prepared with "
                "scripts/prepare_data.py (or its preparation did not finish); it holds prepared "
                "datasets: did you mean '{d}/store/mycorpus'?"),
    Case("dataset-directory-of-jsonl-files", ["--dataset={d}/raw"],
         files={"raw/a.jsonl": JSONL, "raw/b.jsonl": JSONL},
         expect="prepare its files first: python scripts/prepare_data.py --dataset "
                "'{d}/raw/*.jsonl' --text_field text --name raw"),

    # found once the data is loaded (torch is up) ------------------------------------------------
    Case("prepared-token-id-outside-vocab-in-body", ["--dataset={d}/prep"],
         setup=out_of_vocab_body,
         expect="shard '{d}/prep/train_000000.bin' holds token id 300, outside the dataset's "
                "vocabulary of 257 (the first such id is at position 1,500"),
    Case("batch-larger-than-dataset", ["--dataset={d}/prep", "--batch_size=10000000"],
         setup=prepared,
         expect="key 'batch_size': an effective batch of 10,000,000 sequences is more than the "
                "training split holds (2,000 tokens make 62 windows of seq_len 32)"),
    Case("target-batch-larger-than-dataset", ["--dataset={d}/prep", "--auto_batch_size",
                                              "--target_effective_batch_size=128",
                                              "--gradient_accumulation_steps=null"],
         setup=prepared, expect="key 'target_effective_batch_size': an effective batch of 128"),
    Case("synthetic-batch-larger-than-dataset", ["--dataset=synthetic", "--batch_size=10000000"],
         expect="key 'batch_size': an effective batch of 10,000,000 sequences"),
    Case("synthetic-seq-len-larger-than-dataset", ["--dataset=synthetic", "--seq_len=1000000"],
         expect="dataset 'synthetic': the val split has 262,144 tokens, fewer than seq_len + 1"),
    # HellaSwag as users have it, read before anything is built ---------------------------------
    Case("hellaswag-not-utf8", ON, files={"h.jsonl": HELLA.encode() + b'{"ctx": "caf\xe9"}\n'},
         expect="key 'hellaswag_path': {d}/h.jsonl:2: not UTF-8 text (byte 0xe9 at column 13)"),
    Case("hellaswag-json-array", ON, files={"h.jsonl": "[" + HELLA.strip() + "]\n"},
         expect="key 'hellaswag_path': {d}/h.jsonl:1: a JSON array; HellaSwag's file is JSON "
                "lines, one example object per line"),
    Case("hellaswag-truncated", ON, files={"h.jsonl": HELLA * 2 + HELLA[:30]},
         expect="{d}/h.jsonl:3: not JSON (Unterminated string starting at: column 30); the "
                "file ends inside this record: truncated?"),
    Case("hellaswag-label-true", ON, files={"h.jsonl": HELLA.replace('"label": 0', '"label": '
                                                                   'true')},
         expect="{d}/h.jsonl:1: not a HellaSwag example (label is a boolean true; it must be "
                "0, 1, 2 or 3"),
    Case("hellaswag-label-fraction", ON, files={"h.jsonl": HELLA.replace('"label": 0',
                                                                       '"label": 2.7')},
         expect="{d}/h.jsonl:1: not a HellaSwag example (label is a number 2.7;"),
    Case("hellaswag-endings-a-string", ON, files={"h.jsonl": HELLA.replace(
        '["a", "b", "c", "d"]', '"abcd"')},
         expect="{d}/h.jsonl:1: not a HellaSwag example (endings is a string \"abcd\"; it must "
                "be a list of 4 strings)"),
    Case("hellaswag-parquet-not-parquet", ["--hellaswag_interval=2",
                                           "--hellaswag_path={d}/validation.parquet"],
         files={"validation.parquet": HELLA}, expect="key 'hellaswag_path': "
         "{d}/validation.parquet: not a readable parquet file ("),
    Case("hellaswag-path-without-interval", ["--hellaswag_path={d}/h.jsonl"],
         files={"h.jsonl": HELLA}, expect="key 'hellaswag_path' ('{d}/h.jsonl') applies only "
         "with hellaswag_interval above 0"),
]
