"""profile_steps: [START, END] records those optimizer steps with torch.profiler, for a user to
open: a Chrome/Perfetto trace per rank (CPU and CUDA activities, shapes, memory) in
<output_dir>/profile/, and on CUDA a memory snapshot of the same steps for
https://pytorch.org/memory_viz. The profiled steps run slower (the profiler records every op),
so the meter leaves their interval out of the run's steady-state tokens/s and marks its row.

The loop calls `before(step)` and `after(step)` around each step and `close()` at the end;
everything else (when to start, when to stop and write, what to say) is decided here."""
from __future__ import annotations

import os
from typing import Optional

import torch

# Allocation events kept for the memory snapshot: PyTorch's own example uses 100,000, enough
# for a few steps of a large model.
MEMORY_EVENTS = 100_000


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
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_EVENTS)
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
            torch.cuda.memory._dump_snapshot(snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
            files.append(snapshot)
        self.log.msg(f"profile of steps {self.first}-{self.window[1]} written to {self.dir}/: "
                     "open the trace in https://ui.perfetto.dev (or chrome://tracing)"
                     + (", the memory snapshot in https://pytorch.org/memory_viz"
                        if len(files) > 1 else "")
                     + "; those steps' tokens/s are left out of the run's throughput")
        if self.tracker is not None:
            for path in files:
                self.tracker.save_file(path)

    def _end_span(self) -> None:
        if self.span is not None:
            span, self.span = self.span, None
            span.__exit__(None, None, None)
