"""LR schedule: exact values at the points that define it."""
import itertools
import math

import pytest

from fp8train.optim.schedule import describe, lr_at, wsd_decay_steps

KW = dict(max_lr=3e-3, warmup_steps=2000, total_steps=20000, min_lr_ratio=0.1)


def test_warmup_is_linear_from_the_first_step():
    assert lr_at(0, **KW) == pytest.approx(3e-3 / 2000)
    assert lr_at(999, **KW) == pytest.approx(3e-3 * 1000 / 2000)


def test_peak_at_end_of_warmup_and_start_of_decay():
    assert lr_at(1999, **KW) == pytest.approx(3e-3)
    assert lr_at(2000, **KW) == pytest.approx(3e-3)


def test_cosine_midpoint_is_halfway_between_peak_and_floor():
    # decay runs from step 2000 to step 19999; its midpoint is step 10999.5
    mid = (lr_at(10999, **KW) + lr_at(11000, **KW)) / 2
    assert mid == pytest.approx((3e-3 + 3e-4) / 2, rel=1e-6)
    progress = (10999 - 2000) / (19999 - 2000)
    assert lr_at(10999, **KW) == pytest.approx(3e-4 + 0.5 * 2.7e-3 * (1 + math.cos(math.pi * progress)))


def test_floor_exactly_at_the_last_step_and_after():
    assert lr_at(19999, **KW) == pytest.approx(3e-4)
    assert lr_at(25000, **KW) == pytest.approx(3e-4)
    assert lr_at(19998, **KW) > 3e-4


def test_monotone_decay_and_no_warmup():
    lrs = [lr_at(s, **KW) for s in range(2000, 20000, 97)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))
    no_warm = dict(KW, warmup_steps=0)
    assert lr_at(0, **no_warm) == pytest.approx(3e-3)
    assert lr_at(19999, **no_warm) == pytest.approx(3e-4)


# --- warmup-stable-decay and linear -----------------------------------------------------------

WSD = dict(max_lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1, schedule="wsd",
           decay_fraction=0.2)


def test_wsd_holds_the_peak_then_decays_over_its_last_fraction():
    # 100 steps after warmup, 20% decaying: steps 90..109; 109 (the last) at the floor.
    assert wsd_decay_steps(10, 110, 0.2) == 20
    assert lr_at(9, **WSD) == 1.0
    assert all(lr_at(s, **WSD) == 1.0 for s in range(10, 90))
    assert lr_at(90, **WSD) == pytest.approx(0.1 + 0.9 * (1 - 1 / 20))
    assert lr_at(99, **WSD) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(109, **WSD) == pytest.approx(0.1)
    assert lr_at(500, **WSD) == pytest.approx(0.1)


@pytest.mark.parametrize("shape,at_half", [("linear", 0.5), ("1-sqrt", 1 - math.sqrt(0.5)),
                                           ("cosine", 0.5)])
def test_wsd_decay_shapes(shape, at_half):
    kw = dict(WSD, decay_shape=shape)
    assert lr_at(99, **kw) == pytest.approx(0.1 + 0.9 * at_half)   # progress 10/20
    assert lr_at(109, **kw) == pytest.approx(0.1)
    lrs = [lr_at(s, **kw) for s in range(0, 120)]
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))          # never rises after warmup
    if shape == "cosine":
        assert lr_at(91, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 2 / 20)))


def test_wsd_decay_rounds_up_and_a_whole_decay_is_linear_from_the_peak():
    assert wsd_decay_steps(0, 7, 0.5) == 4                       # 3.5 steps: 4
    assert wsd_decay_steps(5, 5, 0.2) == 1                       # nothing after warmup: 1
    whole = dict(WSD, decay_fraction=1.0)
    line = dict(WSD, schedule="linear")
    # decay_fraction 1: starts right after warmup, as the linear schedule does (which reaches
    # the floor at the same last step, from the peak at step 10 rather than one step later).
    assert lr_at(109, **whole) == lr_at(109, **line) == pytest.approx(0.1)
    assert lr_at(10, **whole) == pytest.approx(0.1 + 0.9 * (1 - 1 / 100))
    assert lr_at(10, **line) == 1.0
    assert lr_at(59, **line) == pytest.approx(0.1 + 0.9 * (1 - 49 / 99))


def test_the_schedule_is_said_in_words():
    assert describe("cosine", 0.1, 6e-4, 0.2, "linear") == "cosine to 0.1 × 0.0006"
    assert describe("wsd", 0.0, 0.02, 0.25, "1-sqrt") == \
        "wsd (the last 25% decaying, 1-sqrt) to 0 × 0.02"


def test_a_runs_config_gives_back_the_schedule_it_followed():
    """plot_run.py's LR panel: config.yaml's keys through the trainer's own lr_at; a run from
    before lr_schedule (no such key) followed the cosine."""
    from fp8train.analysis.metrics_reader import lr_schedule
    config = dict(learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1, lr_schedule="wsd",
                  lr_decay_fraction=0.2, lr_decay_shape="1-sqrt",
                  derived=dict(lr_schedule_steps=110, peak_learning_rate=1.0))
    steps, lrs = lr_schedule(config)
    got = dict(zip(steps, lrs, strict=True))       # the row of step N holds the LR of step N - 1
    assert got[90] == 1.0 and got[110] == pytest.approx(0.1)
    assert got[100] == pytest.approx(lr_at(99, **dict(WSD, decay_shape="1-sqrt")))
    old = {k: v for k, v in config.items() if not k.startswith("lr_")}
    assert dict(zip(*lr_schedule(old), strict=True))[60] == pytest.approx(
        lr_at(59, max_lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1))


def test_the_plotted_schedule_prints_the_wsd_turning_points(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from fp8train.analysis.plot import lr_schedule_plot
    out = tmp_path / "lr.png"
    assert lr_schedule_plot(10, 110, 1.0, 0.1, str(out), "wsd", 0.2, "linear") == 0
    values = dict(line.split() for line in capsys.readouterr().out.splitlines()[1:])
    assert float(values["89"]) == 1.0                      # the last step at the peak
    assert float(values["99"]) == pytest.approx(0.55)      # the decay's middle
    assert float(values["109"]) == pytest.approx(0.1)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fp8_until_is_a_fraction_of_the_schedule_or_a_step():
    from fp8train.optim.schedule import fp8_until_step
    assert fp8_until_step(None, 1000) is None
    assert fp8_until_step(0.8, 1000) == 800 and fp8_until_step(0.0001, 1000) == 1
    assert fp8_until_step(750, 1000) == 750 and fp8_until_step(1.0, 1000) == 1
