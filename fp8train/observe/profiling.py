"""profile_steps: [START, END] records those optimizer steps with torch.profiler, for a user to
open: a Chrome/Perfetto trace per rank (CPU and CUDA activities, shapes, memory) in
<output_dir>/profile/, and on CUDA a memory snapshot of the same steps for
https://pytorch.org/memory_viz. The profiled steps run slower (the profiler records every op),
so the meter leaves their interval out of the run's steady-state tokens/s and marks its row.
The snapshot records Python stacks only, one per allocation (MEMORY_HISTORY): its dump runs
inside the loop on every rank, and with C++ stacks it can take minutes.

The loop calls `before(step)` and `after(step)` around each step and `close()` at the end;
everything else (when to start, when to stop and write, what to say) is decided here."""
from __future__ import annotations

import os
import time
from typing import Optional

import torch

# Allocation events kept for the memory snapshot: PyTorch's own example uses 100,000, enough
# for a few steps of a large model. It also bounds the dump: its cost grows with the events
# whose stacks it symbolises (torch/csrc/cuda/memory_snapshot.cpp, _memory_snapshot_pickled).
MEMORY_EVENTS = 100_000
# What is recorded with each event (torch.cuda.memory._record_memory_history, checked in
# torch 2.13's torch/cuda/memory.py and the C++ it calls):
# - stacks="python": Python (and TorchScript/inductor) frames only. torch's default, "all",
#   adds C++ frames, which the dump must symbolise inside the training loop: torchtitan
#   measured a dump of ~461 s with "all" against ~4 s with "python" (DeepSeek-v3 16B, 8xH100,
#   pytorch/torchtitan#3628), and the C++ unwinder can fail there outright ("RuntimeError:
#   stoi", 0-byte pickles: pytorch/torchtitan#2991). The Python frames are the ones that say
#   which line of the model allocated.
# - context="alloc": a stack for each allocation, none for frees (the allocator gathers a
#   free's stack only at "all": CUDACachingAllocator's free() asks for RecordContext::ALL).
#   memory_viz's timeline shows each block with the stack that allocated it, and the dump has
#   half the stacks to symbolise; "state" would keep stacks only for the blocks still live at
#   the dump, not for the steps' activations.
MEMORY_HISTORY = dict(context="alloc", stacks="python", max_entries=MEMORY_EVENTS)


class StepProfiler:
    def __init__(self, steps: Optional[list], run_dir: str, device: torch.device, rank: int,
                 log, tracker=None):
        self.window = tuple(steps) if steps else None
        self.dir = os.path.join(run_dir, "profile")
        self.device, self.rank, self.log, self.tracker = device, rank, log, tracker
        self.prof = None
        self.first = None          # the first step recorded (later than START after a resume)
        self.span = None           # the running step's "ProfilerStep#N" range in the trace

    @property
    def active(self) -> bool:
        return self.prof is not None

    def before(self, step: int) -> None:
        """Step `step` (1-based) runs next: start recording at START (or, when a resume lands
        inside the window, at the first step this process runs), and mark the step's range in
        the trace, named by the optimizer step."""
        if not self.active:
            self._start(step)
        if self.active:
            self.span = torch.profiler.record_function(f"ProfilerStep#{step}")
            self.span.__enter__()

    def _start(self, step: int) -> None:
        if self.window is None or not self.window[0] <= step <= self.window[1]:
            return
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            # The documented way to record allocations for memory_viz (no public name yet).
            torch.cuda.memory._record_memory_history(**MEMORY_HISTORY)
        self.first = step
        self.prof = profile(activities=activities, record_shapes=True, profile_memory=True)
        self.prof.__enter__()

    def after(self, step: int, meter) -> None:
        """Step `step` is done: its interval is marked as profiled; at END the files are
        written."""
        if not self.active:
            return
        meter.mark_profiled()
        self._end_span()
        if step >= self.window[1]:
            self.close()

    def close(self) -> None:
        """Stop recording and write the files (at END, or when the run ends inside the
        window)."""
        if not self.active:
            return
        self._end_span()
        prof, self.prof = self.prof, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof.__exit__(None, None, None)
        os.makedirs(self.dir, exist_ok=True)
        steps = f"steps_{self.first}-{self.window[1]}"
        trace = os.path.join(self.dir, f"trace_{steps}_rank{self.rank}.json")
        prof.export_chrome_trace(trace)
        files = [trace]
        if self.device.type == "cuda":
            snapshot = os.path.join(self.dir, f"memory_{steps}_rank{self.rank}.pickle")
            if self._dump_memory(snapshot, steps):
                files.append(snapshot)
        self.log.msg(f"profile of steps {self.first}-{self.window[1]} written to {self.dir}/: "
                     "open the trace in https://ui.perfetto.dev (or chrome://tracing)"
                     + (", the memory snapshot in https://pytorch.org/memory_viz"
                        if len(files) > 1 else "")
                     + "; those steps' tokens/s are left out of the run's throughput")
        if self.tracker is not None:
            for path in files:
                self.tracker.save_file(path)

    def _dump_memory(self, path: str, steps: str) -> bool:
        """The memory snapshot, and recording stopped whatever happens (it costs every
        allocation a stack). Every rank dumps its own at the same step, and the others wait for
        the slowest at the next collective (the next step's gradient all-reduce at the latest),
        under the process group's timeout (NCCL's default: 10 min, which fp8train does not
        change). The ranks dump at once, so the wait is the difference between their dumps, and
        each dump is bounded by MEMORY_EVENTS: with Python stacks, seconds (torchtitan: ~4 s for
        a 16B model on 8xH100), far below the timeout. The time is in train.log. A dump that
        fails is a warning, not the end of the run."""
        started = time.perf_counter()
        try:
            torch.cuda.memory._dump_snapshot(path)
        except Exception as e:   # a profiling file is not worth the run
            self.log.warn(f"the memory snapshot of {steps.replace('_', ' ')} could not be "
                          f"written to {path} ({type(e).__name__}: {e}); the trace is complete")
            return False
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        self.log.file_only(f"memory snapshot written in {time.perf_counter() - started:.1f} s "
                           f"({path})")
        return True

    def _end_span(self) -> None:
        if self.span is not None:
            span, self.span = self.span, None
            span.__exit__(None, None, None)
