"""What every entry point (train_fp8.py, run_sweep.py, scripts/*.py) does the same way with the
console: a reader that stops reading (`--help | head`) ends the program quietly, and torchao's
import noise (and Accelerate's notice of tied weights) stays off it.

Standard library only, like errors.py: imported before anything heavy.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Callable

from ..errors import EXIT_FAILED, EXIT_OK


class _TorchaoImportNoise(logging.Filter):
    """Importing torchao logs each optional kernel library it cannot load on this machine, and
    torch logs torchao's Enum registrations as deprecated. Neither concerns a run: those two
    messages are dropped, every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ((msg.startswith("Failed to load ") and "torchao" in msg)
                    or "is an Enum subclass and is now natively supported" in msg)


def drop_torchao_import_noise() -> None:
    """Before torchao is imported: the FP8 backend, and loading an export back (transformers'
    quantizers import torchao when it is installed)."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _TorchaoImportNoise) for f in logger.filters):
            logger.addFilter(_TorchaoImportNoise())


class _TiedWeightNotice(logging.Filter):
    """Accelerate saves a tied weight (a transformers model's output layer that is its
    embedding) under one name and logs so at every checkpoint; fp8train loads it back tied."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Removed shared tensor" not in record.getMessage()


def drop_transformers_noise() -> None:
    """Before an hf: model is built: transformers imports torchao when it is installed, and
    the checkpoints of a model with tied embeddings would log the tie at every save."""
    drop_torchao_import_noise()
    logger = logging.getLogger("accelerate.utils.other")
    if not any(isinstance(f, _TiedWeightNotice) for f in logger.filters):
        logger.addFilter(_TiedWeightNotice())


def run_main(main: Callable[[], "int | None"]) -> int:
    """`main()`'s exit code. A closed stdout (BrokenPipeError) is no traceback: exit 0 when
    only help was asked for (the reader has what it wanted), else 1 (output was lost)."""
    try:
        code = main()
        sys.stdout.flush()      # a pipe closed after the last print fails here, not at exit
        return code or EXIT_OK
    except BrokenPipeError:
        # The interpreter flushes stdout once more at exit: let that write go nowhere.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        asked_for_help = any(a in ("-h", "--help") for a in sys.argv[1:])
        return EXIT_OK if asked_for_help else EXIT_FAILED
