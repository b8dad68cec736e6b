"""LR schedule: exact values at the points that define it."""
import math

import pytest

from fp8train.train.schedule import lr_at

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
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    no_warm = dict(KW, warmup_steps=0)
    assert lr_at(0, **no_warm) == pytest.approx(3e-3)
    assert lr_at(19999, **no_warm) == pytest.approx(3e-4)
