"""Agreement between ranks: every decision that one rank makes (or that can fail on one rank) is
shared with all of them, so that they take the same path and none waits at a collective the
others skipped.

Three shapes, each one collective over the default process group (a single process does no
communication at all):
  on_rank0(compute)   rank 0 computes (a download, a checksum pass, a timing); every rank gets
                      its value, or raises its error
  first_error(error)  each rank's optional error message; every rank gets the first one
  agreed_max(value)   the largest of the ranks' integers (a stop request from any rank)

and a fourth for work that takes minutes (timing FP8 recipes and layer shapes, compiling):
  Phase(what, seconds).each(compute)   every rank computes its share; every rank gets all the
                      values, or the first error. No rank waits inside a collective of the
                      default process group (NCCL's 10-minute timeout would end the job, and a
                      stop signal could not interrupt it): the phase's collectives run on a CPU
                      (gloo) group of its own, made when the phase starts (every rank in step),
                      and the wait for the slowest rank polls, bounded by `seconds`, so the stop
                      signal's handler (which raises during start-up) ends it at once.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, TypeVar

from .errors import BadInput, one_line

T = TypeVar("T")


class RankFailed(RuntimeError):
    """An unexpected error on one rank, reported on every rank in one line."""


def rank_world() -> "tuple[int, int]":
    """(rank, world size) of the default process group; (0, 1) without one."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather(obj: Any) -> list:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    rank, world = rank_world()
    if world == 1:
        return [obj]
    import torch.distributed as dist
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def on_rank0(compute: Callable[[], T], what: str = "", hint: str = "", *,
             rank: Optional[int] = None, gather_fn: Optional[Callable[[Any], list]] = None) -> T:
    """`compute()` on rank 0 alone while the others wait; every rank returns its value. A
    BadInput there is raised on every rank with the same message; any other error becomes a
    RankFailed "<what> failed on rank 0: <error><hint>" (rank 0 keeps the original as its
    cause). `rank` and `gather_fn` default to the process group's (tests pass their own)."""
    rank = rank_world()[0] if rank is None else rank
    gather_fn = gather_fn or gather
    mine, error = None, None
    if rank == 0:
        try:
            mine = ("ok", compute())
        except BadInput as e:
            mine = ("config", str(e))
        except Exception as e:  # reported on every rank below
            error = e
            mine = ("error", one_line(e, with_type=True))
    status, value = gather_fn(mine)[0]
    if status == "config":
        raise BadInput(value)
    if status == "error":
        raise RankFailed(f"{what or 'a step'} failed on rank 0: {value}{hint}") from error
    return value


def first_error(error: Optional[str]) -> Optional[str]:
    """The first rank's error (by rank), prefixed with its rank unless it is rank 0; None when
    no rank failed."""
    for rank, e in enumerate(gather(error)):
        if e is not None:
            return e if rank == 0 else f"rank {rank}: {e}"
    return None


def agreed_max(value: int, device=None) -> int:
    """The largest of the ranks' values on every rank (one small all-reduce)."""
    _, world = rank_world()
    if world == 1:
        return value
    import torch
    import torch.distributed as dist
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


class Phase:
    """A start-up phase of long work on every rank, then one agreement (see the module's
    docstring). Use as a context manager (its CPU group is released on exit)."""

    POLL_S = 0.05

    def __init__(self, what: str, seconds: float):
        self.what, self.seconds = what, seconds
        self.rank, self.world = rank_world()
        self.group = None
        if self.world > 1:
            from datetime import timedelta

            import torch.distributed as dist
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
        self.started = time.monotonic()

    def __enter__(self) -> "Phase":
        return self

    def __exit__(self, *exc) -> None:
        if self.group is not None:
            import torch.distributed as dist
            dist.destroy_process_group(self.group)
            self.group = None

    def each(self, compute: Callable[[], T], hint: str = "") -> list:
        """`compute()` on every rank; every rank gets the list of values in rank order. A
        BadInput on any rank is raised on every rank with its message; any other error becomes
        a RankFailed "<what> failed on rank N: <error><hint>"."""
        error = None
        try:
            mine = ("ok", compute())
        except BadInput as e:
            mine = ("config", str(e))
        except Exception as e:  # reported on every rank below
            error = e
            mine = ("error", one_line(e, with_type=True))
        values = self.gather(mine)
        for rank, (status, value) in enumerate(values):
            if status == "config":
                raise BadInput(value)
            if status == "error":
                raise RankFailed(f"{self.what} failed on rank {rank}: {value}{hint}") from error
        return [value for _, value in values]

    def gather(self, obj: Any) -> list:
        """Every rank's `obj` (picklable), in rank order, waiting at most the phase's seconds
        (from its start) for the slowest rank."""
        if self.world == 1:
            return [obj]
        import pickle

        import torch
        payload = pickle.dumps(obj)
        sizes = self._all_gather(torch.tensor([len(payload)], dtype=torch.long))
        data = torch.zeros(max(int(s) for s in sizes), dtype=torch.uint8)
        data[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        parts = self._all_gather(data)
        return [pickle.loads(p[:int(s)].numpy().tobytes()) for p, s in zip(parts, sizes)]

    def _all_gather(self, tensor) -> list:
        import torch
        import torch.distributed as dist
        out = [torch.empty_like(tensor) for _ in range(self.world)]
        work = dist.all_gather(out, tensor, group=self.group, async_op=True)
        while not work.is_completed():   # a signal's handler runs (and raises) in the sleep
            if time.monotonic() - self.started > self.seconds:
                raise RankFailed(f"{self.what}: another rank did not finish within "
                                 f"{self.seconds:.0f} s")
            time.sleep(self.POLL_S)
        work.wait()
        return out
