"""The micro-batch probe under FSDP2: the footprint of a sharded run, from measured parts.

A probe trial trains an unsharded copy of the model on each rank (a trial has no collectives:
fit.py), so its peak holds every parameter, gradient and optimizer moment whole. Under FSDP2
(fully_shard per Block, the rest in the root unit; Accelerate's TRANSFORMER_BASED_WRAP with
`Block`, accelerate_configs/fsdp_8xh100.yaml) a rank holds instead:

- its 1/N share of that state: fp32 parameters, gradients and AdamW's two moments (Muon is
  refused under FSDP), each padded to a multiple of N elements, as fully_shard pads dim 0;
- the units gathered whole at once, in the all-gather dtype (the mixed-precision param dtype,
  bf16 on a GPU; fp32 otherwise): the root unit (embeddings, final norm, tied head), which
  FSDP2 keeps gathered from forward to backward (torch sets reshard_after_forward False for the
  root), and two Blocks (the one computing and the one backward prefetches);
- unsharded gradients in the reduce dtype: with gradient accumulation, Accelerate's
  accumulate runs the micro-steps before the last without gradient sync (no_sync), and FSDP2
  then keeps every unit's unsharded gradient until the last one: the whole model's; plus a
  Block's reduce-scatter input in flight. Counted whether or not the run accumulates;
- the activations, which sharding does not change: the trial measured them.

The trial keeps its gradients allocated (make_trial's keep_grads), so its peak holds the
whole state at the start of backward, where the peak is; counting the sharded gradients as
resident there too overcounts by one share (they exist only after the first reduce-scatter).
Not measured by any trial: NCCL's own buffers, outside torch's allocator (memory_headroom
covers them). Reviewed against torch 2.13's fully_shard and Accelerate 1.15's FSDP2 prepare.

So a trial's peak P becomes P - state + ceil(state / N) + gathered. Every part is measured from
the model itself (its units' parameter counts and dtypes); the result is checked against a real
FSDP2 step over two gloo ranks by tests/e2e/test_fsdp_batch.py."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

# Whole state per fp32 parameter element: the parameter, its gradient, AdamW's two moments.
STATE_COPIES = 4


@dataclass(frozen=True)
class Sharding:
    world: int
    state_bytes: int      # the parameters, gradients and optimizer moments, whole
    shard_bytes: int      # one rank's share of them, padding included
    gathered_bytes: int   # the units held whole at once, and the unsharded gradients

    def footprint(self, unsharded_peak: int) -> int:
        """A rank's peak under FSDP2, from a trial's unsharded peak."""
        return int(unsharded_peak - self.state_bytes + self.shard_bytes + self.gathered_bytes)

    def describe(self) -> str:
        gb = 1e9
        return (f"batch discovery under FSDP2 ({self.world} ranks): each trial's unsharded peak "
                f"counted as sharded: the whole state ({self.state_bytes / gb:.3f} GB of "
                f"parameters, gradients and AdamW moments) replaced by one rank's share "
                f"({self.shard_bytes / gb:.3f} GB) plus the units gathered at once "
                f"({self.gathered_bytes / gb:.3f} GB: the root and two Blocks, and the "
                f"unsharded gradients of accumulation)")


def units(model: nn.Module) -> "tuple[list, list]":
    """(the Blocks' parameter lists, the root unit's parameters): what fully_shard per Block
    and on the root leaves in each unit (parameters shared between units counted once, in the
    first)."""
    blocks = [list(b.parameters()) for b in model.blocks]
    in_blocks = {id(p) for ps in blocks for p in ps}
    seen, root = set(), []
    for p in model.parameters():
        if id(p) not in in_blocks and id(p) not in seen:
            seen.add(id(p))
            root.append(p)
    return blocks, root


def sharding(model: nn.Module, world: int, gather_dtype: torch.dtype,
             reduce_dtype: torch.dtype) -> Sharding:
    """The accounting for `model` (on any device, meta included) sharded over `world` ranks."""
    blocks, root = units(model)
    params = [p for ps in blocks for p in ps] + root
    state = STATE_COPIES * sum(p.numel() * p.element_size() for p in params)
    shard = STATE_COPIES * sum(math.ceil(p.shape[0] / world) * (p.numel() // max(p.shape[0], 1))
                               * p.element_size() if p.dim() else p.element_size()
                               for p in params)
    largest_block = max((sum(p.numel() for p in ps) for ps in blocks), default=0)
    everything = sum(p.numel() for p in params)
    gathered = _size(gather_dtype) * (sum(p.numel() for p in root) + 2 * largest_block) + \
        _size(reduce_dtype) * (everything + largest_block)
    return Sharding(world, state, shard, gathered)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def fsdp_dtypes(mixed_precision: str, cuda: bool) -> "tuple[torch.dtype, torch.dtype]":
    """(all-gather dtype, reduce dtype) as fp8train sets FSDP2 up (train/build.py's
    fsdp2_plugin: the base precision's dtype for both on a GPU in bf16/fp16; fp32 otherwise)."""
    if cuda and mixed_precision in ("bf16", "fp16"):
        dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
        return dtype, dtype
    return torch.float32, torch.float32


def as_sharded(sharded: "Sharding | None", trial):
    """A probe trial (fit.make_trial) whose peaks are counted as sharded; `trial` itself when
    the run is not sharded."""
    if sharded is None:
        return trial
    import dataclasses

    def sharded_trial(micro: int) -> int:
        return sharded.footprint(trial(micro))

    def timed(micro: int, steps: int):
        times = trial.timed(micro, steps)
        return dataclasses.replace(times, peak=sharded.footprint(times.peak))

    sharded_trial.timed = timed
    return sharded_trial
