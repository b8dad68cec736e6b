"""Text datasets -> token shards (scripts/prepare_data.py).

Documents come from `datasets.load_dataset`: a known name (fineweb-edu, openwebtext,
tinyshakespeare), any hub dataset, or local .txt / .jsonl / .json / .parquet files (globs
allowed), optionally streamed. Each document is tokenized in a worker pool and preceded by the
end-of-text token, so documents are separated in the stream. The first `val_tokens` tokens (or
the first `val_docs` documents) form the validation split, the rest the training split, written
as shards of `shard_tokens` tokens.

Resumable: a shard is written under a temporary name and renamed, and after each shard the
position in the document stream (and the tokens carried into the next shard) is saved; a rerun
skips the finished shards and continues from there, producing byte-identical files. meta.json is
written last: a directory with meta.json is a complete dataset.
"""
from __future__ import annotations

import glob
import json
import os
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from .config import ConfigError
from .errors import one_line
from .shards import META_FILE, dtype_for_vocab, write_meta, write_shard

KNOWN = {  # name -> (hub path, config, split, text field)
    "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", "text"),
    "openwebtext": ("Skylion007/openwebtext", None, "train", "text"),
}
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
PROGRESS = ".progress.json"


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
    val_tokens: int = 1_000_000
    val_docs: Optional[int] = None
    max_tokens: Optional[int] = None
    batch_docs: int = 256


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
        from .data import HFTokenizer
        self.tok = HFTokenizer(name).tok
        self.name, self.vocab_size = name, len(self.tok)
        eot = self.tok.eos_token_id
        if eot is None:
            eot = self.tok.convert_tokens_to_ids("<|endoftext|>")
            if eot == self.tok.unk_token_id:
                eot = None
        if eot is None:
            raise ConfigError(f"tokenizer '{name}' has no end-of-text token (eos_token or "
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


def _encode(texts) -> list:
    """Worker: a batch of documents -> one array per document, EOT first."""
    tok = _WORKER_TOK
    eot = np.array([tok.eot], dtype=np.int64)
    return [np.concatenate([eot, ids]) for ids in tok.encode_batch(texts)]


# --- documents ----------------------------------------------------------------------------------

def load_documents(a: PrepareArgs):
    """(an iterable dataset of rows, the text field)."""
    import datasets
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    kwargs = dict(split=a.split, streaming=a.streaming)
    if a.dataset in KNOWN:
        path, config, split, field = KNOWN[a.dataset]
        args, kwargs["split"] = (path, a.config_name or config), split
        text_field = field
    elif a.dataset == "tinyshakespeare":
        from .data import corpus_path
        data_dir = os.environ.get("FP8TRAIN_DATA_DIR") or "data"
        args = ("text",)
        kwargs.update(data_files=corpus_path("tinyshakespeare", data_dir), sample_by="document")
        text_field = "text"
    elif _looks_local(a.dataset):
        files = sorted(glob.glob(a.dataset)) if any(c in a.dataset for c in "*?[") \
            else [a.dataset]
        files = [f for f in files if os.path.isfile(f)]
        if not files:
            raise ConfigError(f"--dataset: no file matches '{a.dataset}'")
        exts = {os.path.splitext(f)[1].lower() for f in files}
        if len(exts) != 1 or next(iter(exts)) not in LOCAL_BUILDERS:
            raise ConfigError(f"--dataset: '{a.dataset}' must be .txt, .jsonl, .json or "
                              f".parquet files of one kind (found {', '.join(sorted(exts))})")
        builder = LOCAL_BUILDERS[exts.pop()]
        args = (builder,)
        kwargs.update(data_files=files, split="train")
        if builder == "text":
            kwargs["sample_by"] = "document"  # one document per file, not per line
        text_field = "text" if builder == "text" else a.text_field
    else:
        args = (a.dataset, a.config_name)
        text_field = a.text_field
    try:
        ds = datasets.load_dataset(*args, **kwargs)
    except Exception as e:  # hub offline, unknown dataset, unreadable file
        raise ConfigError(f"--dataset '{a.dataset}': cannot load it ({one_line(e)})") from None
    columns = ds.column_names if not a.streaming else (
        list(ds.features) if ds.features is not None else None)
    if columns is not None and text_field not in columns:
        raise ConfigError(f"--text_field: '{text_field}' is not a column of '{a.dataset}' "
                          f"(columns: {', '.join(columns)})")
    return ds, text_field


def _looks_local(name: str) -> bool:
    return os.path.exists(name) or any(c in name for c in "*?[") or \
        os.path.splitext(name)[1].lower() in LOCAL_BUILDERS


def _doc_batches(ds, field: str, batch: int, skip: int) -> Iterator[list]:
    buf = []
    for i, row in enumerate(ds):
        if i < skip:
            continue
        text = row.get(field)
        if text is None:
            raise ConfigError(f"--text_field: row {i} has no '{field}'")
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
        self.split = state.get("split", "val" if (a.val_tokens or a.val_docs) else "train")
        self.shard = state.get("shard", 0)
        self.val_shards = state.get("val_shards", 0)
        self.docs = state.get("docs", 0)           # documents fully handed to the splitter
        self.tokens = {"val": state.get("val_tokens", 0), "train": state.get("train_tokens", 0)}
        self.docs_in = {"val": state.get("val_docs", 0), "train": state.get("train_docs", 0)}
        self.buf = [np.load(state["carry"])] if state.get("carry") else []
        self.buffered = sum(len(b) for b in self.buf)

    def limit(self) -> int:
        return self.a.val_tokens if self.split == "val" and not self.a.val_docs \
            else self.a.shard_tokens

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
            self._flush(len_=self.limit(), switch=self.split == "val")
        return True

    def _flush(self, len_: int, switch: bool) -> None:
        tokens = np.concatenate(self.buf) if self.buf else np.zeros(0, np.int64)
        out, rest = tokens[:len_], tokens[len_:]
        name = f"{self.split}_{(self.val_shards if self.split == 'val' else self.shard):06d}.bin"
        write_shard(os.path.join(self.a.output_dir, name), out, self.vocab, self.tok_name)
        self.tokens[self.split] += len(out)
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
        if self.buffered or (self.split == "val"):
            self._flush(len_=self.buffered, switch=True)

    def _save_progress(self) -> None:
        carry = None
        if self.buffered:
            carry = os.path.join(self.a.output_dir, ".carry.npy")
            np.save(carry + ".tmp.npy", np.concatenate(self.buf))
            os.replace(carry + ".tmp.npy", carry)
        state = dict(split=self.split, shard=self.shard, val_shards=self.val_shards,
                     docs=self.docs, val_tokens=self.tokens["val"],
                     train_tokens=self.tokens["train"], val_docs=self.docs_in["val"],
                     train_docs=self.docs_in["train"], carry=carry)
        tmp = os.path.join(self.a.output_dir, PROGRESS + ".tmp")
        with open(tmp, "w") as fh:
            json.dump(state, fh)
        os.replace(tmp, os.path.join(self.a.output_dir, PROGRESS))


def prepare(a: PrepareArgs, log=print) -> dict:
    if os.path.isfile(os.path.join(a.output_dir, META_FILE)):
        log(f"{a.output_dir} is already prepared (meta.json exists); nothing to do")
        with open(os.path.join(a.output_dir, META_FILE)) as fh:
            return json.load(fh)
    os.makedirs(a.output_dir, exist_ok=True)
    tok = make_tokenizer(a.tokenizer)
    ds, field = load_documents(a)
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
    batches = _doc_batches(ds, field, a.batch_docs, skip=state.get("docs", 0))
    pool = None
    if a.num_proc > 1:
        import multiprocessing as mp
        pool = mp.get_context("spawn").Pool(a.num_proc, _init_worker, (a.tokenizer,))
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
    if sp.tokens["train"] == 0:
        raise ConfigError(f"--dataset '{a.dataset}': no training tokens (the dataset is empty, "
                          f"or val_tokens / val_docs took everything)")
    meta = dict(format="fp8train-shards", version=1, dataset=a.dataset, tokenizer=tok.name,
                vocab_size=tok.vocab_size, eot_token=tok.eot,
                dtype=dtype_for_vocab(tok.vocab_size).name,
                splits={s: dict(shards=sorted(f for f in os.listdir(a.output_dir)
                                              if f.startswith(s + "_") and f.endswith(".bin")),
                                tokens=sp.tokens[s], documents=sp.docs_in[s])
                        for s in ("train", "val")},
                source=dict(text_field=field, split=a.split, config=a.config_name,
                            max_tokens=a.max_tokens, val_tokens=a.val_tokens,
                            val_docs=a.val_docs, shard_tokens=a.shard_tokens))
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
