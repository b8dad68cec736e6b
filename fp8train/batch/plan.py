"""The batch plan: micro-batch x gradient accumulation x world size = effective batch."""
from __future__ import annotations

from dataclasses import dataclass

from ..config.schema import Config
from ..errors import BadInput


@dataclass(frozen=True)
class BatchPlan:
    micro: int
    accum: int
    world: int

    @property
    def effective(self) -> int:
        return self.micro * self.accum * self.world

    def describe(self, seq_len: int) -> str:
        return (f"batch plan: micro {self.micro} × accum {self.accum} × {self.world} "
                f"{'device' if self.world == 1 else 'devices'} = {self.effective} sequences "
                f"({self.effective * seq_len:,} tokens) per step")


def nearest_valid_targets(target: int, divisor: int) -> list[int]:
    lo = target // divisor * divisor
    return sorted({v for v in (lo, lo + divisor) if v > 0})


def manual_plan(batch, world: int) -> BatchPlan:
    """Plan from batch_size, gradient_accumulation_steps and target_effective_batch_size as
    written (`batch`: the config's batch section); anything inconsistent is an error, never a
    silent adjustment."""
    micro, accum, target = batch.micro, batch.accumulation, batch.target
    src = batch.where("target_effective_batch_size", "batch_size", "gradient_accumulation_steps")
    if target is None:
        return BatchPlan(micro, accum or 1, world)
    per_step = micro * world
    if accum is None:
        if target % per_step:
            near = nearest_valid_targets(target, per_step)
            raise BadInput(
                f"{src}: key 'target_effective_batch_size' ({target}) is not a multiple of "
                f"batch_size × world size = {micro} × {world} = {per_step}; nearest valid: "
                f"{' or '.join(map(str, near))}")
        return BatchPlan(micro, target // per_step, world)
    if micro * accum * world != target:
        raise BadInput(
            f"{src}: batch_size × gradient_accumulation_steps × world size = {micro} × {accum} "
            f"× {world} = {micro * accum * world}, but target_effective_batch_size is {target}")
    return BatchPlan(micro, accum, world)


def memory_hint(cfg: Config) -> str:
    """The keys that set memory use, with their values: the tail of an out-of-memory line."""
    batch = (f"with auto_batch_size, lower max_batch_size (now {cfg.max_batch_size}) or raise "
             f"memory_headroom (now {cfg.memory_headroom:g})") if cfg.auto_batch_size else \
        f"lower batch_size (now {cfg.batch_size}; raise gradient_accumulation_steps to keep the " \
        "effective batch)"
    return (f"{batch}, lower seq_len (now {cfg.seq_len}), use a smaller model or "
            "activation_checkpointing: true")
