"""Validation loss: the one computation behind the training loop's eval and scripts/evaluate.py,
so that a checkpoint evaluated later gives the number the run logged."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time

import numpy as np
import torch


def token_loss_sums(model, batches, device, context=contextlib.nullcontext, rank: int = 0,
                    world: int = 1, progress=None, stop=None) -> "torch.Tensor | None":
    """(sum of token cross-entropies, tokens) over this rank's share of `batches`, a 2-vector on
    `device`; sum it over ranks for the loss. Batches go round-robin over ranks with the same
    number of forwards on every rank (FSDP's forward is a collective): a rank short of a batch
    repeats one with weight 0. `context()` is entered around each forward (precision).
    `stop(n)`, asked after the n-th forward, abandons the evaluation (None is returned) when
    true; it must answer the same on every rank."""
    total = torch.zeros(2, device=device)
    for n, i in enumerate(range(0, len(batches), world), start=1):
        mine = i + rank < len(batches)
        x, y = batches[i + rank if mine else 0]
        with context():
            _, ce, _ = model(x.to(device), y.to(device))
        if mine:
            total += torch.stack([ce * y.numel(), torch.tensor(float(y.numel()), device=device)])
        if progress is not None:
            progress(i + world)
        if stop is not None and stop(n):
            return None
    return total


def whole_split_batches(tokens, seq_len: int, micro: int):
    """Every non-overlapping window of the split (all but its last partial one), in batches of
    `micro`: the loss of the whole split, not of a sample."""
    from ..data.windows import inputs_and_targets
    starts = np.arange(0, len(tokens) - seq_len - 1, seq_len, dtype=np.int64)
    return _LazyBatches(tokens, starts, seq_len, micro, inputs_and_targets)


class _LazyBatches:
    """Batches cut on demand: a split of billions of tokens is never held in memory at once."""

    def __init__(self, tokens, starts, seq_len, micro, cut):
        self.tokens, self.starts, self.seq_len, self.micro, self.cut = \
            tokens, starts, seq_len, micro, cut

    def __len__(self) -> int:
        return (len(self.starts) + self.micro - 1) // self.micro

    def __getitem__(self, i: int):
        return self.cut(self.tokens, self.starts[i * self.micro:(i + 1) * self.micro],
                        self.seq_len)


def logged_val_loss(run_dir: str, step: int) -> float | None:
    """The val/loss the training loop logged at `step` in run_dir/metrics.jsonl (its last such
    row: a resumed run may have logged a step twice), or None."""
    from ..observe.metrics_file import read_rows
    try:
        rows = read_rows(run_dir)
    except (OSError, UnicodeDecodeError):
        return None
    found = None
    for row in rows:
        if row.get("step") == step and "val/loss" in row:
            found = float(row["val/loss"])
    return found


def evaluate(path: str, split: str = "val", sequences: int | None = None, whole: bool = False,
             micro: int | None = None, data_dir: str | None = None, dataset: str | None = None,
             device: str = "auto", log=print, warn=print) -> dict:
    """Loss and perplexity of the model of `path` (a checkpoint or a run directory) on a split
    of its run's data, as the training loop evaluates it: the same windows (eval_sequences of
    them, evenly spread) in the same micro-batches and precision. `whole` takes every window of
    the split instead. BadInput for bad input."""
    from ..data.loader import load_splits
    from ..data.windows import val_batches
    from ..errors import BadInput
    from . import trained
    dev = trained.pick_device(device)
    t = trained.load(path, dev, warn=warn, info=log)
    import dataclasses
    cfg = dataclasses.replace(t.cfg, **{k: v for k, v in dict(data_dir=data_dir,
                                                            dataset=dataset).items()
                                        if v is not None})
    from ..config.load import section
    splits = load_splits(section(cfg, "data"), log)
    if splits.vocab_size > t.mcfg.vocab_size:
        raise BadInput(f"dataset '{cfg.dataset}' has a vocabulary of {splits.vocab_size:,}; "
                          f"the model knows {t.mcfg.vocab_size:,} ids")
    tokens = splits.val if split == "val" else splits.train
    micro = micro or int(t.derived.get("micro_batch_size") or 8)
    n = sequences or cfg.eval_sequences
    batches = whole_split_batches(tokens, cfg.seq_len, micro) if whole else \
        val_batches(tokens, cfg.seq_len, n, micro)
    model, context = _eval_precision(t, dev, warn)
    what = f"every window of the {split} split" if whole else \
        f"{n:,} {split} sequences evenly spread"
    log(f"evaluating {t.describe()} on {what} ({len(batches):,} batches of {micro} × "
        f"{cfg.seq_len} tokens) on {dev.type}")
    t0, last = time.time(), [time.time()]

    def progress(done: int) -> None:
        if time.time() - last[0] > 10:
            last[0] = time.time()
            log(f"  {min(done, len(batches)):,}/{len(batches):,} batches")

    with torch.no_grad():
        total = token_loss_sums(model, batches, dev, context, progress=progress)
    loss = (total[0] / total[1]).item()
    result = {"checkpoint": t.path, "step": t.step, "split": split, "dataset": cfg.dataset,
              "sequences": "all" if whole else n, "tokens": int(total[1].item()),
              f"{split}/loss": loss, f"{split}/ppl": math.exp(min(loss, 50.0)),
              "seconds": round(time.time() - t0, 2)}
    same_as_run = split == "val" and not whole and n == cfg.eval_sequences and dataset is None
    run_dir = os.path.dirname(os.path.dirname(t.path))
    logged = logged_val_loss(run_dir, t.step) if same_as_run else None
    if logged is not None:
        result["logged_val_loss"] = logged
    return result


def _eval_precision(t, device, warn):
    """The model and forward context the training loop evaluated with: the base precision's
    autocast on a GPU, and FP8 when the run evaluated in FP8 (fp8_eval) and FP8 can run here."""
    from ..precision import build_precision
    from .trained import autocast, load_weights, read_state
    cfg = t.cfg
    prec = None
    if cfg.use_fp8 and cfg.fp8_eval:   # fall back quietly: the warning below says what it means
        # fp8 auto: the recipe the run trained with (its derived values)
        prec = build_precision(dataclasses.replace(cfg, fp8_fallback="bf16"), device,
                               lambda msg: None, chosen=t.derived)
    model = t.model
    if prec is not None and prec.fp8:
        prec.resume_layers(t.derived)
        model = prec.convert(model)
        load_weights(model, {k: v.to(device) for k, v in read_state(t.path).items()}, t.path)
        model.to(device).eval()
    elif cfg.use_fp8 and cfg.fp8_eval:
        warn("the run evaluated in FP8 (fp8_eval), which cannot run here: this evaluation is in "
             "high precision and may differ slightly from the logged numbers")

    @contextlib.contextmanager
    def context():
        with autocast(cfg, device, warn), \
                (prec.forward_context(training=False) if prec is not None and prec.fp8
                 else contextlib.nullcontext()):
            yield
    return model, context
