"""In-process tests: profile_steps: a real run records the steps asked for with torch.profiler into
<output_dir>/profile/, says where once, and keeps those steps out of its throughput. (The CUDA
... The whole story, and the tests that start processes: tests/e2e/test_profile.py."""




def _profiled_on_cuda(tmp_path, monkeypatch, dump):
    """A StepProfiler for a CUDA device, run over steps 1-2 of some CPU work, with torch's
    memory-history functions replaced by recorders. These tests run without CUDA (the CPU build
    of torch), where those functions cannot run, so `torch.cuda.memory._record_memory_history`,
    `torch.cuda.memory._dump_snapshot` and `torch.cuda.synchronize` are mocked, and only they:
    what is checked is what the profiler asks of torch. The real snapshot is read back by tests/gpu/test_gpu_train.py
    (test_profiled_steps_on_gpu_record_cuda_kernels_and_a_memory_snapshot). Returns (calls to
    torch, what was said)."""
    from types import SimpleNamespace

    import torch

    from fp8train.observe.profiling import StepProfiler
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda *a, **k: calls.append(("record", a, k)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot",
                        lambda *a, **k: (calls.append(("dump", a, k)), dump(*a)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    said = []
    log = SimpleNamespace(msg=said.append, warn=lambda m: said.append("WARNING: " + m),
                          file_only=lambda m: said.append("file: " + m))
    meter = SimpleNamespace(mark_profiled=lambda: None)
    prof = StepProfiler([1, 2], str(tmp_path), torch.device("cuda"), 0, log)
    for step in (1, 2):
        prof.before(step)
        torch.randn(8, 8) @ torch.randn(8, 8)
        prof.after(step, meter)
    assert not prof.active
    return calls, said


def test_the_cuda_memory_snapshot_records_python_stacks_of_allocations_only(tmp_path,
                                                                           monkeypatch):
    """torch's defaults (stacks="all": C++ frames too, context="all": frees too) make the dump,
    which runs inside the loop on every rank, take minutes; the profiler asks for Python stacks
    of each allocation, a bounded number of events, and stops recording after the dump."""
    import inspect

    import torch

    from fp8train.observe.profiling import MEMORY_EVENTS
    real = inspect.signature(torch.cuda.memory._record_memory_history)   # before the mock
    calls, said = _profiled_on_cuda(tmp_path, monkeypatch,
                                    lambda path: open(path, "wb").write(b"snapshot"))
    snapshot = str(tmp_path / "profile" / "memory_steps_1-2_rank0.pickle")
    assert calls == [
        ("record", (), dict(context="alloc", stacks="python", max_entries=MEMORY_EVENTS)),
        ("dump", (snapshot,), {}),
        ("record", (), dict(enabled=None)),
    ]
    assert MEMORY_EVENTS == 100_000
    # the names are the installed torch's own (the real function is not called: no CUDA)
    real.bind(**calls[0][2])
    assert real.parameters["stacks"].default == "all"   # what the profiler must not leave
    assert said[0].startswith("file: memory snapshot written in ") and \
        said[0].endswith(f" s ({snapshot})")
    assert said[1] == (f"profile of steps 1-2 written to {tmp_path / 'profile'}/: open the trace "
                       "in https://ui.perfetto.dev (or chrome://tracing), the memory snapshot in "
                       "https://pytorch.org/memory_viz; those steps' tokens/s are left out of "
                       "the run's throughput")


def test_a_memory_snapshot_that_fails_is_one_warning_and_recording_still_stops(tmp_path,
                                                                              monkeypatch):
    """The failure torchtitan saw with C++ stacks (pytorch/torchtitan#2991), raised by the mock:
    the run goes on with its trace, says why once, and the recording is switched off."""
    def fails(path):
        raise RuntimeError("stoi")

    calls, said = _profiled_on_cuda(tmp_path, monkeypatch, fails)
    assert calls[-1] == ("record", (), dict(enabled=None))
    snapshot = tmp_path / "profile" / "memory_steps_1-2_rank0.pickle"
    assert said[0] == (f"WARNING: the memory snapshot of steps 1-2 could not be written to "
                       f"{snapshot} (RuntimeError: stoi); the trace is complete")
    assert said[1].startswith("profile of steps 1-2 written to") and "memory_viz" not in said[1]
    assert [p.name for p in (tmp_path / "profile").iterdir()] == ["trace_steps_1-2_rank0.json"]
