"""ranks.Phase over two real processes (gloo, as on a CPU cluster): the ranks exchange their
results through the phase's own store whatever the collective timeout of the run's process
group, and a rank whose wait is interrupted (a stop signal's handler raising, as during
start-up) leaves at once, with the other rank still working and nothing left in flight."""
import os
import signal
import socket
import time
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int, out: str, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # the run's own group with a 2 s collective timeout: the phase must not depend on it
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=2))
    from fp8train.ranks import Phase

    class Interrupted(BaseException):
        pass

    def interrupt(signum, frame):
        raise Interrupted()

    t0 = time.monotonic()
    result = "none"
    try:
        with Phase("a test phase", 120) as phase:
            if mode == "slow":   # rank 0 works 6 s, three times the group's timeout
                values = phase.each(lambda: time.sleep(6 * (rank == 0)) or rank * 10)
                result = repr(values)
            else:                # rank 0 works a minute; rank 1 is interrupted after 1 s
                if rank == 1:
                    signal.signal(signal.SIGALRM, interrupt)
                    signal.alarm(1)
                phase.each(lambda: time.sleep(60 * (rank == 0)) or rank)
    except Interrupted:
        result = "interrupted"
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as fh:
        fh.write(f"{result} {time.monotonic() - t0:.1f}")
    if mode == "slow":
        dist.destroy_process_group()
    else:
        os._exit(0)   # rank 0 is still sleeping: rank 1 leaves without a collective


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_working_past_the_groups_timeout_is_waited_for(tmp_path):
    mp.spawn(_rank, args=(_port(), str(tmp_path), "slow"), nprocs=2)
    for rank in (0, 1):
        result, seconds = (tmp_path / f"rank{rank}.txt").read_text().rsplit(" ", 1)
        assert result == "[0, 10]" and float(seconds) >= 5.5


def test_an_interrupted_wait_leaves_at_once(tmp_path):
    ctx = mp.spawn(_rank, args=(_port(), str(tmp_path), "signal"), nprocs=2, join=False)
    t0 = time.monotonic()
    while not (tmp_path / "rank1.txt").exists():
        assert time.monotonic() - t0 < 30, "rank 1 still waits"
        time.sleep(0.1)
    result, seconds = (tmp_path / "rank1.txt").read_text().rsplit(" ", 1)
    assert result == "interrupted" and float(seconds) < 5
    for p in ctx.processes:
        p.kill()
