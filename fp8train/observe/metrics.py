"""Throughput, MFU and memory, computed in one place: the training row of each log interval
and the clock it is measured with."""
from __future__ import annotations

import contextlib
import time
from typing import Optional

# Dense bf16 tensor-core peaks (FLOP/s) from NVIDIA's datasheets, without sparsity, matched
# against torch.cuda.get_device_name() in order: more specific names first ("GH200" before
# "H200", "H100 PCIe" before "H100"). FP8 runs are measured against these bf16 peaks too (see
# peak_note): an FP8 MFU against the FP8 peak would halve the number for the same speed and
# hide whether FP8 made training faster.
PEAK_BF16_FLOPS = (
    ("GB200", "GB200", None),             # not a B200: no datasheet figure here, so no MFU
    ("GH200", "GH200", 989.4e12),
    ("H200 NVL", "H200 NVL", 835e12),
    ("H200", "H200 SXM", 989.4e12),
    ("H100 NVL", "H100 NVL", 835e12),
    ("H100 PCIe", "H100 PCIe", 756e12),
    ("H100", "H100 SXM", 989.4e12),      # "NVIDIA H100 80GB HBM3"
    ("B200", "B200", 2250e12),
    ("A100", "A100", 312e12),            # SXM and PCIe alike
)


def peak_flops(device_name: Optional[str]) -> Optional[float]:
    """bf16 dense peak of a known GPU; None for anything else (no MFU rather than a guess)."""
    found = _peak_entry(device_name)
    return found[2] if found else None


def is_mig(device_name: Optional[str]) -> bool:
    """A MIG slice ("NVIDIA H100 80GB HBM3 MIG 3g.40gb") has a fraction of the GPU's SMs: the
    datasheet peak of the whole GPU would understate its MFU by that fraction."""
    return bool(device_name) and " MIG " in f" {device_name} "


def _peak_entry(device_name: Optional[str]):
    if is_mig(device_name):
        return None
    for entry in PEAK_BF16_FLOPS:
        if device_name and entry[0] in device_name:
            return entry
    return None


def peak_note(device_name: Optional[str], fp8: bool) -> str:
    """Which peak train/mfu is measured against, said once at start and kept in config.yaml."""
    if is_mig(device_name):
        return (f"no MFU: '{device_name}' is a MIG slice, and the peak table holds whole GPUs; "
                "tokens/s is still measured")
    found = _peak_entry(device_name)
    if found is None or found[2] is None:
        return (f"no MFU: '{device_name}' is not in the peak table (H100/H200/GH200/B200/"
                "A100); tokens/s is still measured")
    note = f"MFU against the {found[1]} bf16 dense peak, {found[2] / 1e12:g} TFLOP/s"
    if fp8:
        note += " (FP8 run: MFU is against the bf16 peak, not the FP8 one)"
    return note


def mfu(flops_per_token: float, tokens_per_sec_per_device: float,
        peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation: the model's training FLOPs actually done per second on one
    device over that device's peak. Recomputation (activation checkpointing) is not counted:
    it is work, not progress."""
    if peak is None or tokens_per_sec_per_device <= 0:
        return None
    return flops_per_token * tokens_per_sec_per_device / peak


def throughput(tokens_per_step: int, steps: int, seconds: float, world: int,
               flops_per_token: float, peak: Optional[float]) -> dict:
    """train/tokens_per_sec (all devices), per device, step time and MFU over an interval of
    `steps` optimizer steps that took `seconds` of training time (eval excluded)."""
    tok_s = tokens_per_step * steps / seconds if seconds > 0 else 0.0
    row = {"train/tokens_per_sec": tok_s, "train/tokens_per_sec_per_device": tok_s / world,
           "train/step_time": seconds / steps if steps else 0.0}
    m = mfu(flops_per_token, tok_s / world, peak)
    if m is not None:
        row["train/mfu"] = m
    return row


class TrainClock:
    """Wall time spent in training steps. Paused around evaluation and checkpoints so that
    tokens/s and MFU describe training alone. Pausing waits for queued GPU work first (once per
    eval or checkpoint, never in the hot loop) so that it is billed to training."""

    def __init__(self, device, clock=time.perf_counter):
        """`clock()`: seconds, monotonic (time.perf_counter)."""
        self.device, self.clock = device, clock
        self.banked, self.t0 = 0.0, clock()

    def pause(self) -> None:
        if self.device.type == "cuda":
            import torch
            torch.cuda.synchronize(self.device)
        self.banked += self.clock() - self.t0

    def resume(self) -> None:
        self.t0 = self.clock()

    def collect(self) -> float:
        """While paused: the training seconds not yet taken, handed over (the run is ending)."""
        banked, self.banked = self.banked, 0.0
        return banked

    def take(self) -> float:
        """Training seconds since the last take(); call after a host sync."""
        now = self.clock()
        elapsed, self.banked, self.t0 = self.banked + now - self.t0, 0.0, now
        return elapsed


class PartClock:
    """The time of one part of a watched step (the optimizer step), on the device: CUDA events
    around it, read at the log step after its host sync (none added); the host clock on a CPU,
    where work is synchronous."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.events, self.seconds = None, None

    @contextlib.contextmanager
    def timed(self, on: bool):
        if not on:
            yield
            return
        if self.cuda:
            import torch
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            yield
            end.record()
            self.events = (start, end)
        else:
            t0 = time.perf_counter()
            yield
            self.seconds = time.perf_counter() - t0

    def take(self) -> Optional[float]:
        """Seconds of the part last timed (None: none since the last take)."""
        if self.events is not None:
            start, end = self.events
            end.synchronize()
            self.seconds = start.elapsed_time(end) / 1e3
        seconds, self.events, self.seconds = self.seconds, None, None
        return seconds


class WallClock:
    """Wall time of the run, resumes included: the checkpoint's total + this invocation's."""

    def __init__(self, base: float):
        self.base, self.started = base, time.time()

    def start(self) -> None:
        self.started = time.time()

    def __call__(self) -> float:
        return self.base + time.time() - self.started


class Meter:
    """The training row of one log interval: loss, LR, gradient norm, tokens/s and MFU over the
    interval's training time, the fraction of it spent waiting for data; memory. The first
    interval (compilation, warm-up) is left out of the steady-state totals the summary uses."""

    def __init__(self, log_interval: int, tokens_per_step: int, world: int,
                 flops_per_token: float, device, clock=time.perf_counter):
        """`clock()`: the training clock's seconds (TrainClock)."""
        self.log_interval = log_interval
        self.tokens_per_step, self.world, self.device = tokens_per_step, world, device
        self.flops_per_token = flops_per_token
        self.peak = peak_flops(device_name(device)) if device.type == "cuda" else None
        self.clock = TrainClock(device, clock)
        self.steps, self.data_wait, self.first = 0, 0.0, True
        self.untimed = 0      # steps of this interval whose time went to train_seconds only
        self.carried = 0      # steps of this interval taken before the checkpoint resumed here
        self.last_steps = 0   # the steps of the interval last logged
        self.profiled = False  # a step of this interval ran under the profiler
        self.optimizer = PartClock(device)   # the optimizer step of the logged step

    @property
    def pending(self) -> int:
        """Steps of the interval in progress (not logged yet), those before a resume included."""
        return self.steps + self.carried

    def carry(self, steps: int) -> None:
        """The interval in progress began before the checkpoint this process resumed from: its
        row covers those steps too (their losses are carried; tokens/s is this process's)."""
        self.carried = steps

    def next_row(self, step: int, total: int) -> int:
        """The step of the first row after `step`."""
        return min((step // self.log_interval + 1) * self.log_interval, total)

    def due(self, step: int, last: bool) -> bool:
        """Whether step `step` ends a log interval (decided before it runs: it is watched)."""
        return step % self.log_interval == 0 or last

    def start(self) -> None:
        """The loop starts: the first interval's clock starts now."""
        self.clock.resume()
        self.steps, self.data_wait = 0, 0.0

    def set_aside(self, st) -> None:
        """The steps so far (the process's first: compilation, warm-up) count as training time
        but not in this interval's tokens/s, step time and MFU, which then describe the steps
        after them. Call after a host sync."""
        st.train_seconds += self.clock.take()
        self.untimed, self.data_wait = self.steps, 0.0

    def waited(self, seconds: float) -> None:
        """Host seconds spent waiting for a micro-batch."""
        self.data_wait += seconds

    def stepped(self) -> None:
        self.steps += 1

    def mark_profiled(self) -> None:
        """A step of this interval ran under the profiler (profile_steps): slower than the
        others, so the interval stays out of the steady state and its row says so."""
        self.profiled = True

    # Around evaluation, checkpoints and rollbacks: they are not training time.
    def pause(self) -> None:
        self.clock.pause()

    def resume(self) -> None:
        self.clock.resume()

    def banked(self) -> float:
        """Training seconds of the current interval so far (while paused)."""
        return self.clock.banked

    def collect(self) -> float:
        return self.clock.collect()

    def row(self, st, loss: float, penalty: float, lr: float, grad_norm: float) -> dict:
        """The interval's row (after its host sync); adds its time to the train state."""
        elapsed = self.clock.take()
        st.train_seconds += elapsed
        timed = self.steps - self.untimed
        if not (self.first or self.profiled):
            st.steady_tokens += self.tokens_per_step * timed
            st.steady_seconds += elapsed
        self.first = False
        row = {"step": st.step, "tokens": st.tokens, "train/loss": loss,
               "train/penalty": penalty, "train/total_loss": loss + penalty, "train/lr": lr,
               "train/grad_norm": grad_norm,
               **throughput(self.tokens_per_step, timed, elapsed, self.world,
                            self.flops_per_token, self.peak),
               "train/data_wait_fraction":
                   min(1.0, self.data_wait / elapsed) if elapsed > 0 else 0.0}
        optimizer_s = self.optimizer.take()
        if optimizer_s is not None:
            row["train/optimizer_ms"] = optimizer_s * 1e3
        if self.profiled:
            row["train/profiled"] = 1
        self.last_steps, self.steps, self.data_wait, self.untimed = self.pending, 0, 0.0, 0
        self.carried, self.profiled = 0, False
        return row

    def memory(self) -> dict:
        """GPU memory now, for the interval's row (nothing on CPU)."""
        if self.device.type != "cuda":
            return {}
        import torch
        return {"system/gpu_memory_allocated_gb": torch.cuda.memory_allocated() / 1e9,
                "system/gpu_memory_peak_gb": torch.cuda.max_memory_allocated() / 1e9,
                "system/gpu_memory_reserved_gb": torch.cuda.memory_reserved() / 1e9}


def device_name(device) -> str:
    if device.type == "cuda":
        import torch
        return torch.cuda.get_device_name(device)
    return device.type
