"""train_fp8.py whose fp8 auto choice times on a CPU, slowly, installed from outside the package:
the tests of the choice's agreement between ranks run this instead of train_fp8.py.

    FP8TRAIN_CHOICE_SECONDS="3,0"   each FP8 timing of rank i sleeps the i-th value (the last
                                    repeats), then reports made-up timings (the base 3 ms per
                                    shape, native current 1 ms, delayed 2 ms); the numerics pass
    FP8TRAIN_PG_TIMEOUT_S=5         the default process group's collective timeout (torch's
                                    default is 30 minutes on gloo, NCCL's 10): a rank waiting
                                    in one of its collectives longer than this fails
    FP8TRAIN_CHOICE_STARTED=PATH    a file each rank creates when its timing starts
"""
import os
import sys
import time
from datetime import timedelta


def install() -> None:
    import torch.distributed as dist

    from fp8train.precision.timing import Timed
    from fp8train.train import plan

    timeout = os.environ.get("FP8TRAIN_PG_TIMEOUT_S")
    if timeout:
        init = dist.init_process_group

        def short_init(*args, **kw):
            kw.setdefault("timeout", timedelta(seconds=float(timeout)))
            return init(*args, **kw)

        dist.init_process_group = short_init

    seconds = [float(x) for x in os.environ.get("FP8TRAIN_CHOICE_SECONDS", "0").split(",")]
    started = os.environ.get("FP8TRAIN_CHOICE_STARTED")

    class SleepyTimer:
        graphs = 0

        def base(self, shape):
            return Timed(3e-3, 3e-4)

        def fp8(self, backend, shape):
            rank = dist.get_rank() if dist.is_initialized() else 0
            if started:
                open(f"{started}.{rank}", "w").close()
            time.sleep(seconds[min(rank, len(seconds) - 1)])
            return Timed(1e-3 if backend.spec.recipe == "current" else 2e-3, 1e-4)

        def forget(self):
            pass

    choose = plan.choose

    def slow_choose(*args, **kw):
        return choose(*args, **dict(kw, timer=SleepyTimer(),
                                    numerics_for=lambda backend: (0.03, 0.07)))

    plan.choose = slow_choose


if __name__ == "__main__":
    install()
    from fp8train.train.cli import main
    sys.exit(main())
