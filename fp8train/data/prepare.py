"""Text datasets -> token shards (scripts/prepare_data.py).

Documents come from `datasets.load_dataset`: a known name (fineweb-edu, openwebtext,
tinyshakespeare), any hub dataset, or local .txt / .jsonl / .json / .parquet files (globs
allowed), optionally streamed. Each document is tokenized in a worker pool and preceded by the
end-of-text token, so documents are separated in the stream. The first `val_tokens` tokens (or
the first `val_docs` documents) form the validation split, the rest the training split, written
as shards of `shard_tokens` tokens. Without either, the validation split is the first
DEFAULT_VAL_TOKENS tokens, or VAL_FRACTION of a corpus too small for that.

Resumable: a shard is written under a temporary name and renamed, and after each shard the
position in the document stream (and the tokens carried into the next shard) is saved with the
arguments; a rerun with the same arguments skips the finished shards and continues from there,
producing byte-identical files, and one with other arguments is refused (--overwrite starts
again). meta.json is written last: a directory with meta.json is a complete dataset, and
training refuses one without it. A run that fails before anything resumable is written leaves
nothing behind.
"""
from __future__ import annotations

import glob
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from ..errors import BadInput, did_you_mean, one_line
from ..io import atomic_write, atomic_write_json
from .loader import _offline, hub_unreachable
from .shards import CHECKED_FILE, META_FILE, dtype_for_vocab, write_meta, write_shard

KNOWN = {  # name -> (hub path, config, split, text field)
    "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", "text"),
    "openwebtext": ("Skylion007/openwebtext", None, "train", "text"),
}
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
PROGRESS = ".progress.json"
DEFAULT_VAL_TOKENS = 1_000_000
VAL_FRACTION = 0.1    # the most of a small corpus that the default validation split takes
# The arguments that decide the output: a rerun (or a resume) must repeat them.
OUTPUT_ARGS = ("dataset", "tokenizer", "text_field", "config_name", "split", "shard_tokens",
               "val_tokens", "val_docs", "max_tokens")


@dataclass
class PrepareArgs:
    dataset: str
    output_dir: str
    tokenizer: str = "gpt2"
    text_field: str = "text"
    config_name: Optional[str] = None
    split: str = "train"
    streaming: bool = False
    num_proc: int = 1
    shard_tokens: int = 100_000_000
    val_tokens: Optional[int] = None    # None: DEFAULT_VAL_TOKENS, at most VAL_FRACTION
    val_docs: Optional[int] = None
    max_tokens: Optional[int] = None
    batch_docs: int = 256
    overwrite: bool = False
    data_dir: Optional[str] = None      # where tinyshakespeare.txt is looked up

    def check(self) -> None:
        for key in ("num_proc", "shard_tokens", "val_tokens", "val_docs", "max_tokens"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise BadInput(f"--{key} must be at least 1, got {value}")
        if self.val_tokens is not None and self.val_docs is not None:
            raise BadInput("--val_tokens and --val_docs both choose the validation split: "
                              "pass one of them")


# --- tokenizers with an end-of-text token ---------------------------------------------------------

class _ByteEOT:
    """UTF-8 bytes (0..255) plus an end-of-text id 256."""
    name, vocab_size, eot = "byte", 257, 256

    def encode_batch(self, texts):
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64)
                for t in texts]


class _TiktokenGPT2:
    name, vocab_size = "gpt2", 50257

    def __init__(self):
        import tiktoken
        self.enc = tiktoken.get_encoding("gpt2")
        self.eot = self.enc.eot_token

    def encode_batch(self, texts):
        return [np.asarray(ids, dtype=np.int64) for ids in self.enc.encode_ordinary_batch(texts)]


class _HF:
    def __init__(self, name: str):
        from .loader import HFTokenizer
        self.tok = HFTokenizer(name, what="--tokenizer").tok
        self.name, self.vocab_size = name, len(self.tok)
        eot = self.tok.eos_token_id
        if eot is None:
            eot = self.tok.convert_tokens_to_ids("<|endoftext|>")
            if eot == self.tok.unk_token_id:
                eot = None
        if eot is None:
            raise BadInput(f"tokenizer '{name}' has no end-of-text token (eos_token or "
                              "<|endoftext|>) to separate documents")
        self.eot = int(eot)

    def encode_batch(self, texts):
        out = self.tok(list(texts), add_special_tokens=False)["input_ids"]
        return [np.asarray(ids, dtype=np.int64) for ids in out]


def make_tokenizer(name: str):
    if name == "byte":
        return _ByteEOT()
    if name == "gpt2":
        try:  # tiktoken is several times faster than the HF tokenizer, where it is installed
            return _TiktokenGPT2()
        except Exception:
            pass
    return _HF(name)


_WORKER_TOK = None


def _init_worker(name: str) -> None:
    global _WORKER_TOK
    _WORKER_TOK = make_tokenizer(name)


def _init_pool_worker(name: str) -> None:
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to report, once
    _init_worker(name)


def _encode(texts) -> list:
    """Worker: a batch of documents -> one array per document, EOT first."""
    tok = _WORKER_TOK
    eot = np.array([tok.eot], dtype=np.int64)
    return [np.concatenate([eot, ids]) for ids in tok.encode_batch(texts)]


# --- documents ----------------------------------------------------------------------------------

def load_documents(a: PrepareArgs, log=print):
    """(an iterable dataset of rows, the text field)."""
    kwargs = dict(split=a.split, streaming=a.streaming)
    hub = False
    if a.dataset in KNOWN:
        path, config, split, field = KNOWN[a.dataset]
        args, kwargs["split"] = (path, a.config_name or config), split
        text_field, hub = field, True
    elif a.dataset == "tinyshakespeare":
        from .loader import corpus_path
        data_dir = a.data_dir or os.environ.get("FP8TRAIN_DATA_DIR") or "data"
        args = ("text",)
        kwargs.update(data_files=corpus_path("tinyshakespeare", data_dir, log),
                      sample_by="document")
        text_field = "text"
    elif _looks_local(a.dataset):
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
        elif hub and _offline():
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
    if not _offline():
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


def _looks_local(name: str) -> bool:
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


def _doc_batches(ds, dataset: str, field: str, batch: int, skip: int) -> Iterator[list]:
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


# --- the writer ---------------------------------------------------------------------------------

class _Splitter:
    """Routes the token stream into val (first) and train shards, and remembers where it is."""

    def __init__(self, a: PrepareArgs, vocab: int, tok_name: str, state: dict, log):
        self.a, self.vocab, self.tok_name, self.log = a, vocab, tok_name, log
        self.split = state.get("split", "val")
        self.shard = state.get("shard", 0)
        self.val_shards = state.get("val_shards", 0)
        self.docs = state.get("docs", 0)           # documents fully handed to the splitter
        self.tokens = {"val": state.get("val_tokens", 0), "train": state.get("train_tokens", 0)}
        self.docs_in = {"val": state.get("val_docs", 0), "train": state.get("train_docs", 0)}
        self.max_id = {s: state.get(f"{s}_max_token_id", 0) for s in ("val", "train")}
        carry = state.get("carry")
        self.buf = [np.load(os.path.join(a.output_dir, os.path.basename(carry)))] if carry else []
        self.buffered = sum(len(b) for b in self.buf)

    def limit(self) -> int:
        """Tokens held before the current split's next shard is written. The default validation
        split waits until the corpus is known to be large enough for DEFAULT_VAL_TOKENS to be at
        most VAL_FRACTION of it; finish() takes the fraction of a smaller one."""
        if self.split == "train":
            return self.a.shard_tokens
        return self.a.val_tokens or int(DEFAULT_VAL_TOKENS / VAL_FRACTION)

    def add(self, doc: np.ndarray) -> bool:
        """Take one document; False once max_tokens is reached."""
        if self.a.max_tokens is not None:
            room = self.a.max_tokens - sum(self.tokens.values()) - self.buffered
            if room <= 0:
                return False
            doc = doc[:room]
        self.docs += 1
        if len(doc) <= 1:  # an empty document: nothing but the separator
            return True
        self.buf.append(doc)
        self.buffered += len(doc)
        self.docs_in[self.split] += 1
        if self.split == "val" and self.a.val_docs:
            if self.docs_in["val"] >= self.a.val_docs:
                self._flush(len_=self.buffered, switch=True)
            return True
        while self.buffered >= self.limit():
            if self.split == "val":
                self._flush(len_=self.a.val_tokens or DEFAULT_VAL_TOKENS, switch=True)
            else:
                self._flush(len_=self.a.shard_tokens, switch=False)
        return True

    def _flush(self, len_: int, switch: bool) -> None:
        tokens = np.concatenate(self.buf) if self.buf else np.zeros(0, np.int64)
        out, rest = tokens[:len_], tokens[len_:]
        name = f"{self.split}_{(self.val_shards if self.split == 'val' else self.shard):06d}.bin"
        write_shard(os.path.join(self.a.output_dir, name), out, self.vocab, self.tok_name)
        self.tokens[self.split] += len(out)
        if len(out):
            self.max_id[self.split] = max(self.max_id[self.split], int(out.max()))
        if self.split == "val":
            self.val_shards += 1
        else:
            self.shard += 1
        if switch:
            self.split = "train"
        self.buf, self.buffered = ([rest] if len(rest) else []), len(rest)
        self._save_progress()
        self.log(f"wrote {name}: {len(out):,} tokens")
        _kill_point(self.a.output_dir, self.shard + self.val_shards)

    def finish(self) -> None:
        if self.split == "val":  # the corpus ended inside the validation split
            self._finish_val()
        while self.buffered > self.a.shard_tokens:  # what the default val split held back
            self._flush(len_=self.a.shard_tokens, switch=False)
        if self.buffered:
            self._flush(len_=self.buffered, switch=False)
        if self.tokens["train"] == 0:
            raise BadInput(f"--dataset '{self.a.dataset}': no training tokens (the dataset "
                              f"has no text, or the validation split took all "
                              f"{self.tokens['val']:,} tokens)")

    def _finish_val(self) -> None:
        total, dataset = self.buffered, self.a.dataset
        if total == 0:
            raise BadInput(f"--dataset '{dataset}': no training tokens (the dataset has no "
                              "text)")
        if self.a.val_docs:
            raise BadInput(f"--val_docs {self.a.val_docs:,} takes all "
                              f"{self.docs_in['val']:,} documents of '{dataset}' "
                              f"({total:,} tokens), leaving none for training: pass a smaller "
                              "--val_docs")
        if self.a.val_tokens:
            raise BadInput(f"--val_tokens {self.a.val_tokens:,} takes all {total:,} tokens of "
                              f"'{dataset}', leaving none for training: pass a smaller "
                              f"--val_tokens, or leave it out (then {VAL_FRACTION:.0%} of a "
                              "corpus this small)")
        n_val = max(1, int(total * VAL_FRACTION))
        self.log(f"validation split: the first {n_val:,} of the corpus's {total:,} tokens "
                 f"({VAL_FRACTION:.0%}; the default {DEFAULT_VAL_TOKENS:,} needs a corpus of "
                 f"{int(DEFAULT_VAL_TOKENS / VAL_FRACTION):,} tokens; --val_tokens or "
                 "--val_docs sets it)")
        self._flush(len_=n_val, switch=True)

    def _save_progress(self) -> None:
        carry = None
        if self.buffered:
            carry = ".carry.npy"
            rest = np.concatenate(self.buf)
            atomic_write(os.path.join(self.a.output_dir, carry), lambda fh: np.save(fh, rest),
                         binary=True)
        state = dict(split=self.split, shard=self.shard, val_shards=self.val_shards,
                     docs=self.docs, val_tokens=self.tokens["val"],
                     train_tokens=self.tokens["train"], val_docs=self.docs_in["val"],
                     train_docs=self.docs_in["train"], carry=carry,
                     val_max_token_id=self.max_id["val"],
                     train_max_token_id=self.max_id["train"], arguments=_arguments(self.a))
        atomic_write_json(os.path.join(self.a.output_dir, PROGRESS), state)


# --- the output directory -----------------------------------------------------------------------

def _arguments(a: PrepareArgs) -> dict:
    """The arguments that decide the output, a local dataset's path made absolute."""
    rec = {k: getattr(a, k) for k in OUTPUT_ARGS}
    if a.dataset not in KNOWN and a.dataset != "tinyshakespeare" and _looks_local(a.dataset):
        rec["dataset"] = os.path.abspath(os.path.expanduser(a.dataset))
    return rec


def _ours(name: str) -> bool:
    """A file this module (or training's token-id check) writes into a prepared directory."""
    return name.startswith((META_FILE, PROGRESS, ".carry.npy", CHECKED_FILE)) or bool(
        re.fullmatch(r"(train|val)_\d{6}\.bin(\.tmp)?", name))


def _remove_ours(directory: str) -> None:
    meta = os.path.join(directory, META_FILE)
    if os.path.exists(meta):  # first: a directory with meta.json counts as complete
        os.remove(meta)
    for name in os.listdir(directory):
        if _ours(name):
            os.remove(os.path.join(directory, name))


def _differences(recorded: dict, now: dict) -> str:
    def show(v):
        return "default" if v is None else repr(v)
    return ", ".join(f"{k}: {show(recorded[k])} -> {show(now[k])}"
                     for k in OUTPUT_ARGS if k in recorded and recorded[k] != now[k])


def _previous(a: PrepareArgs, log) -> "dict | None":
    """What is already in the output directory: the meta of a finished preparation with these
    arguments (nothing to do), None to go on (nothing there, or a resumable preparation with
    these arguments), or a BadInput (other arguments, other files)."""
    out = a.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise BadInput(f"output directory '{out}' is a file")
    if not os.path.isdir(out):
        return None
    meta_path, progress = os.path.join(out, META_FILE), os.path.join(out, PROGRESS)
    if a.overwrite and any(_ours(n) for n in os.listdir(out)):
        _remove_ours(out)
        log(f"--overwrite: removed the previous preparation in {out}")
    foreign = sorted(n for n in os.listdir(out) if not _ours(n))
    if foreign:
        raise BadInput(f"output directory '{out}' holds files that are not a prepared "
                          f"dataset ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}"
                          "); choose another --name or --output_dir")
    now = _arguments(a)
    if os.path.isfile(meta_path):
        try:
            with open(meta_path, encoding="utf-8") as fh:
                meta = json.load(fh)
        except ValueError:
            raise BadInput(f"'{meta_path}' is not valid JSON; pass --overwrite to prepare "
                              f"'{out}' again") from None
        diff = _differences(meta.get("arguments") or {}, now)
        if diff:
            raise BadInput(f"'{out}' is already prepared with other arguments ({diff}); pass "
                              "--overwrite to replace it, or choose another --name or "
                              "--output_dir")
        log(f"{out} is already prepared with these arguments (meta.json exists): nothing to "
            "do; --overwrite prepares it again")
        return meta
    if os.path.isfile(progress):
        with open(progress) as fh:
            diff = _differences(json.load(fh).get("arguments") or {}, now)
        if diff:
            raise BadInput(f"'{out}' holds an unfinished preparation with other arguments "
                              f"({diff}); rerun with those to resume it, or pass --overwrite to "
                              "start again")
    return None


def _make_dirs(path: str) -> list:
    """Create `path` and its missing parents; the ones created, outermost first."""
    created, p = [], os.path.abspath(path)
    while not os.path.exists(p):
        created.insert(0, p)
        p = os.path.dirname(p)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise BadInput(f"cannot create output directory '{path}' "
                          f"({e.strerror or one_line(e)})") from None
    if not os.access(path, os.W_OK):
        raise BadInput(f"output directory '{path}' is not writable")
    return created


def prepare(a: PrepareArgs, log=print) -> dict:
    a.check()
    done = _previous(a, log)
    if done is not None:
        return done
    resumable = os.path.isfile(os.path.join(a.output_dir, PROGRESS))
    created = _make_dirs(a.output_dir)
    try:
        return _prepare(a, log)
    except BaseException as e:
        # Bad input found before anything of a previous run was resumed would fail the same way
        # again: leave nothing. Otherwise (interrupted, killed, a failed write) keep what a
        # rerun resumes from, if anything was written.
        if not resumable and (isinstance(e, BadInput) or
                              not os.path.isfile(os.path.join(a.output_dir, PROGRESS))):
            _remove_ours(a.output_dir)
            for d in reversed(created):
                if not os.listdir(d):
                    os.rmdir(d)
        raise


def _prepare(a: PrepareArgs, log) -> dict:
    tok = make_tokenizer(a.tokenizer)
    ds, field = load_documents(a, log)
    state = {}
    progress = os.path.join(a.output_dir, PROGRESS)
    if os.path.isfile(progress):
        with open(progress) as fh:
            state = json.load(fh)
        log(f"resuming: {state['shard']} train and {state['val_shards']} val shards done, "
            f"{state['docs']:,} documents read")
    sp = _Splitter(a, tok.vocab_size, tok.name, state, log)
    t0, done_tokens = time.time(), 0
    bar = _progress_bar(a, len(ds) if hasattr(ds, "__len__") else None, state.get("docs", 0))
    batches = _doc_batches(ds, a.dataset, field, a.batch_docs, skip=state.get("docs", 0))
    pool = None
    if a.num_proc > 1:
        import multiprocessing as mp
        import signal

        # The workers start with Ctrl-C ignored (a Python started with SIGINT ignored keeps it
        # so): one still importing when it comes would print a KeyboardInterrupt traceback
        # before its initializer could ignore it. The parent reports Ctrl-C, once.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            pool = mp.get_context("spawn").Pool(a.num_proc, _init_pool_worker, (a.tokenizer,))
        finally:
            signal.signal(signal.SIGINT, previous)
        encoded = pool.imap(_encode, batches, chunksize=1)  # in order: deterministic
    else:
        _init_worker(a.tokenizer)
        encoded = map(_encode, batches)
    try:
        stop = False
        for docs in encoded:
            for doc in docs:
                if not sp.add(doc):
                    stop = True
                    break
                done_tokens += len(doc)
            if bar is not None:
                bar.update(len(docs))
                bar.set_postfix_str(f"{done_tokens / max(time.time() - t0, 1e-9):,.0f} tok/s")
            if stop:
                break
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
    sp.finish()
    meta = dict(format="fp8train-shards", version=1, dataset=a.dataset, tokenizer=tok.name,
                vocab_size=tok.vocab_size, eot_token=tok.eot,
                dtype=dtype_for_vocab(tok.vocab_size).name,
                splits={s: dict(shards=sorted(f for f in os.listdir(a.output_dir)
                                              if f.startswith(s + "_") and f.endswith(".bin")),
                                tokens=sp.tokens[s], documents=sp.docs_in[s],
                                max_token_id=sp.max_id[s])
                        for s in ("train", "val")},
                source=dict(text_field=field, split=a.split, config=a.config_name,
                            max_tokens=a.max_tokens, val_tokens=a.val_tokens,
                            val_docs=a.val_docs, shard_tokens=a.shard_tokens),
                arguments=_arguments(a))
    write_meta(a.output_dir, meta)
    for leftover in (PROGRESS, ".carry.npy"):
        p = os.path.join(a.output_dir, leftover)
        if os.path.exists(p):
            os.remove(p)
    elapsed = time.time() - t0
    log(f"prepared {a.output_dir}: {sp.tokens['train']:,} train / {sp.tokens['val']:,} val "
        f"tokens in {len(meta['splits']['train']['shards'])} + "
        f"{len(meta['splits']['val']['shards'])} shards ({tok.name}, vocab {tok.vocab_size:,}) "
        f"in {elapsed:.1f} s ({done_tokens / max(elapsed, 1e-9):,.0f} tokens/s)")
    return meta


def _kill_point(output_dir: str, shards_written: int) -> None:
    """For the interruption test: FP8TRAIN_PREPARE_KILL_AFTER=N kills this process with SIGKILL
    after its N-th shard, leaving a half-written temporary file behind as a real kill would."""
    n = os.environ.get("FP8TRAIN_PREPARE_KILL_AFTER")
    if n and shards_written == int(n):
        import signal
        with open(os.path.join(output_dir, "train_999999.bin.tmp"), "wb") as fh:
            fh.write(b"half a shard")
        os.kill(os.getpid(), signal.SIGKILL)


def _progress_bar(a: PrepareArgs, total_docs, initial):
    import sys

    from tqdm.auto import tqdm
    return tqdm(total=total_docs, initial=initial, unit="doc", dynamic_ncols=True,
                disable=not sys.stderr.isatty() and os.environ.get("FP8TRAIN_PROGRESS") != "1")
