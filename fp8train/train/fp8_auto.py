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
        from ..precision.numerics import capture
        n = batch.plan.micro * (cfg.seq_len + 1)
        tokens = torch.as_tensor(np.asarray(train_tokens[:n], dtype=np.int64))
        with torch.random.fork_rng(devices=[acc.device] if acc.device.type == "cuda" else []):
            model = new_model(mcfg, False).to(acc.device)   # the seeded init, as the run's
            try:
                return capture(model, tokens.view(batch.plan.micro, -1), prec.base, wanted)
            finally:
                del model

    chosen = choose(cfg, prec, shapes, saved_derived(checkpoint) if checkpoint else None,
                    log.msg, log.warn, lambda c: build_precision(c, acc.device, log.warn, run_dir),
                    run_dir, device=acc.device, sample=sample)
    if chosen is not prec and written is None and checkpoint is None:
        log.msg(f"fp8 auto: the batch plan again, for {chosen.name}")
        batch = decide_batch(cfg, written, mcfg, chosen, acc, checkpoint, run_dir, log)
    return chosen, batch
