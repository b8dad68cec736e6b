"""Command-line entry: parse and validate the config, check the paths it names (preflight.py; no
torch import yet), then train.

Exit codes (errors.py): 0 done, 2 bad config or input (one line on stderr), 3 stopped by a
signal after a checkpoint, 1 anything else (a run that cannot go on says why in one line).
"""
from __future__ import annotations

import os
import sys

from ..config.load import HelpRequested, help_text, load_config
from ..errors import EXIT_OK, BadInput, report, run_reported
from . import preflight, threads


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


# Without arguments nothing is trained: the defaults alone are a GPT-2 124M run, never what a
# first try means.
NO_ARGUMENTS = ("no config given; usage: train_fp8.py --config FILE [--key=value ...], e.g. "
                "--config configs/test_fp8.yaml (the CPU demo; other shipped configs are in "
                "configs/); --help lists every key")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if not argv:
            raise BadInput(NO_ARGUMENTS)
        cfg = preflight.check(load_config(argv))
    except HelpRequested:
        print(help_text())
        return EXIT_OK
    except BadInput as e:
        return report(e, show=_is_rank0())
    # Must be set before torch initialises CUDA: fewer fragmentation OOMs on long runs.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # ... and before torch loads OpenMP: its threads sleep rather than spin when they wait, so
    # that a CPU shared with another busy process slows down in proportion (threads.py).
    threads.apply()
    from ..batch.plan import memory_hint
    from .signals import Stopped, StopRequests

    # Stop signals are handled from here on, torch's import included (signals.py).
    with StopRequests(announce=_is_rank0()) as requests:
        try:
            from .loop import train  # heavy imports only once the config is good
            return run_reported(lambda: train(cfg, requests), show=_is_rank0(),
                                memory_hint=memory_hint(cfg))
        except Stopped as e:   # before the run's train.log was open
            return e.report(show=_is_rank0())
        finally:
            _close_process_group()


def _close_process_group() -> None:
    """Leave the process group explicitly: a rank that exits with it still open can abort at
    interpreter shutdown and turn a clean exit code into SIGABRT."""
    dist = sys.modules.get("torch.distributed")   # not imported (a stop during the import): none
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
