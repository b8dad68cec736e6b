"""The bad-input corpus's vocabulary: `Case`, the placeholders, the fast tiny-run arguments and
the setups that build prepared datasets and damaged checkpoints. The corpus itself is
`tests/e2e/test_bad_input.py` (CASES) plus one `tests/support/bad_cases_<area>.py` per area, each with its
own CASES list; see test_bad_input.py for how a case is run and judged.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
from support.runs import DATA_DIR

CORPUS = Path(DATA_DIR) / "tinyshakespeare.txt"
DIR = object()              # in Case.files: make a directory
TIMEOUT = 240               # seconds per subprocess; a hang is a failure, not a stuck suite
WORKERS = max(2, min(4, os.cpu_count() or 2))

# The demo config shrunk to a seconds-long run on the byte-level corpus file.
FAST = dict(dataset="{corpus}", seq_len=32, batch_size=2, gradient_accumulation_steps=1,
            warmup_steps=0, max_steps=2, log_interval=1, eval_interval=100,
            checkpoint_interval=1, eval_sequences=4, eval_samples=0)
OFFLINE_TOKENIZERS = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# A download that fails at once and for certain, with or without a network: a dead proxy.
DEAD_PROXY = {"https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
              "http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
              "no_proxy": "", "NO_PROXY": ""}


@dataclass
class Case:
    id: str
    argv: list
    expect: Union[str, tuple]                 # substring(s) of the one error line
    files: dict = field(default_factory=dict)  # path under {d} -> str | bytes | DIR
    prefix: str = "tiny"    # "tiny": tiny_args(FAST) first; "bare": only --output_dir={d}/out
    env: dict = field(default_factory=dict)
    setup: Optional[Callable[[Path], None]] = None
    needs_run: bool = False
    marks: tuple = ()


# --- setups: prepared datasets and checkpoints ---------------------------------------------------

def prepared(d: Path, *, meta_edit=None, train_tokens=2000, val_tokens=500, tokenizer="byte",
             vocab=257, name="prep") -> Path:
    """A prepared dataset as scripts/prepare_data.py writes it (shards, then meta.json)."""
    from fp8train.data.shards import write_meta, write_shard
    out = d / name
    out.mkdir(parents=True)
    for split, n in (("train", train_tokens), ("val", val_tokens)):
        write_shard(str(out / f"{split}_000000.bin"), np.arange(n) % 256, vocab, tokenizer)
    meta = dict(format="fp8train-shards", version=1, dataset="synthetic", tokenizer=tokenizer,
                vocab_size=vocab, eot_token=256, dtype="uint16",
                splits={s: dict(shards=[f"{s}_000000.bin"], tokens=n)
                        for s, n in (("train", train_tokens), ("val", val_tokens))})
    if meta_edit:
        meta_edit(meta)
    write_meta(str(out), meta)
    return out


def meta_without_vocab(d):
    prepared(d, meta_edit=lambda m: m.pop("vocab_size"))


def meta_not_json(d):
    (prepared(d) / "meta.json").write_text('{"splits": {"train": ')


def prepared_with_gpt2(d):
    prepared(d, tokenizer="gpt2", vocab=50257)


def truncated_shard(d):
    shard = prepared(d) / "train_000000.bin"
    shard.write_bytes(shard.read_bytes()[:1500])


def missing_shard(d):
    (prepared(d) / "val_000000.bin").unlink()


def short_val_split(d):
    prepared(d, val_tokens=20)


def corrupt_checkpoint_without_manifest(d):
    """A checkpoint directory whose model file was cut short, with nothing (no manifest, no
    config.yaml) that could notice it before the model is loaded."""
    ckpt = d / "trained" / "checkpoints" / "step_0000002"
    for extra in ("manifest.json", "config.yaml"):
        (ckpt / extra).unlink(missing_ok=True)
    model = ckpt / "model.safetensors"
    model.write_bytes(model.read_bytes()[:100])


def corrupt_checkpoint(d):
    model = d / "trained" / "checkpoints" / "step_0000002" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:100])


# --- building cases ------------------------------------------------------------------------------

def yaml_case(case_id, text, expect):
    """A config file holding `text`, passed alone with --config."""
    return Case(case_id, ["--config", "{d}/x.yaml"], prefix="bare", files={"x.yaml": text},
                expect=expect)


def write_files(d: Path, files: dict, fill=lambda text: text) -> None:
    """A case's `files` under `d`: str (through `fill`, for placeholders), bytes, or DIR."""
    for rel, content in files.items():
        p = d / rel
        if content is DIR:
            p.mkdir(parents=True, exist_ok=True)
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(fill(content))
