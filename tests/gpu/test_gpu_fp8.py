"""FP8 on a real GPU (H100/H200; skipped without CUDA, and FP8 parts without SM >= 8.9): each
backend trains the tiny model 100 steps; the loss stays finite and within 2% of the bf16 run at
every logged step, the scales are logged, and the native GEMMs match their emulation.
fp8_layers auto's CUDA timer times each backend, and a run times once, then reads the cache."""
import importlib.util
import json

import pytest
import torch
import yaml

from conftest import run_train, tiny_args

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
fp8_gpu = pytest.mark.skipif(not torch.cuda.is_available()
                             or torch.cuda.get_device_capability() < (8, 9),
                             reason="needs a CUDA GPU with compute capability 8.9+ (FP8)")

RUN = dict(max_steps=100, warmup_steps=10, learning_rate=1e-3, batch_size=16, seq_len=128,
           n_layer=4, log_interval=20, eval_interval=100, checkpoint_interval=100)


def losses(out):
    return [json.loads(line)["train/loss"] for line in open(out / "metrics.jsonl")
            if "train/loss" in line]


@pytest.fixture(scope="module")
def bf16_curve(tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16")
    r = run_train(*tiny_args(out, **RUN))
    assert r.returncode == 0, r.stderr[-3000:]
    return losses(out)


@fp8_gpu
@pytest.mark.parametrize("backend", ["native", "torchao", "te"])
def test_fp8_backend_tracks_bf16_on_gpu(tmp_path, bf16_curve, backend):
    if backend == "torchao" and importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao not installed")
    if backend == "te" and importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("transformer_engine not installed")
    out = tmp_path / backend
    r = run_train(*tiny_args(out, **RUN), "--use_fp8", f"--fp8_backend={backend}",
                  "--fp8_fallback=error", "--fp8_layers=all")   # auto may keep tiny layers
    assert r.returncode == 0, r.stderr[-3000:]
    d = yaml.safe_load(open(out / "config.yaml"))["derived"]
    assert d["fp8"] == backend and d["precision"] == "bf16" and d["fp8_layers"] == 16
    curve = losses(out)
    assert len(curve) == len(bf16_curve) == 5
    for a, b in zip(curve, bf16_curve):
        assert a == pytest.approx(b, rel=0.02), (backend, curve, bf16_curve)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if "train/loss" in line]
    for row in rows:
        assert row["fp8/fwd_scale"] > 0 and row["fp8/bwd_scale"] > 0 and row["fp8/amax"] > 0
        assert "fp8/blocks.0.attn.qkv/fwd_scale_input" in row


@fp8_gpu
@pytest.mark.parametrize("backend", ["native", "torchao", "te"])
def test_cuda_timer_times_both_variants_of_a_shape(backend):
    if backend != "native" and importlib.util.find_spec(
            {"torchao": "torchao", "te": "transformer_engine"}[backend]) is None:
        pytest.skip(f"{backend} not installed")
    from fp8train.config import Config
    from fp8train.precision import build_precision, policy
    dev = torch.device("cuda")
    prec = build_precision(Config(use_fp8=True, fp8_backend=backend, fp8_fallback="error"), dev,
                           warn=pytest.fail)
    rng = torch.cuda.get_rng_state()
    base_s, fp8_s = policy.cuda_timer(prec, dev, 8192)((4096, 4096, True))
    assert 0 < base_s < 1 and 0 < fp8_s < 1, (base_s, fp8_s)
    assert torch.equal(torch.cuda.get_rng_state(), rng)   # the run's RNG is untouched
    print(f"{backend}: 4096 x 4096 at 8192 tokens: bf16 {base_s * 1e3:.3f} ms, "
          f"fp8 {fp8_s * 1e3:.3f} ms ({base_s / fp8_s:.2f}x)")


@fp8_gpu
def test_fp8_layers_auto_times_once_then_reads_the_cache(tmp_path):
    out = tmp_path / "auto"
    args = [*tiny_args(out, **{**RUN, "max_steps": 2, "warmup_steps": 1, "eval_interval": 2,
                               "checkpoint_interval": 2}),
            "--use_fp8", "--fp8_backend=native", "--fp8_fallback=error", "--fp8_layers=auto"]
    first = run_train(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "fp8_layers auto: forward + backward of one layer at 2,048 tokens" in first.stdout
    assert "timed in" in first.stdout and (out / "fp8_layers.json").is_file()
    again = run_train(*args, f"--output_dir={tmp_path / 'again'}",
                      f"--batch_cache_dir={out}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert ": nothing timed)" in again.stdout
    d1 = yaml.safe_load(open(out / "config.yaml"))["derived"]
    d2 = yaml.safe_load(open(tmp_path / "again" / "config.yaml"))["derived"]
    assert d1["fp8_layers"] == d2["fp8_layers"]
    assert d2["fp8_layer_policy"].endswith("(cached at 2,048 tokens)")


@fp8_gpu
def test_native_scaled_mm_matches_its_emulation_on_gpu():
    from torch import nn
    from fp8train.precision.native import Fp8Linear, Fp8State
    torch.manual_seed(0)
    base = nn.Linear(256, 512, device="cuda")
    x = torch.randn(64, 256, device="cuda")
    results = []
    for emulate in (False, True):
        state = Fp8State(["l"], emulate=emulate).cuda()
        layer = Fp8Linear.from_linear(nn.Linear(256, 512, device="cuda"), state, 0, "l")
        layer.load_state_dict(base.state_dict())
        for _ in range(2):
            xi = x.clone().requires_grad_()
            layer.zero_grad()
            y = layer(xi)
            y.square().mean().backward()
            state.update()
        results.append((y.detach(), xi.grad, layer.weight.grad))
    for real, emu in zip(*results):
        torch.testing.assert_close(real, emu, rtol=2e-2, atol=1e-4)


def test_fp16_with_loss_scaling_trains_on_gpu(tmp_path, bf16_curve):
    out = tmp_path / "fp16"
    r = run_train(*tiny_args(out, **RUN), "--precision=fp16")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if "train/loss" in line]
    assert all(row["train/loss_scale"] > 1 for row in rows)
    assert losses(out)[-1] == pytest.approx(bf16_curve[-1], rel=0.02)
