"""What a background checkpoint write (checkpoint_async) costs the training thread, measured,
and whether the installed safetensors lets it write without stopping training.

The writer is a thread of the training process: Python threads take turns holding the GIL, so a
library call that holds it for the whole write stops the training loop for that long, after
`checkpoint/blocked_s` (the copy at the step) was measured. Two libraries do the writing
(checked in their sources, and measured on a 2-core CPU machine with torch 2.13.0: 1 GiB of
fp32 tensors in 64 tensors written by a thread while the main thread wakes every millisecond;
its longest gap is what training would have waited):

- model.safetensors: accelerate.utils.save(..., safe_serialization=True) calls
  safetensors.torch.save_file. Up to 0.7.0, save_file builds its input with `_flatten`, whose
  `_tobytes` copies every tensor into a Python bytes object (numpy's `tobytes()`, under the
  GIL), and the Rust `serialize_file` (bindings/python/src/lib.rs at v0.7.0: `prepare`, then
  `serialize_to_file`) never releases the GIL: the whole write holds it. From 0.8 (tag
  v0.8.0-rc.0, after huggingface/safetensors#679 "add gil free serialize_file", Dec 2025;
  installed 0.8.0's safetensors/torch.py has the same Python side) `_flatten_as_ptr` passes
  pointers (`TensorSpec(data_ptr=..., data_len=...)`, no copy) and `serialize_file` runs
  `serialize_to_file` inside `py.allow_threads` (`py.detach` on the main branch since its
  PyO3 0.28 update, huggingface/safetensors#751). Measured: longest gap 3.9 s and 4.6 s with
  0.7.0 (a 7.9-8.4 s write, synced), 9-21 ms with 0.8.0 (1.2-3.2 s).
- optimizer.bin: torch.save pickles the state (small: each tensor is a reference) and writes
  every storage with `PyTorchFileWriter.write_record(name, storage, size)`, whose Storage
  overload releases the GIL (torch/csrc/jit/python/init.cpp: `py::gil_scoped_release`).
  Measured: longest gap 15-21 ms (a 3.5-4.1 s write, synced) into a new file. Over an existing
  1 GiB file, the writer's open (the truncation) and its end-of-file record held it ~0.2 s
  each; a checkpoint writes into a new directory.

So checkpoint_async needs safetensors 0.8 (`safetensors_holds_gil`, checked at start), and every
background save measures its stall (`StallWatch`, `checkpoint/stall_max_s`).
"""
from __future__ import annotations

import re
import threading
import time

# The first safetensors whose save_file releases the GIL while it writes.
GIL_FREE_SAFETENSORS = (0, 8)


def safetensors_holds_gil(version: str | None = None) -> str | None:
    """The installed safetensors' version (or `version`) when its save_file holds the GIL for
    the whole write (before GIL_FREE_SAFETENSORS), else None."""
    if version is None:
        import safetensors
        version = getattr(safetensors, "__version__", "")
    m = re.match(r"\s*(\d+)\.(\d+)", version or "")
    if m is None or (int(m.group(1)), int(m.group(2))) >= GIL_FREE_SAFETENSORS:
        return None
    return version


class StallWatch:
    """The longest time this process's Python code could not run while a background write was
    in flight: a thread that asks to run every INTERVAL_S and measures how late it gets to
    (the GIL held by another thread, or no free core). The training loop would have been held
    up as long, whenever it needed to run Python (to launch its next kernels). It runs only
    while a write is in flight (started with the writer, stopped when the write ends), so it
    costs training nothing otherwise, and it never touches a device. Resolution: about
    INTERVAL_S (a held GIL is seen from INTERVAL_S on)."""

    INTERVAL_S = 0.005

    def __init__(self):
        self.longest = 0.0
        self._stop = threading.Event()
        self._stop_at = 0.0
        self._thread: threading.Thread | None = None

    def start(self) -> "StallWatch":
        thread = threading.Thread(target=self._run, name="checkpoint-stall-watch", daemon=True)
        try:
            thread.start()
        except RuntimeError:   # "can't start new thread": nothing is measured
            return self
        self._thread = thread
        return self

    def _run(self) -> None:
        last = time.perf_counter()
        while True:
            stopped = self._stop.wait(self.INTERVAL_S)
            now = time.perf_counter()
            due = last + self.INTERVAL_S
            if stopped:
                due = min(due, self._stop_at)
            self.longest = max(self.longest, now - due)
            if stopped:
                return
            last = now

    def stop(self) -> float | None:
        """The longest stall in seconds, once the watch has ended; None when it never ran."""
        if self._thread is None:
            return None
        self._stop_at = time.perf_counter()
        self._stop.set()
        self._thread.join()
        self._thread = None
        return self.longest
