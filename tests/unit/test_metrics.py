"""Throughput and MFU against numbers worked out by hand from the published model shapes."""
import pytest

from fp8train.model import GPT, model_config_from
from fp8train.observe.metrics import peak_flops, peak_note, throughput

# GPT-2 small, GPT-2 vocabulary 50,257 padded to 50,304, T = 1024:
#   per layer: qkv 768·2304 + proj 768·768 + fc 768·3072 + proj 3072·768 = 7,077,888
#   12 layers = 84,934,656; tied head 50,304·768 = 38,633,472 -> N = 123,568,128 matmul weights
#   6N = 741,408,768; attention 12·L·d·T = 12·12·768·1024 = 113,246,208
GPT2_124M_FLOPS = 854_654_976
# Llama-style 350M: d 1024, 24 layers, SwiGLU 2816 (2/3·4d rounded up to 256), tied head:
#   per layer: q,k,v,o 4·1024² = 4,194,304 + gate,up,down 3·1024·2816 = 8,650,752 = 12,845,056
#   24 layers = 308,281,344; head 50,304·1024 = 51,511,296 -> N = 359,792,640
#   6N = 2,158,755,840; attention 12·24·1024·1024 = 301,989,888
LLAMA_350M_FLOPS = 2_460_745_728


@pytest.mark.parametrize("preset,expected", [("gpt2-124m", GPT2_124M_FLOPS),
                                             ("llama-350m", LLAMA_350M_FLOPS)])
def test_flops_per_token_of_the_presets(preset, expected):
    model = GPT(model_config_from(preset, 50257, 1024))
    assert model.flops_per_token() == expected


def test_gpt2_124m_on_8_h100_sxm():
    # 8 GPUs, 512 sequences of 1024 tokens per step, 10 steps in 13.1072 s:
    # 524,288 tokens/step · 10 / 13.1072 s = 400,000 tokens/s in all, 50,000 per GPU.
    # MFU = 854,654,976 FLOP/token · 50,000 tokens/s / 989.4e12 FLOP/s = 0.0431905...
    row = throughput(512 * 1024, 10, 13.1072, 8, GPT2_124M_FLOPS,
                     peak_flops("NVIDIA H100 80GB HBM3"))
    assert row["train/tokens_per_sec"] == pytest.approx(400_000)
    assert row["train/tokens_per_sec_per_device"] == pytest.approx(50_000)
    assert row["train/step_time"] == pytest.approx(1.31072)
    assert row["train/mfu"] == pytest.approx(0.0431905, rel=1e-5)


def test_llama_350m_on_one_h100_pcie():
    # 120,000 tokens/s on one H100 PCIe (756 TFLOP/s bf16 dense):
    # 2,460,745,728 · 120,000 / 756e12 = 0.39059456
    row = throughput(120_000, 1, 1.0, 1, LLAMA_350M_FLOPS, peak_flops("NVIDIA H100 PCIe"))
    assert row["train/mfu"] == pytest.approx(0.39059456, rel=1e-7)


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989.4e12), ("NVIDIA H200 NVL", 835e12),
    ("NVIDIA GH200 480GB", 989.4e12), ("NVIDIA B200", 2250e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12)])
def test_peak_table_matches_device_names(name, peak):
    assert peak_flops(name) == peak


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090", "NVIDIA L40S", "NVIDIA GB200", "cpu",
                                  None, "NVIDIA H100 80GB HBM3 MIG 3g.40gb",
                                  "NVIDIA A100-SXM4-40GB MIG 1g.5gb"])
def test_unknown_device_gets_no_mfu_rather_than_a_guess(name):
    assert peak_flops(name) is None
    row = throughput(1024, 1, 0.5, 1, GPT2_124M_FLOPS, peak_flops(name))
    assert "train/mfu" not in row and row["train/tokens_per_sec"] == 2048
    assert "no MFU" in peak_note(name, fp8=False)


def test_the_peak_used_is_named_and_fp8_runs_are_labelled():
    assert peak_note("NVIDIA H200", fp8=False) == \
        "MFU against the H200 SXM bf16 dense peak, 989.4 TFLOP/s"
    assert "FP8 run: MFU is against the bf16 peak" in peak_note("NVIDIA H200", fp8=True)
    assert "GH200" in peak_note("NVIDIA GH200 480GB", fp8=False)


def test_a_mig_slice_is_not_measured_against_the_whole_gpus_peak():
    assert "MIG slice" in peak_note("NVIDIA H100 80GB HBM3 MIG 3g.40gb", fp8=True)
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12   # the whole GPU still has one


def test_the_eta_is_measured_after_the_first_step(capsys):
    """A resumed run (step 50 of 100) whose start-up and first step took 3 s and whose next four
    steps took 0.1 s each: the ETA is 45 steps at 0.1 s, not at the pace start-up suggests
    (about 30 s, from the time since start over the steps since)."""
    import re

    from support.runs import FakeClock

    from fp8train.observe.logger import Logger, Progress
    now = FakeClock()
    progress = Progress(Logger(is_main=True), total=100, initial=50, clock=now)
    now.advance(3.0)                          # start-up, compilation, the first step
    progress.first_step(51, 3.0, next_row=60)
    now.advance(0.4)                          # steps 52-55
    progress.update(55, {"train/loss": 3.0, "train/lr": 1e-3, "train/grad_norm": 1.0,
                         "train/tokens_per_sec": 1000.0, "train/step_time": 0.1})
    out = capsys.readouterr().out
    assert "step 51/100 | first step 3.0 s (start-up and warm-up included) | loss from step 60" \
        in out
    h, m, s = map(int, re.search(r"step 55/100 .* ETA (\d+):(\d+):(\d+)", out).groups())
    assert 3600 * h + 60 * m + s == 4, out   # 45 steps at 0.1 s


def test_the_first_row_times_the_steps_after_the_first():
    """The process's first step (compilation, warm-up) is training time but not the first row's
    speed: on an H200, llama-1b's first row said 2,392 tokens/s (3,425 ms/step) where the steps
    after it ran at 117 ms, because its 33 s compile was averaged in."""
    import torch

    from support.runs import FakeClock

    from fp8train.checkpoint.train_state import TrainState
    from fp8train.observe.metrics import Meter
    now = FakeClock()
    st, meter = TrainState(), Meter(5, 1000, 1, 0.0, torch.device("cpu"), clock=now)
    meter.start()
    now.advance(1.0)                # step 1: the compile
    meter.stepped()
    meter.set_aside(st)
    for _ in range(4):              # steps 2-5
        now.advance(0.05)
        meter.stepped()
    row = meter.row(st, 1.0, 0.0, 1e-3, 1.0)
    assert row["train/step_time"] == pytest.approx(0.05)   # not (1.0 + 4 · 0.05) / 5 = 0.24
    assert row["train/tokens_per_sec"] == pytest.approx(4000 / 0.2)
    assert st.train_seconds == pytest.approx(1.2)           # every second counts as training
    assert meter.last_steps == 5                            # the row's losses cover steps 1-5
    assert st.steady_tokens == 0                            # the first row stays out of it
