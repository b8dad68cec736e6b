"""The run's plan: every decision made at start, once, in order, and frozen (`RunPlan`).

1. The batch plan: as written, the resumed checkpoint's micro-batch, or the micro-batch that
   fits and is fastest, probed (batch/decide.py).
2. With fp8_recipe / fp8_backend auto, the FP8 recipe: chosen at the planned token count, its
   numerics checked on the model's own activations (precision/choose.py); when the choice
   changed the backend of a probed plan, the batch plan is probed again for its memory.
3. The run's length in optimizer steps, its warmup, the LR schedule and its peak (scaled with
   the batch), and the step of fp8_until's hand-over.

A resume reads the checkpoint's derived values (its config.yaml's `derived` section) once, and
each decision takes what it needs from them: the micro-batch, the recipe fp8 auto chose, the
layers fp8_layers auto kept, the schedule's length (a change is warned about). The plan is
written to the run's config.yaml in turn. build.py then only constructs, each component from
its section of the config and the plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..batch.decide import BatchDecision, decide_batch, new_model
from ..batch.plan import BatchPlan
from ..config.load import Config
from ..config.validate import set_with_or_after
from ..errors import BadInput
from ..observe.logger import Logger
from ..optim.schedule import describe as describe_schedule
from ..optim.schedule import fp8_until_step, scaled_lr
from ..precision import Fp8Spec, Precision, choose


@dataclass(frozen=True)
class RunPlan:
    """What the run decided at start, once."""
    batch: BatchDecision       # micro × accumulation × world, how it was decided, AC, timings
    length: "RunLength"        # the steps, the schedule's length, the warmup
    lr_args: dict              # lr_at's arguments but the step
    fp8_until_step: Optional[int]   # from this step on, the base precision (fp8_until)
    saved: dict                # the resumed checkpoint's derived values ({}: a fresh run)
    # The FP8 spec as decided: backend and recipe, and how (spec.decided: as the config names
    # them, chosen by fp8 auto, its default, or the resumed run's); None without FP8. Which
    # layers go to FP8 is decided when the model is converted (fp8_layers auto times them).
    fp8: Optional[Fp8Spec] = None


def decide(cfg: Config, prec: Precision, acc, mcfg, train_tokens, written: "BatchPlan | None",
           saved: dict, run_dir: str, log: Logger) -> "tuple[Precision, RunPlan]":
    """The run's plan, and its precision (fp8 auto's choice, or `prec` as built). `written`:
    the batch plan as the config writes it (None: discovered); `saved`: the resumed
    checkpoint's derived values ({} for a fresh run); `train_tokens`: the training split."""
    batch = decide_batch(cfg, written, mcfg, prec, acc, saved, run_dir, log)
    prec, batch = _choose_fp8(cfg, prec, acc, mcfg, batch, written, saved, run_dir, log,
                              train_tokens)
    plan = batch.plan
    max_lr, lr_note = scaled_lr(cfg.learning_rate, cfg.lr_scaling, plan.effective,
                                cfg.lr_reference_batch_size)
    sched = run_length(cfg, len(train_tokens), plan)
    log.msg(plan.describe(cfg.seq_len) + (f"; {batch.note}" if batch.note else ""))
    if lr_note:
        log.msg(lr_note)
    for note in filter(None, (sched.warmup_note, sched.fp8_until_note)):
        log.warn(note)
    lr_args = dict(max_lr=max_lr, warmup_steps=sched.warmup_steps, total_steps=sched.lr_steps,
                   min_lr_ratio=cfg.min_lr_ratio, schedule=cfg.lr_schedule,
                   decay_fraction=cfg.lr_decay_fraction, decay_shape=cfg.lr_decay_shape)
    after = describe_schedule(cfg.lr_schedule, cfg.min_lr_ratio, max_lr, cfg.lr_decay_fraction,
                              cfg.lr_decay_shape)
    log.msg(f"schedule: {sched.total_steps:,} steps ({sched.steps_per_epoch:,} per epoch), "
            f"warmup {sched.warmup_steps}, {after} at step {sched.lr_steps:,}")
    until = fp8_until_step(cfg.fp8_until, sched.lr_steps) if cfg.use_fp8 else None
    return prec, RunPlan(batch, sched, lr_args, until, dict(saved),
                         prec.spec if prec.fp8 else None)


# --- the run's length ---------------------------------------------------------------------------

@dataclass(frozen=True)
class RunLength:
    total_steps: int        # when training stops (epochs / max_steps)
    lr_steps: int           # length of the LR schedule
    steps_per_epoch: int
    warmup_steps: int       # the warmup the schedule uses: the config's, or shortened
    warmup_note: str = ""   # why it was shortened (a warning), or ""
    fp8_until_note: str = ""  # fp8_until at or past the last step, or an old run's 1 (a warning)


# A warmup not shorter than its schedule becomes this fraction of it: a short run of a longer
# config (`--max_steps=20` over a warmup of 30) still warms up, and still decays.
SHORTENED_WARMUP = 0.1


def run_length(cfg: Config, train_tokens: int, plan: BatchPlan) -> RunLength:
    tokens_per_step = plan.effective * cfg.seq_len
    steps_per_epoch = max(1, math.ceil(train_tokens / tokens_per_step))
    candidates = [s for s in (
        math.ceil(cfg.num_epochs * steps_per_epoch) if cfg.num_epochs else None,
        cfg.max_steps) if s is not None]
    total = min(candidates)
    lr_steps = cfg.lr_decay_steps or total
    warmup, note = cfg.warmup_steps, ""
    by_epochs = not cfg.lr_decay_steps and lr_steps != cfg.max_steps
    if warmup >= lr_steps and by_epochs and set_with_or_after(cfg, "warmup_steps", "num_epochs"):
        # As for max_steps (config/validate.py): a length set with the warmup, or after it, means
        # both, and they contradict each other. Epochs become steps only now, with the data.
        raise BadInput(f"{cfg.where('warmup_steps', 'num_epochs')}: key 'warmup_steps' "
                          f"({cfg.warmup_steps}) must be smaller than the run's total steps "
                          f"(num_epochs {cfg.num_epochs} × {steps_per_epoch} steps/epoch = "
                          f"{lr_steps}): the LR would never decay")
    if warmup >= lr_steps:     # the contradictions above, and in config/validate.py, were refused
        warmup = int(lr_steps * SHORTENED_WARMUP)
        what = "lr_decay_steps" if cfg.lr_decay_steps else "the run's"
        note = (f"warmup_steps ({cfg.warmup_steps}, "
                f"{cfg.origins.get('warmup_steps', 'the default')}) is not shorter "
                f"than {what} {lr_steps} steps: warming up for {warmup} steps instead "
                f"({SHORTENED_WARMUP:.0%} of the schedule)")
    return RunLength(total, lr_steps, steps_per_epoch, warmup, note,
                     _fp8_until_note(cfg, total, lr_steps, steps_per_epoch))


def _fp8_until_note(cfg: Config, total: int, lr_steps: int, per_epoch: int) -> str:
    """fp8_until's hand-over at or after the run's last step would leave FP8 on to the end:
    refused when fp8_until was set with the run's length or after it (config/validate.py
    refuses what the config alone shows; a length from num_epochs is known only now), a
    warning when the length was set later (a short run of a config with a cool-down). Also the
    warning for `fp8_until: 1` in a run's own config.yaml, kept as the step it meant then."""
    step = fp8_until_step(cfg.fp8_until, lr_steps) if cfg.use_fp8 else None
    if step == 1 and cfg.fp8_until == 1:   # only from a run's own config.yaml: validate.py
        return ("key 'fp8_until' is 1 in the run's own config.yaml, written by an fp8train that "
                "read it as step 1: kept, so FP8 runs for the first step only, then the base "
                "precision; remove the line for FP8 to the end")
    if step is None or step < total:
        return ""
    lengths = [k for k in ("num_epochs", "max_steps", "lr_decay_steps")
               if getattr(cfg, k) is not None]
    what = (f"num_epochs {cfg.num_epochs:g} × {per_epoch:,} steps/epoch" if total != cfg.max_steps
            else "max_steps") + (f"; {cfg.fp8_until:g} of lr_decay_steps {lr_steps:,}"
                                 if cfg.fp8_until < 1 and cfg.lr_decay_steps else "")
    said = (f"key 'fp8_until' ({cfg.fp8_until:g}) hands FP8 over at step {step:,}, but the run "
            f"ends at step {total:,} ({what}), so FP8 runs to the end")
    if set_with_or_after(cfg, "fp8_until", *lengths):
        raise BadInput(f"{cfg.where('fp8_until', *lengths)}: {said}; remove fp8_until, or give "
                       f"a step below {total:,} or a fraction below 1")
    return f"{said} ({cfg.origins.get('fp8_until')} set it before the run's length)"


# --- fp8_recipe / fp8_backend auto --------------------------------------------------------------

def _choose_fp8(cfg: Config, prec: Precision, acc, mcfg, batch: BatchDecision, written,
                saved: dict, run_dir: str, log: Logger,
                train_tokens) -> "tuple[Precision, BatchDecision]":
    """fp8_recipe / fp8_backend auto (precision/choose.py), at the planned token count, its
    numerics checked on the model's own activations (the first micro-batch of `train_tokens`);
    a probed batch plan is probed again for the chosen backend's memory (the cache keys on
    it)."""
    if not prec.auto:
        return prec, batch
    prec.set_tokens(batch.plan.micro * cfg.seq_len, log.msg)
    with torch.device("meta"):   # the Linears' shapes, nothing allocated
        shapes = new_model(mcfg, False)

    # The model's own activations at each shape: a forward and backward of the freshly
    # initialised model (activation checkpointing as the plan has it) on the first sequences.
    sample = prec.model_sample(lambda: new_model(mcfg, batch.activation_checkpointing),
                               train_tokens, batch.plan.micro, cfg.seq_len, acc.device)

    # Under FSDP the whole model may not fit one GPU: the numerics take Gaussian noise there.
    sharded = acc.distributed_type == "FSDP"
    chosen = choose(prec, shapes, saved or None, log.msg, log.warn, device=acc.device,
                    sample=None if sharded else sample)
    if chosen is not prec and written is None and not saved:
        log.msg(f"fp8 auto: the batch plan again, for {chosen.name}")
        batch = decide_batch(cfg, written, mcfg, chosen, acc, saved, run_dir, log)
    return chosen, batch
