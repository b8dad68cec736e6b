"""In-process tests: Micro-batch discovery: the search against an injected memory model that raises
a genuine torch.OutOfMemoryError, the plan over many (target, world, fitted), the choice of the
... The whole story, and the tests that start processes: tests/e2e/test_autobatch.py."""


import math
import os

import pytest
import torch
from support.autobatch_shared import probe_file

from fp8train.batch.fit import (Probe, cache_path, choose_speed, discover, plan_from_fit,
                                release_memory, search_max_batch, write_cache)
from fp8train.batch.speed import (StepTimes, Timing, combine_timings, describe_speed, fastest,
                                  speed_candidates, speed_table, step_tokens_per_sec,
                                  time_candidates)
from fp8train.config.load import Config, load_config, section
from fp8train.errors import BadInput, is_out_of_memory
from fp8train.optim.schedule import scaled_lr


def oom_above(n, bytes_per_seq=1000):
    """A step that fits up to n sequences and raises CUDA's out-of-memory error beyond."""
    def trial(micro):
        if micro > n:
            raise torch.OutOfMemoryError(f"CUDA out of memory (asked for {micro} > {n})")
        return micro * bytes_per_seq
    return trial


@pytest.fixture
def no_gc_between_trials(monkeypatch):
    """The search alone: each trial's release_memory (a full gc.collect, about 0.1 s in a test
    process holding torch) is left out, as the trials here allocate nothing."""
    monkeypatch.setattr("fp8train.batch.fit.release_memory", lambda device=None: None)


@pytest.mark.parametrize("n", list(range(1, 70)) + [97, 100, 127, 128, 129, 200, 255, 256, 1000])
def test_search_finds_exactly_the_largest_fit_in_log_trials(n, no_gc_between_trials):
    maximum = 256
    probe = Probe(oom_above(n), budget_bytes=float("inf"))
    assert search_max_batch(probe.fits, maximum) == min(n, maximum)
    # doubling to the first failure, then bisection: at most 2·log2(N) + 2 trials
    assert len(probe.trials) <= 2 * math.ceil(math.log2(min(n, maximum) + 1)) + 2
    assert all(ok == (m <= n) for m, ok, _ in probe.trials)


@pytest.mark.parametrize("n,budget", [(100, 50_500), (100, 99_999), (30, 10**9), (64, 64_000)])
def test_search_respects_the_memory_budget(n, budget, no_gc_between_trials):
    """Headroom: a step that runs but uses more than the budget counts as not fitting."""
    probe = Probe(oom_above(n), budget_bytes=budget)
    assert search_max_batch(probe.fits, 128) == min(n, budget // 1000)


def test_other_errors_are_not_taken_for_out_of_memory():
    def trial(micro):
        raise RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        search_max_batch(Probe(trial, 1e12).fits, 64)


# What an allocation failure reads like when it is not a torch.OutOfMemoryError: Transformer
# Engine registers no exception translator, so its C++ errors are plain RuntimeErrors built by
# NVTE_CHECK_CUDA / NVTE_CHECK_CUBLAS (transformer_engine/common/util/logging.h), and torch
# names cuBLAS's status by its enum.
LIBRARY_OOMS = [
    "/te/common/gemm/cublaslt_gemm.cu:412 in function cublas_gemm: CUDA Error: out of memory",
    "/te/common/gemm/cublaslt_gemm.cu:301 in function cublas_gemm: cuBLAS Error: the resource "
    "allocation failed",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN Error: CUDNN_STATUS_ALLOC_FAILED. For more information, enable cuDNN error logging",
    "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
]


@pytest.mark.parametrize("message", LIBRARY_OOMS)
def test_an_allocation_failure_inside_a_library_counts_as_not_fitting(message):
    def trial(micro):
        if micro > 6:
            raise RuntimeError(message)
        return micro
    assert search_max_batch(Probe(trial, 1e12).fits, 64) == 6
    assert is_out_of_memory(RuntimeError(message))


@pytest.mark.parametrize("message", [
    "CUDA error: an illegal memory access was encountered",
    "mat1 and mat2 shapes cannot be multiplied (64x128 and 256x128)",
    "cuBLAS Error: an invalid numeric value was used as an argument"])
def test_other_library_errors_are_not_out_of_memory(message):
    assert not is_out_of_memory(RuntimeError(message))
    assert not is_out_of_memory(ValueError("out of memory"))   # not from a device


def test_an_out_of_memory_error_wrapped_in_another_is_recognised():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except torch.OutOfMemoryError as e:
            raise ValueError("a library's own error while handling it") from e
    except ValueError as wrapped:
        assert is_out_of_memory(wrapped)


def test_discovery_releases_memory_and_restarts_the_peak_after_its_trials(tmp_path, monkeypatch):
    """The run's system/gpu_memory_peak_gb must describe the run, not the probe's largest
    (often failed) trial: after the last trial, discovery frees the cache and restarts the
    peak statistics of its device."""
    events = []
    monkeypatch.setattr("fp8train.batch.fit.release_memory",
                        lambda device=None: events.append(("release", device)))

    def trial(micro):
        events.append(("trial", micro))
        return oom_above(5)(micro)

    cfg = Config(max_batch_size=8, probe_memory_limit_gb=1.0, output_dir=str(tmp_path))
    fit = discover(cfg, trial, {"k": 1}, torch.device("cpu"), 0, 1, True, print)
    assert fit.micro == 5
    trials = [e for e in events if e[0] == "trial"]
    assert len(trials) >= 4
    # each trial is followed by a release (Probe.fits), and the search by one for the device
    assert events[-1] == ("release", torch.device("cpu"))
    assert events.index(trials[-1]) < len(events) - 1


def test_releasing_memory_restarts_the_cuda_peak(monkeypatch):
    """The CUDA side of release_memory, with torch.cuda stood in for (no GPU here)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: calls.append(("reset_peak", device)))
    release_memory()                                 # after one trial: the cache only
    assert calls == ["empty_cache"]
    cuda = torch.device("cuda", 0)
    release_memory(cuda)                             # after the search: the peak too
    assert calls[1:] == ["empty_cache", ("reset_peak", cuda)]


def test_nothing_fits():
    assert search_max_batch(Probe(oom_above(0), 1e12).fits, 64) == 0


def test_plan_hits_the_target_exactly_for_every_combination():
    for world in (1, 2, 3, 4, 8):
        for target in range(world, 300, world):
            for fitted in (1, 2, 3, 5, 7, 16, 17, 48, 52, 64, 100, 128, 500):
                batch = section(Config(target_effective_batch_size=target, max_batch_size=128),
                                "batch")
                plan = plan_from_fit(batch, world, fitted)
                assert plan.micro * plan.accum * plan.world == target
                assert plan.micro <= min(fitted, 128) and plan.world == world
                per_rank = target // world
                # the largest micro-batch that divides this rank's share and fits
                assert not any(per_rank % m == 0 for m in range(plan.micro + 1,
                                                                 min(fitted, 128) + 1))


def test_target_not_divisible_by_world_is_an_error_with_the_nearest_targets():
    cfg = Config(target_effective_batch_size=100, source="run.yaml")
    with pytest.raises(BadInput, match=r"run.yaml: key 'target_effective_batch_size' \(100\) "
                                          r"is not divisible by the world size \(8\); nearest "
                                          r"valid: 96 or 104"):
        plan_from_fit(section(cfg, "batch"), 8, 64)


def test_lr_scaling_rules():
    assert scaled_lr(3e-3, "none", 512, 256) == (3e-3, "")
    lr, note = scaled_lr(3e-3, "sqrt", 512, 256)
    assert lr == pytest.approx(3e-3 * math.sqrt(2)) and "sqrt(512/256)" in note
    assert scaled_lr(3e-3, "linear", 128, 256)[0] == pytest.approx(1.5e-3)
    with pytest.raises(BadInput, match="applies only with lr_reference_batch_size set"):
        load_config(["--lr_scaling", "sqrt"])
    with pytest.raises(BadInput, match="'gradient_accumulation_steps' .2. applies only with "
                                       "auto_batch_size: false .with auto_batch_size it is "
                                       "derived."):
        load_config(["--auto_batch_size", "--target_effective_batch_size=64",
                     "--gradient_accumulation_steps=2"])


def timings(**tps):
    """Timing rows from micro=tokens/s keywords: timings(m16=100, m8=90)."""
    return [Timing(int(k[1:]), v, None) for k, v in tps.items()]


def test_candidates_are_the_divisors_of_the_rank_share_up_to_the_fit():
    assert speed_candidates(64, 17, 64) == [16, 8, 4, 2, 1]
    assert speed_candidates(96, 64, 32) == [32, 24, 16, 12, 8, 6, 4, 3, 2, 1]   # max_batch_size
    assert speed_candidates(6, 100, 128) == [6, 3, 2, 1]                         # the share
    assert speed_candidates(7, 5, 128) == [1]                                    # nothing to time


def test_tokens_per_second_counts_the_whole_optimizer_step():
    """64 sequences of 128 tokens at micro 16: 4 micro-steps of 0.1 s and one optimizer step of
    0.2 s, 8192 tokens in 0.6 s; at micro 8 the optimizer step is spread over 8 micro-steps."""
    assert step_tokens_per_sec(StepTimes(0, 0.1, 0.2), 16, 64, 128) == pytest.approx(8192 / 0.6)
    assert step_tokens_per_sec(StepTimes(0, 0.05, 0.2), 8, 64, 128) == pytest.approx(8192 / 0.6)


@pytest.mark.parametrize("table,tolerance,chosen", [
    (timings(m16=100, m8=90, m4=60), 0.03, 16),      # the largest is the fastest
    (timings(m16=100, m8=102, m4=80), 0.03, 16),     # 2% faster: noise, the larger is kept
    (timings(m16=100, m8=104, m4=80), 0.03, 8),      # 4% faster: taken
    (timings(m16=100, m8=104, m4=80), 0.05, 16),     # ... unless the tolerance is wider
    (timings(m16=100, m8=110, m4=112), 0.03, 8),     # 4 is within noise of 8: the larger
    (timings(m16=100, m8=110, m4=120), 0.03, 4),     # each step down clearly faster
    (timings(m16=100, m8=99, m4=108), 0.03, 4),      # a dip, then clearly faster than 16
    (timings(m4=50, m16=100, m8=120), 0.0, 8),       # any order in, the rule by size
])
def test_the_fastest_micro_batch_is_chosen_the_larger_on_ties(table, tolerance, chosen):
    assert fastest(table, tolerance) == chosen


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def measuring(clock, tps, cost=1.0, oom=()):
    """measure(micro) over a table of tokens/s, each call taking `cost` fake seconds."""
    calls = []

    def measure(micro):
        calls.append(micro)
        clock.now += cost
        return None if micro in oom else Timing(micro, tps[micro], micro * 1000)
    return measure, calls


def test_timing_stops_where_throughput_clearly_falls():
    clock = FakeClock()
    measure, calls = measuring(clock, {16: 100, 8: 95, 4: 84, 2: 50, 1: 30})
    got, why = time_candidates(measure, [16, 8, 4, 2, 1], 1000, clock)
    assert calls == [16, 8, 4] and [t.micro for t in got] == [16, 8, 4]
    assert "micro 4 was 16% slower than the best" in why


def test_timing_goes_on_while_smaller_is_faster_and_times_everything():
    clock = FakeClock()
    measure, calls = measuring(clock, {16: 100, 8: 120, 4: 130, 2: 125, 1: 112})
    got, why = time_candidates(measure, [16, 8, 4, 2, 1], 1000, clock)
    assert calls == [16, 8, 4, 2, 1] and why == ""
    assert fastest(got, 0.03) == 4


def test_timing_stays_within_its_budget():
    """Each candidate costs 10 s: with 25 s the second starts at 10 s (10 + 10 <= 25), the third
    would end at 30 s and is not started; the largest is always timed, even over the budget."""
    clock = FakeClock()
    measure, calls = measuring(clock, {16: 100, 8: 99, 4: 98, 2: 97, 1: 96}, cost=10)
    got, why = time_candidates(measure, [16, 8, 4, 2, 1], 25, clock)
    assert calls == [16, 8] and "25 s timing budget (batch_timing_budget_s) was spent" in why
    clock = FakeClock()
    measure, calls = measuring(clock, {16: 100, 8: 99}, cost=60)
    assert [t.micro for t in time_candidates(measure, [16, 8], 30, clock)[0]] == [16]


def test_a_candidate_out_of_memory_while_timed_is_left_out():
    clock = FakeClock()
    measure, calls = measuring(clock, {16: 0, 8: 90, 4: 80}, oom={16})
    got, _ = time_candidates(measure, [16, 8, 4], 1000, clock)
    assert calls == [16, 8, 4] and [t.micro for t in got] == [8, 4]


def test_ranks_agree_on_the_slowest_rank_and_the_micro_batches_all_timed():
    rank0 = [(16, 100.0, 5), (8, 110.0, 3), (4, 90.0, 2)]
    rank1 = [(16, 95.0, 6), (8, 80.0, 3)]            # its search stopped earlier
    agreed = combine_timings([rank0, rank1])
    assert agreed == [Timing(16, 95.0, 6), Timing(8, 80.0, 3)]
    assert fastest(agreed, 0.03) == 16                 # rank 0 alone would have taken 8
    assert fastest(combine_timings([rank0]), 0.03) == 8


def fake_trial(step_times, calls):
    """A make_trial stand-in: StepTimes per micro-batch (injected timings, no model)."""
    def trial(micro):
        return step_times[micro].peak

    def timed(micro, steps):
        calls.append(micro)
        return step_times[micro]
    trial.timed = timed
    return trial


def test_choose_speed_times_once_then_reads_the_cache(tmp_path):
    """Micro 8 does a step's micro-steps at 0.4 of micro 16's time: clearly faster over the whole
    step, so it is chosen; the table is cached beside the fit and read on the next start; a
    different target (other candidates) times again, and budget 0 or one candidate times nothing."""
    st = {16: StepTimes(16 * 10**6, 1.0, 0.1), 8: StepTimes(8 * 10**6, 0.4, 0.1),
          4: StepTimes(4 * 10**6, 0.5, 0.1), 2: StepTimes(2 * 10**6, 0.5, 0.1),
          1: StepTimes(10**6, 0.5, 0.1)}
    calls, said = [], []
    cfg = Config(target_effective_batch_size=64, max_batch_size=64, output_dir=str(tmp_path))
    key = {"k": 1}
    write_cache(cache_path(cfg), key, 17, 1.0, [])
    speed = choose_speed(cfg, fake_trial(st, calls), key, 17, torch.device("cpu"), 1,
                         True, said.append)
    assert speed.micro == 8 and not speed.cached and calls[:3] == [16, 8, 4]
    assert [t.micro for t in speed.timings] == calls
    assert speed.timings[0].tokens_per_sec == pytest.approx(64 * cfg.seq_len / (4 * 1.0 + 0.1))
    (entry,) = probe_file(tmp_path)
    assert entry["fitted_micro_batch"] == 17                     # the fit is kept
    assert entry["speed"]["per_rank"] == 64 and \
        [t["micro"] for t in entry["speed"]["timings"]] == calls
    lines = describe_speed(speed, 0.03)
    assert any("micro    8" in x and x.endswith("<- fastest") for x in lines)

    calls.clear()
    again = choose_speed(cfg, fake_trial(st, calls), key, 17, torch.device("cpu"), 1,
                         True, said.append)
    assert calls == [] and again.cached and again.micro == 8
    assert [(t.micro, t.peak_bytes) for t in again.timings] == \
        [(t.micro, t.peak_bytes) for t in speed.timings]
    assert [t.tokens_per_sec for t in again.timings] == \
        pytest.approx([t.tokens_per_sec for t in speed.timings], abs=0.1)
    other = Config(target_effective_batch_size=32, max_batch_size=64, output_dir=str(tmp_path))
    assert choose_speed(other, fake_trial(st, calls), key, 17, torch.device("cpu"), 1,
                        True, said.append).micro == 8 and calls
    calls.clear()
    off = Config(target_effective_batch_size=64, batch_timing_budget_s=0, output_dir=str(tmp_path))
    one = Config(target_effective_batch_size=7, output_dir=str(tmp_path))
    for c, fit in ((off, 17), (one, 5), (cfg, 1)):
        assert choose_speed(c, fake_trial(st, calls), key, fit, torch.device("cpu"), 1,
                            True, said.append) is None
    assert calls == []


def test_a_cache_entry_without_a_usable_fit_is_probed_again(tmp_path):
    """An entry holding timings but no fit (edited by hand, or written half) is a miss, not a
    KeyError that would stop every later run with this key."""
    from fp8train.io import write_entry
    cfg = Config(max_batch_size=8, probe_memory_limit_gb=1.0, output_dir=str(tmp_path))
    key = {"k": 1}
    for broken in ({"speed": {"per_rank": 8}}, {"fitted_micro_batch": "7"},
                   {"fitted_micro_batch": 0}):
        write_entry(cache_path(cfg), key, broken)
        said = []
        fit = discover(cfg, oom_above(5), key, torch.device("cpu"), 0, 1, True,
                       said.append)
        assert fit.micro == 5 and not fit.cached and any("probing" in x for x in said)
        (entry,) = probe_file(tmp_path)
        assert entry["fitted_micro_batch"] == 5


def test_a_cache_that_cannot_be_written_is_a_note_not_a_failure(tmp_path):
    """batch_probe.json is a directory here, so the atomic rename onto it fails for real: the
    probe and the timing still decide, and the note says the next run measures again."""
    cfg = Config(target_effective_batch_size=64, max_batch_size=64, output_dir=str(tmp_path))
    os.makedirs(cache_path(cfg) + "/x")
    said, calls = [], []
    fit = discover(cfg, oom_above(17), {"k": 1}, torch.device("cpu"), 0, 1, True,
                   said.append)
    st = {m: StepTimes(m * 10**6, 0.1 * m, 0.1) for m in (16, 8, 4, 2, 1)}
    speed = choose_speed(cfg, fake_trial(st, calls), {"k": 1}, fit.micro,
                         torch.device("cpu"), 1, True, said.append)
    assert fit.micro == 17 and speed.micro == 16 and calls
    notes = [x for x in said if "could not write the cache" in x]
    assert len(notes) == 2 and all("the next run measures again" in x for x in notes)


def test_a_table_cut_short_by_the_budget_is_timed_again_with_another_budget(tmp_path):
    st = {m: StepTimes(m * 10**6, 0.1 * m, 0.1) for m in (16, 8, 4, 2, 1)}
    cfg = Config(target_effective_batch_size=64, max_batch_size=64, output_dir=str(tmp_path),
                 batch_timing_budget_s=1e-9)   # the largest only: the budget is spent at once
    key, calls = {"k": 1}, []
    write_cache(cache_path(cfg), key, 17, 1.0, [])
    first = choose_speed(cfg, fake_trial(st, calls), key, 17, torch.device("cpu"), 1,
                         True, print)
    assert calls == [16] and "batch_timing_budget_s" in first.stopped
    calls.clear()
    same = choose_speed(cfg, fake_trial(st, calls), key, 17, torch.device("cpu"), 1,
                        True, print)
    assert same.cached and calls == []
    more = Config(target_effective_batch_size=64, max_batch_size=64, output_dir=str(tmp_path))
    again = choose_speed(more, fake_trial(st, calls), key, 17, torch.device("cpu"), 1,
                         True, print)
    assert not again.cached and len(calls) >= 2


def compiling(clock, tps, compile_s, timed_s):
    """measure(micro) as under compile: each size first compiles (`compile_s` fake seconds, its
    warm-up), then runs `timed_s` fake seconds of timed steps, and reports those."""
    calls = []

    def measure(micro):
        calls.append(micro)
        clock.now += compile_s + timed_s
        return Timing(micro, tps[micro], micro * 1000, timed_s=timed_s)
    return measure, calls


def test_compiling_is_not_charged_to_the_budget():
    """Each size compiles for 20 s, close to the whole 30 s budget, then runs 5 s of timed
    steps: every size is timed (5 × 5 s of budget), and each Timing says which seconds were
    which. Charged with the whole call, as when compiling counted, only the largest was timed.
    Compiling is bounded apart: at 100 s a size, after two sizes (200 s, past 4 × 30 s) no third
    one starts."""
    tps = {16: 100, 8: 99, 4: 98, 2: 97, 1: 96}
    clock = FakeClock()
    measure, calls = compiling(clock, tps, compile_s=20, timed_s=5)
    got, why = time_candidates(measure, [16, 8, 4, 2, 1], 30, clock)
    assert calls == [16, 8, 4, 2, 1] and why == "" and clock.now == 125
    assert [(t.timed_s, t.warmup_s) for t in got] == [(5, 20)] * 5
    clock = FakeClock()
    measure, calls = compiling(clock, tps, compile_s=100, timed_s=5)
    got, why = time_candidates(measure, [16, 8, 4, 2, 1], 30, clock)
    assert calls == [16, 8] and why.startswith("warm-up (compiling) took 200 s for 2 sizes")
    assert "batch_timing_budget_s" in why   # a cache cut short by it is timed again elsewhere
    clock = FakeClock()
    measure, calls = measuring(clock, tps, cost=105)   # the time not split: all of it charged
    got, why = time_candidates(measure, [16, 8, 4, 2, 1], 30, clock)
    assert calls == [16] and "cannot time a second micro-batch to compare" in why
    assert (got[0].timed_s, got[0].warmup_s) == (105, 0)


def compiling_trial(clock, step_times, compile_s, calls):
    """A make_trial stand-in under compile: each timed trial compiles first (`compile_s` fake
    seconds), then runs the timed micro-steps and the optimizer step its StepTimes say."""
    def trial(micro):
        return step_times[micro].peak

    def timed(micro, steps):
        calls.append(micro)
        st = step_times[micro]
        clock.now += compile_s + steps * st.micro_s + st.optimizer_s
        return st
    trial.timed = timed
    return trial


def test_choose_speed_under_compile_times_several_sizes_and_reports_compiling_apart(tmp_path):
    """A 25 s compile per size, near the 30 s budget: micro 16, 8, 4 and 2 are compiled and
    timed (6.13 s of timed steps in all), micro 8 is taken (11% faster than 16), micro 2 (43%
    slower than the best) ends the search; the 100 s of compiling are reported apart, in the
    log, the table and the cache."""
    st = {16: StepTimes(16 * 10**6, 1.0, 0.1), 8: StepTimes(8 * 10**6, 0.45, 0.1),
          4: StepTimes(4 * 10**6, 0.26, 0.1), 2: StepTimes(2 * 10**6, 0.2, 0.1),
          1: StepTimes(10**6, 0.2, 0.1)}
    cfg = Config(target_effective_batch_size=64, max_batch_size=64, compile=True,
                 output_dir=str(tmp_path))
    clock, calls, said = FakeClock(), [], []
    speed = choose_speed(cfg, compiling_trial(clock, st, 25, calls), {"k": 1}, 17,
                         torch.device("cpu"), 1, True, said.append, clock=clock)
    assert calls == [16, 8, 4, 2] and speed.micro == 8
    assert "micro 2 was 43% slower than the best" in speed.stopped
    assert [t.timed_s for t in speed.timings] == pytest.approx([3.1, 1.45, 0.88, 0.7])
    assert [t.warmup_s for t in speed.timings] == pytest.approx([25] * 4)
    assert speed.seconds == pytest.approx(6.13) and speed.warmup_seconds == pytest.approx(100)
    assert any(x.startswith("batch timing: micro-batches 16, 8, 4, 2, 1 ") and
               x.endswith("within 30 s of timed steps (each size compiles first, not counted)")
               for x in said)
    lines = describe_speed(speed, 0.03)
    assert lines[0].startswith("batch timing (6.1 s of timed steps + 100.0 s warm-up and "
                               "compiling, not counted in the budget)")
    assert lines[2].endswith("timed 1.45 s, warm-up 25.0 s  <- fastest")
    (entry,) = probe_file(tmp_path)
    table = entry["speed"]
    assert (table["timed_s"], table["warmup_s"]) == (6.13, 100.0)
    assert [(t["micro"], t["timed_s"], t["warmup_s"]) for t in table["timings"]] == \
        [(16, 3.1, 25.0), (8, 1.45, 25.0), (4, 0.88, 25.0), (2, 0.7, 25.0)]
    calls.clear()   # the next start reads the table, seconds included, and compiles nothing
    again = choose_speed(cfg, compiling_trial(clock, st, 25, calls), {"k": 1}, 17,
                         torch.device("cpu"), 1, True, said.append, clock=clock)
    assert calls == [] and again.cached and again.micro == 8
    assert speed_table(again) == table["timings"]


def test_timing_that_cannot_compare_two_sizes_says_so_in_one_line(tmp_path):
    """One candidate: nothing is timed or compiled, one line says why. A budget that cannot
    cover two sizes' timed steps (20 s each against 30 s): after the largest, no other size is
    compiled, and the table says nothing was compared instead of calling it the fastest."""
    st = {m: StepTimes(m * 10**6, 6.0, 2.0) for m in (16, 8, 4, 2, 1)}
    clock, calls, said = FakeClock(), [], []
    one = Config(target_effective_batch_size=7, compile=True, output_dir=str(tmp_path))
    assert choose_speed(one, compiling_trial(clock, st, 60, calls), {"k": 1}, 5,
                        torch.device("cpu"), 1, True, said.append, clock=clock) is None
    assert calls == [] and said == [
        "batch timing: skipped, nothing to compare: 1 is the only micro-batch up to the fit (5) "
        "that divides the 7 sequences per rank"]
    cfg = Config(target_effective_batch_size=64, max_batch_size=64, compile=True,
                 output_dir=str(tmp_path))
    speed = choose_speed(cfg, compiling_trial(clock, st, 60, calls), {"k": 1}, 17,
                         torch.device("cpu"), 1, True, said.append, clock=clock)
    assert calls == [16] and [t.micro for t in speed.timings] == [16] and speed.micro == 16
    lines = describe_speed(speed, 0.03)
    assert not any("fastest" in x for x in lines)
    assert lines[-1] == (
        "  not timed: 8, 4, 2, 1 (the 30 s timing budget (batch_timing_budget_s) cannot time a "
        "second micro-batch to compare: micro 16's timed steps took 20 s): nothing was "
        "compared, micro 16 is kept")
