"""Muon's update (Keller Jordan, 2024) for the hidden matrices, made to scale: same-shape
matrices orthogonalised together, each data-parallel rank doing its share.

Muon updates a matrix with its Nesterov momentum orthogonalised by a quintic Newton-Schulz
iteration, scaled by sqrt(max(1, rows / cols)); the coefficients and steps are
torch.optim.Muon's. Done one matrix at a time, that is about 31 small kernels per matrix
(2,000 a step for a 1B Llama), and every data-parallel rank repeats all of it on the same
averaged gradients. So a step here goes, per bucket of same-shape matrices:

1. Momentum: every rank updates every matrix's momentum buffer (elementwise; the checkpoint,
   written by rank 0, then holds every buffer) and blends the Nesterov input of its own share.
2. Newton-Schulz: the rank's share of the bucket, stacked into one (k, m, n) batch,
   orthogonalised by batched matrix products (one call per bucket, not per matrix).
3. All-gather: with `shared` (data-parallel ranks, identical gradients) each rank has
   orthogonalised ceil(K / world) of the bucket's K matrices; one all-gather of the updates
   (bf16 on a GPU) gives every rank all of them, as modded-nanogpt's distributed Muon does.
4. Apply: weight decay and the scaled update, every matrix.

With `compiled` (the run's `compile: true`) the three computations are torch.compile'd with
static shapes, which fuses each bucket's elementwise work into a few kernels. `parts` names the
logical matrices inside fused projections (model.py's `fused_parts`: q, k and v in one
Linear; SwiGLU's gate and up): each part is then orthogonalised, scaled and decayed as a matrix
of its own (modded-nanogpt does so for its QKV), while its momentum buffer stays the
parameter's, so checkpoints are the same either way.

The iteration runs in bfloat16 on a GPU and in float32 on a CPU (`ns_dtype_for`: CPUs
without bfloat16 instructions emulate it, 20x slower).

A non-finite step (the loop's `found_inf`, 1.0: skip) is skipped on the device: its gradient
is read as 0 and every factor is 0, so nothing changes, as in the fused AdamW kernel; fp16's
GradScaler scale (`grad_scale`) is divided out first. Numbers as per matrix: bit for bit with
torch.optim.Muon for a matrix alone, and two ranks give one process's update (tested)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

# torch.optim.Muon's (and Keller Jordan's) quintic Newton-Schulz coefficients and step count.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def orthogonalise(x: torch.Tensor, steps: int = NS_STEPS,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The orthogonalised matrices of `x` (m, n) or (k, m, n): about U V^T of each one's SVD,
    singular values in ~[0.5, 1.5], by the quintic Newton-Schulz iteration in `dtype`
    (bfloat16: as torch.optim.Muon computes it for one matrix)."""
    a, b, c = NS_COEFFICIENTS
    x = x.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    mm = torch.addmm if x.dim() == 2 else torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        x = mm(x, mm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def momentum(grads: list, bufs: list, own: tuple, mom: float, inv_scale, bad, weight):
    """Each buffer moved toward its gradient by `weight` ((1 - momentum), 0 on a skipped step,
    whose gradient, `bad`, is read as 0; unscaled by `inv_scale` unless None); returns the
    Nesterov blends of the matrices at positions `own`, stacked (k, m, n), or None when `own`
    is empty."""
    zero = torch.zeros((), dtype=grads[0].dtype, device=grads[0].device)
    blends = []
    for i, (g, buf) in enumerate(zip(grads, bufs)):
        if inv_scale is not None:
            g = g * inv_scale
        g = torch.where(bad, zero, g)
        buf.lerp_(g, weight)
        if i in own:
            blends.append(g.lerp(buf, mom))
    return torch.stack(blends) if blends else None


def apply(params: list, updates: torch.Tensor, keep: torch.Tensor, step: torch.Tensor,
          scale: float) -> None:
    """Decoupled weight decay (x `keep`) and the orthogonalised update (x `step` x `scale`),
    each matrix in place."""
    for p, u in zip(params, updates.unbind(0)):
        p.mul_(keep).addcmul_(u, step, value=scale)


def ns_dtype_for(device: torch.device) -> torch.dtype:
    """bfloat16 on a GPU (Muon's own choice: its coefficients are tuned for it, and tensor
    cores run it fastest); float32 on a CPU, where most processors have no bfloat16 matrix
    instructions and emulate them: 870 ms of a 1.15 s demo step in bf16 on a 2-core EPYC
    without them, about 40 ms in fp32 (docs/records/benchmarks.md)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass
class Bucket:
    """K matrices of one shape: (param, first row, last row) views, and this rank's share."""
    shape: tuple
    items: list
    own: tuple            # positions this rank orthogonalises
    per_rank: int         # ceil(K / world): the all-gather's slice

    @property
    def scale(self) -> float:
        rows, cols = self.shape
        return math.sqrt(max(1.0, rows / cols))


def buckets_of(params: list, parts: dict, rank: int, world: int) -> list:
    """The matrices of `params` (split into their `parts` row counts) by shape, each bucket in
    parameter order, with rank `rank`'s share of `world` (contiguous positions)."""
    by_shape: dict = {}
    for p in params:
        start = 0
        for rows in parts.get(p, [p.shape[0]]):
            shape = (rows, p.shape[1])
            by_shape.setdefault((shape, p.dtype, p.device), []).append((p, start, start + rows))
            start += rows
    out = []
    for (shape, _, _), items in by_shape.items():
        per_rank = -(-len(items) // world)
        first = min(rank * per_rank, len(items))
        out.append(Bucket(shape, items, tuple(range(first, min(first + per_rank, len(items)))),
                          per_rank))
    return out


class MuonUpdate:
    """Muon's update of one parameter group (`group`: its params, lr, weight_decay, momentum)
    with the optimizer's per-parameter `state`. `rank`/`world`: this rank's share (world 1:
    no collective); `compiled`: the computations torch.compile'd with static shapes."""

    def __init__(self, parts: dict, rank: int = 0, world: int = 1, compiled: bool = False,
                 ns_dtype: Optional[torch.dtype] = None):
        self.parts, self.rank, self.world = parts, rank, world
        self.ns_dtype = ns_dtype   # None: by device (ns_dtype_for)
        self.fns = (momentum, orthogonalise, apply)
        if compiled:
            self.fns = tuple(torch.compile(f, dynamic=False) for f in self.fns)
        self.buckets: dict = {}   # the params with gradients -> their buckets
        # The learning rate and decay as CPU scalars filled each step: a compiled function
        # reads their values, not constants baked into its graph (no recompile per LR).
        self.lr, self.decay = torch.zeros(()), torch.zeros(())

    @torch.no_grad()
    def step(self, group: dict, state: dict, found_inf, grad_scale) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        key = tuple(id(p) for p in params)
        if key not in self.buckets:
            self.buckets[key] = buckets_of(params, self.parts, self.rank, self.world)
        device = params[0].device
        skip = torch.zeros((), device=device) if found_inf is None else \
            found_inf.to(device=device, dtype=torch.float32)
        inv_scale = None if grad_scale is None else \
            1.0 / grad_scale.to(device=device, dtype=torch.float32)
        ok = 1.0 - skip
        for p in params:
            if "momentum_buffer" not in state[p]:
                state[p]["momentum_buffer"] = torch.zeros_like(
                    p, memory_format=torch.preserve_format)
        # Steps applied, one counter shared by the group's states (AdamW's loading of a state
        # dict expects one in every state; Muon itself reads none).
        steps = state[params[0]].get("step")
        if steps is None:
            steps = torch.zeros((), device=device)
        for p in params:
            state[p]["step"] = steps
        steps.add_(ok)
        self.lr.fill_(group["lr"])
        self.decay.fill_(group["weight_decay"])
        # The step's factors, once: a skipped step (found_inf) multiplies every one by 0.
        bad, mom = skip > 0, group["momentum"]
        weight = (1.0 - mom) * ok
        keep = 1.0 - self.lr * self.decay * ok
        step = -self.lr * ok
        momentum_fn, orthogonalise_fn, apply_fn = self.fns
        dtype = self.ns_dtype or ns_dtype_for(device)
        for bucket in self.buckets[key]:
            grads = [p.grad[a:b] for p, a, b in bucket.items]
            bufs = [state[p]["momentum_buffer"][a:b] for p, a, b in bucket.items]
            blends = momentum_fn(grads, bufs, bucket.own, mom, inv_scale, bad, weight)
            mine = None if blends is None else orthogonalise_fn(blends, NS_STEPS, dtype)
            apply_fn([p[a:b] for p, a, b in bucket.items],
                     self._gathered(bucket, mine, device, dtype), keep, step, bucket.scale)

    def _gathered(self, bucket: Bucket, mine, device, dtype) -> torch.Tensor:
        """Every matrix's update of the bucket: this rank's own (world 1), or all of them
        gathered from every rank's share (padded to per_rank with zeros)."""
        k = len(bucket.items)
        if self.world == 1:
            return mine
        import torch.distributed as dist
        rows, cols = bucket.shape
        local = torch.zeros(bucket.per_rank, rows, cols, dtype=dtype, device=device)
        if mine is not None:
            local[:mine.shape[0]] = mine
        out = torch.empty(self.world * bucket.per_rank, rows, cols, dtype=dtype, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, local)
        return out[:k]

