"""Micro-batch discovery on a real GPU (skipped without CUDA): the probe finds a micro-batch
within the device budget, the micro-batches up to it are timed and the fastest taken, 50 real
steps with that plan do not run out of memory and stay under the budget, and the run's peak-memory statistics describe the run, not the probe's trials; a run
at exactly the fitted micro-batch stays within the budget too. Under torch.compile, where each
timed micro-batch compiles for longer than the timing budget, several are still timed (the
budget counts timed steps only) and the one taken is within tolerance of the fastest.

Units: batch_probe.json records each trial's peak as `peak_gb` (torch.cuda.max_memory_reserved
/ 1e9, what the probe compares with the budget); the run logs system/gpu_memory_peak_gb
(torch.cuda.max_memory_allocated / 1e9, never above the reserved peak of the same work)."""
import json

import pytest
import torch
import yaml
from gpu_support import needs_corpus, needs_cuda, run_train, train_rows

pytestmark = [pytest.mark.gpu, needs_cuda]


def _budget_gb() -> float:
    """The probe's budget with probe_memory_limit_gb null: (1 - memory_headroom 0.1) × memory."""
    return torch.cuda.get_device_properties(0).total_memory * 0.9 / 1e9


def _probe_args(out, model: str, target: int, steps: int, max_batch: int = 256):
    """configs/test_auto_batch.yaml against the GPU's own memory, at seq_len 1024, for `steps`
    steps (num_epochs off: tinyshakespeare's 1M training tokens would end the run after a few
    steps of 256 sequences)."""
    return ["--config", "configs/test_auto_batch.yaml", "--output_dir", out, f"--model={model}",
            "--seq_len=1024", "--probe_memory_limit_gb=null", f"--max_batch_size={max_batch}",
            f"--target_effective_batch_size={target}", f"--max_steps={steps}",
            "--num_epochs=null", "--warmup_steps=5", f"--eval_interval={steps}",
            f"--checkpoint_interval={steps}", "--eval_sequences=16", "--log_interval=10"]


@needs_corpus
@pytest.mark.parametrize("model", ["gpt2-124m", "llama-350m"])
def test_probe_then_train_within_the_budget(tmp_path, model):
    out = tmp_path / model
    r = run_train(*_probe_args(out, model, target=256, steps=50))
    assert r.returncode == 0, r.stderr[-3000:]
    (entry,) = json.load(open(out / "batch_probe.json")).values()
    budget = _budget_gb()
    derived = yaml.safe_load(open(out / "config.yaml"))["derived"]
    assert derived["micro_batch_size"] * derived["gradient_accumulation_steps"] == 256
    assert derived["micro_batch_size"] <= entry["fitted_micro_batch"]
    # The micro-batches up to the fit that divide 256 were timed with CUDA synchronised, and
    # the run trains at the one the rule picks (a smaller one only when over 3% faster).
    table = derived.get("batch_timings")
    if table:   # one candidate (a fit of 1) times nothing
        from fp8train.batch.speed import Timing, fastest
        assert table == entry["speed"]["timings"]
        assert all(t["micro"] * t["accum"] == 256 and t["tokens_per_sec"] > 0 and
                   0 < t["peak_gb"] <= _budget_gb() for t in table), table
        assert derived["micro_batch_size"] == fastest(
            [Timing(t["micro"], t["tokens_per_sec"], None) for t in table], 0.03)
    trials = entry["trials"]
    assert trials and trials[0]["micro"] == 1
    assert any(t["fits"] for t in trials), trials
    rows = train_rows(out)
    assert len(rows) == 5
    # The peak statistics are reset after discovery: the first logged peak is this run's own.
    # Without the reset it would be at least the largest trial's allocation, and a trial that
    # failed did so by running out of memory or by going over this budget (its peak_gb, the
    # reserved peak, is above it). Comparing the logged peak with a failed trial's peak_gb for
    # equality would prove nothing: one is allocated bytes, the other reserved bytes rounded.
    assert rows[0]["system/gpu_memory_peak_gb"] < budget, (rows[0], budget, trials)
    assert max(x["system/gpu_memory_peak_gb"] for x in rows) < budget, (rows, budget)


@needs_corpus
def test_training_at_the_fitted_micro_batch_stays_within_the_budget(tmp_path):
    """The probe's promise, at its edge: discover the fit F for gpt2-124m (--plan-only), then
    train 20 steps with micro-batch F itself (target F: no rounding down to a divisor of the
    target, which hides most errors in the other test). From the second step on, a run holds
    AdamW's two moments during forward and backward as well, so its peak is only within the
    budget if the probe's trial counted them."""
    out = tmp_path / "plan"
    # A ceiling far above what fits (gpt2-124m with the byte vocabulary is ~0.3 GB a sequence
    # at seq_len 1024, estimated): the fit is set by memory, not by the ceiling.
    r = run_train(*_probe_args(out, "gpt2-124m", target=1024, steps=20, max_batch=1024),
                  "--plan-only")
    assert r.returncode == 0, r.stderr[-3000:]
    (entry,) = json.load(open(out / "batch_probe.json")).values()
    fit = entry["fitted_micro_batch"]
    assert fit >= 1, entry
    run = tmp_path / "run"
    assert fit < 1024, f"everything up to the ceiling fitted ({entry}): no edge to test"
    r = run_train(*_probe_args(run, "gpt2-124m", target=fit, steps=20, max_batch=1024),
                  f"--batch_cache_dir={out}", "--batch_timing_budget_s=0")   # the fit, untimed
    assert r.returncode == 0, r.stderr[-3000:]
    derived = yaml.safe_load(open(run / "config.yaml"))["derived"]
    assert (derived["micro_batch_size"], derived["gradient_accumulation_steps"]) == (fit, 1)
    assert "cached in" in derived["batch_discovery"]     # the same fit, not a second probe
    budget = _budget_gb()
    rows = train_rows(run)
    assert len(rows) == 2
    for row in rows:
        assert row["system/gpu_memory_peak_gb"] <= budget, (row, budget, fit, entry["trials"])


def test_choose_speed_under_compile_times_several_sizes_within_a_budget_below_one_compile(
        tmp_path):
    """choose_speed on real compiled training steps (synthetic tokens: no corpus needed) of a
    GPT-2-wide model (768 wide, 4 layers, seq_len 512, bf16), the micro-batches that divide 16
    sequences, 16 first. Each size compiles with static shapes, as the run does (the whole
    gpt2-124m's first compiled step takes 24 s on an H200; with a cold inductor cache these 4
    layers take longer than the 2 s budget), and the budget counts only the timed steps (3
    micro-steps and an optimizer step, a fraction of a second a size).
    At least two sizes are timed, each with its compile reported apart, and the one taken is
    within batch_speed_tolerance of the fastest."""
    from fp8train.batch.decide import new_model
    from fp8train.batch.fit import choose_speed, make_trial
    from fp8train.batch.speed import describe_speed, fastest
    from fp8train.config.load import Config, section
    from fp8train.evaluate.trained import autocast
    from fp8train.model import model_config_from
    from fp8train.precision import build_precision
    from fp8train.optim.optimizer import build_optimizer

    device = torch.device("cuda", 0)
    cfg = Config(model="gpt2-124m", n_layer=4, seq_len=512, compile=True, use_fp8=False,
                 auto_batch_size=True, target_effective_batch_size=16, max_batch_size=16,
                 batch_timing_budget_s=2.0, output_dir=str(tmp_path))
    mcfg = model_config_from("gpt2-124m", 256, cfg.seq_len, n_layer=4)
    trial = make_trial(
        build_model=lambda: new_model(mcfg, False),
        build_precision=lambda: build_precision(cfg, device, warn=lambda _: None),
        build_optimizer=lambda m: build_optimizer(m, section(cfg, "optimizer")),
        loss_fn=lambda model, x: model(x, x)[0],   # the model's own loss, as the run's
        cfg=cfg, vocab_size=mcfg.vocab_size, device=device,
        autocast=lambda: autocast(cfg, device))
    said = []
    speed = choose_speed(cfg, trial, {"test": "compiled timing"}, 16, device, 1, True,
                         said.append)
    assert speed is not None, said
    print("\n".join(said + describe_speed(speed, cfg.batch_speed_tolerance)))
    assert not speed.cached and speed.compiled
    assert speed.candidates == (16, 8, 4, 2, 1)
    timed = [t.micro for t in speed.timings]
    assert len(timed) >= 2 and timed == list(speed.candidates[:len(timed)]), said
    for t in speed.timings:
        assert t.tokens_per_sec > 0 and t.peak_bytes > 0, t
        assert 0 < t.timed_s < cfg.batch_timing_budget_s, t      # what the budget counts
        assert t.warmup_s > t.timed_s, t                           # compiling, apart
    assert speed.seconds == pytest.approx(sum(t.timed_s for t in speed.timings))
    best = max(t.tokens_per_sec for t in speed.timings)
    chosen = next(t for t in speed.timings if t.micro == speed.micro)
    assert chosen.tokens_per_sec * (1 + cfg.batch_speed_tolerance) >= best, speed.timings
    assert speed.micro == fastest(speed.timings, cfg.batch_speed_tolerance)
