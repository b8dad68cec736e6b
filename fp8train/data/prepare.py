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

The documents are read in documents.py, tokenized with tokenizers.prepare_tokenizer, and the
output directory (what a rerun finds there) is output_dir.py's.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..errors import BadInput
from ..io import atomic_write, atomic_write_json
from .documents import doc_batches, load_documents
from .output_dir import (CARRY, PROGRESS, arguments, make_dirs, previous_preparation,
                         remove_ours)
from .shards import dtype_for_vocab, write_meta, write_shard
from .tokenizers import prepare_tokenizer

DEFAULT_VAL_TOKENS = 1_000_000
VAL_FRACTION = 0.1    # the most of a small corpus that the default validation split takes


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


# --- the tokenizer workers ------------------------------------------------------------------

_WORKER_TOK = None


def _init_worker(name: str) -> None:
    global _WORKER_TOK
    _WORKER_TOK = prepare_tokenizer(name)


def _init_pool_worker(name: str) -> None:
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to report, once
    _init_worker(name)


def _encode(texts) -> list:
    """Worker: a batch of documents -> one array per document, EOT first."""
    tok = _WORKER_TOK
    eot = np.array([tok.eot], dtype=np.int64)
    return [np.concatenate([eot, ids]) for ids in tok.encode_batch(texts)]


# --- the writer ---------------------------------------------------------------------------------

class Splitter:
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
                self.flush(len_=self.buffered, switch=True)
            return True
        while self.buffered >= self.limit():
            if self.split == "val":
                self.flush(len_=self.a.val_tokens or DEFAULT_VAL_TOKENS, switch=True)
            else:
                self.flush(len_=self.a.shard_tokens, switch=False)
        return True

    def flush(self, len_: int, switch: bool) -> None:
        """Write the first `len_` tokens held as the current split's next shard and save the
        progress; `switch`: the validation split ends with this shard."""
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

    def finish(self) -> None:
        if self.split == "val":  # the corpus ended inside the validation split
            self._finish_val()
        while self.buffered > self.a.shard_tokens:  # what the default val split held back
            self.flush(len_=self.a.shard_tokens, switch=False)
        if self.buffered:
            self.flush(len_=self.buffered, switch=False)
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
        self.flush(len_=n_val, switch=True)

    def _save_progress(self) -> None:
        carry = None
        if self.buffered:
            carry = CARRY
            rest = np.concatenate(self.buf)
            atomic_write(os.path.join(self.a.output_dir, carry), lambda fh: np.save(fh, rest),
                         binary=True)
        state = dict(split=self.split, shard=self.shard, val_shards=self.val_shards,
                     docs=self.docs, val_tokens=self.tokens["val"],
                     train_tokens=self.tokens["train"], val_docs=self.docs_in["val"],
                     train_docs=self.docs_in["train"], carry=carry,
                     val_max_token_id=self.max_id["val"],
                     train_max_token_id=self.max_id["train"], arguments=arguments(self.a))
        atomic_write_json(os.path.join(self.a.output_dir, PROGRESS), state)


# --- the pipeline ---------------------------------------------------------------------------

def prepare(a: PrepareArgs, log=print) -> dict:
    a.check()
    done = previous_preparation(a, log)
    if done is not None:
        return done
    resumable = os.path.isfile(os.path.join(a.output_dir, PROGRESS))
    created = make_dirs(a.output_dir)
    try:
        return _prepare(a, log)
    except BaseException as e:
        # Bad input found before anything of a previous run was resumed would fail the same way
        # again: leave nothing. Otherwise (interrupted, killed, a failed write) keep what a
        # rerun resumes from, if anything was written.
        if not resumable and (isinstance(e, BadInput) or
                              not os.path.isfile(os.path.join(a.output_dir, PROGRESS))):
            remove_ours(a.output_dir)
            for d in reversed(created):
                if not os.listdir(d):
                    os.rmdir(d)
        raise


def _prepare(a: PrepareArgs, log) -> dict:
    tok = prepare_tokenizer(a.tokenizer)
    ds, field = load_documents(a, log)
    state = {}
    progress = os.path.join(a.output_dir, PROGRESS)
    if os.path.isfile(progress):
        with open(progress) as fh:
            state = json.load(fh)
        log(f"resuming: {state['shard']} train and {state['val_shards']} val shards done, "
            f"{state['docs']:,} documents read")
    sp = Splitter(a, tok.vocab_size, tok.name, state, log)
    t0, done_tokens = time.time(), 0
    bar = _progress_bar(a, len(ds) if hasattr(ds, "__len__") else None, state.get("docs", 0))
    batches = doc_batches(ds, a.dataset, field, a.batch_docs, skip=state.get("docs", 0))
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
                arguments=arguments(a))
    write_meta(a.output_dir, meta)
    for leftover in (PROGRESS, CARRY):
        p = os.path.join(a.output_dir, leftover)
        if os.path.exists(p):
            os.remove(p)
    elapsed = time.time() - t0
    log(f"prepared {a.output_dir}: {sp.tokens['train']:,} train / {sp.tokens['val']:,} val "
        f"tokens in {len(meta['splits']['train']['shards'])} + "
        f"{len(meta['splits']['val']['shards'])} shards ({tok.name}, vocab {tok.vocab_size:,}) "
        f"in {elapsed:.1f} s ({done_tokens / max(elapsed, 1e-9):,.0f} tokens/s)")
    return meta


def _progress_bar(a: PrepareArgs, total_docs, initial):
    import sys

    from tqdm.auto import tqdm
    return tqdm(total=total_docs, initial=initial, unit="doc", dynamic_ncols=True,
                disable=not sys.stderr.isatty() and os.environ.get("FP8TRAIN_PROGRESS") != "1")
