"""fp8_recipe / fp8_backend auto at start-up, as the run assembles itself (build.py): the recipe
chosen (precision/choose.py) at the planned token count, its numerics checked on the model's own
activations, and the batch plan probed again when the choice changed the backend."""
from __future__ import annotations

import numpy as np
import torch

from ..batch.decide import BatchDecision, decide_batch, new_model
from ..checkpoint.saved_config import saved_derived
from ..config.load import Config
from ..observe.logger import Logger
from ..precision import Precision, build_precision
from ..precision.choose import choose, is_auto


def choose_fp8(cfg: Config, prec: Precision, acc, mcfg, batch: BatchDecision, written,
                checkpoint, run_dir: str, log: Logger,
                train_tokens) -> "tuple[Precision, BatchDecision]":
    """fp8_recipe / fp8_backend auto (precision/choose.py), at the planned token count, its
    numerics checked on the model's own activations (the first micro-batch of `train_tokens`);
    a probed batch plan is probed again for the chosen backend's memory (the cache keys on
    it)."""
    if not is_auto(cfg) or not prec.fp8:
        return prec, batch
    prec.set_tokens(batch.plan.micro * cfg.seq_len, log.msg)
    with torch.device("meta"):   # the Linears' shapes, nothing allocated
        shapes = new_model(mcfg, False)

    def sample(wanted):
        """The model's own activations at each shape: a forward and backward of the freshly
        initialised model (activation checkpointing as the plan has it) on the first training
        sequences, as many as the numerics keep rows of (8,192)."""
        from ..precision.numerics import ROWS, capture
        n = min(batch.plan.micro, -(-ROWS // cfg.seq_len))
        tokens = torch.as_tensor(np.asarray(train_tokens[:n * (cfg.seq_len + 1)],
                                            dtype=np.int64))
        with torch.random.fork_rng(devices=[acc.device] if acc.device.type == "cuda" else []):
            model = new_model(mcfg, batch.activation_checkpointing).to(acc.device)
            try:
                return capture(model, tokens.view(n, -1), prec.base, wanted)
            finally:
                del model

    # Under FSDP the whole model may not fit one GPU: the numerics take Gaussian noise there.
    sharded = acc.distributed_type == "FSDP"
    chosen = choose(cfg, prec, shapes, saved_derived(checkpoint) if checkpoint else None,
                    log.msg, log.warn, lambda c: build_precision(c, acc.device, log.warn, run_dir),
                    run_dir, device=acc.device, sample=None if sharded else sample)
    if chosen is not prec and written is None and checkpoint is None:
        log.msg(f"fp8 auto: the batch plan again, for {chosen.name}")
        batch = decide_batch(cfg, written, mcfg, chosen, acc, checkpoint, run_dir, log)
    return chosen, batch
