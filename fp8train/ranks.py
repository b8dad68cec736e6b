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
                      stop signal could not interrupt it): the values go through a key-value
                      store of the phase's own, set up when the phase starts (every rank in
                      step), and the wait for the slowest rank polls, bounded by `seconds`, so
                      the stop signal's handler (which raises during start-up) ends it at once.
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
    mine, error = _attempt(compute) if rank == 0 else (None, None)
    return _settled(gather_fn(mine)[0], f"{what or 'a step'} failed on rank 0", hint, error)


def _attempt(compute: Callable[[], T]):
    """(outcome, exception): the outcome ("ok", value), ("config", a BadInput's message) or
    ("error", the error in one line), picklable, and the exception itself, if any."""
    try:
        return ("ok", compute()), None
    except BadInput as e:
        return ("config", str(e)), None
    except Exception as e:  # reported on every rank by _settled
        return ("error", one_line(e, with_type=True)), e


def _settled(outcome, failed: str, hint: str, error: Optional[BaseException]):
    """An outcome of _attempt as a value, or raised: a BadInput with its message, any other
    error as RankFailed "<failed>: <error><hint>" (the original as its cause where known)."""
    status, value = outcome
    if status == "config":
        raise BadInput(value)
    if status == "error":
        raise RankFailed(f"{failed}: {value}{hint}") from error
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
    docstring). Use as a context manager.

    The exchange goes through a key-value store of the phase's own (torch.distributed's
    TCPStore, served by rank 0 on a free port of the address the ranks met at, MASTER_ADDR):
    each rank writes its value and polls until every rank's is there. Nothing is ever left in
    flight: a rank that stops (a signal, a timeout) leaves at once, and no new process group
    (whose gloo transport may not reach other nodes) is made. Rank 0 keeps the store until
    every rank has read, within the phase's bound."""

    POLL_S = 0.05

    def __init__(self, what: str, seconds: float):
        self.what, self.seconds = what, seconds
        self.rank, self.world = rank_world()
        self.store = None
        self.started = time.monotonic()
        if self.world > 1:
            self._open()

    def _open(self) -> None:
        import os
        import socket
        from datetime import timedelta

        import torch.distributed as dist
        timeout = timedelta(seconds=self.seconds)
        address = [None, None]
        if self.rank == 0:   # every rank is here at once: the broadcast is immediate
            host = os.environ.get("MASTER_ADDR") or socket.gethostname()
            self.store = dist.TCPStore(host, 0, self.world, is_master=True, timeout=timeout,
                                       wait_for_workers=False)
            address = [host, self.store.port]
        dist.broadcast_object_list(address, src=0)
        if self.rank != 0:
            self.store = dist.TCPStore(address[0], address[1], self.world, is_master=False,
                                       timeout=timeout)

    def __enter__(self) -> "Phase":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.store is not None and self.rank == 0 and exc_type is None:
            # the store lives in this process: keep it until every rank has read
            self._wait(lambda: self.store.add("read", 0) >= self.world, "read the result")
        self.store = None

    def each(self, compute: Callable[[], T], hint: str = "") -> list:
        """`compute()` on every rank; every rank gets the list of values in rank order. A
        BadInput on any rank is raised on every rank with its message; any other error becomes
        a RankFailed "<what> failed on rank N: <error><hint>"."""
        mine, error = _attempt(compute)
        return [_settled(outcome, f"{self.what} failed on rank {rank}", hint,
                         error if rank == self.rank else None)
                for rank, outcome in enumerate(self.gather(mine))]

    def gather(self, obj: Any) -> list:
        """Every rank's `obj` (picklable), in rank order, waiting at most the phase's seconds
        (from its start) for the slowest rank."""
        if self.world == 1:
            return [obj]
        import pickle
        keys = [f"value/{r}" for r in range(self.world)]
        self.store.set(keys[self.rank], pickle.dumps(obj))
        self._wait(lambda: self.store.check(keys), "finish")
        values = [pickle.loads(self.store.get(k)) for k in keys]
        self.store.add("read", 1)
        return values

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        """Poll `done` until it holds; a signal's handler runs (and raises) in the sleep."""
        while not done():
            if time.monotonic() - self.started > self.seconds:
                raise RankFailed(f"{self.what}: a rank did not {what} within "
                                 f"{self.seconds:.0f} s")
            time.sleep(self.POLL_S)
