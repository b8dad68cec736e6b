"""fp8train/train/fp8_check.py in process: the high-precision forward of the check leaves every
piece of FP8 state and the RNG as they were (native, for real on CPU; Transformer Engine through
its stand-in, since TE's modules need CUDA), and the window, warning and remedy logic on given
gaps. End-to-end runs: tests/e2e/test_fp8_check.py."""
import math
from types import SimpleNamespace

import pytest
import torch
from support.fake_te import install_fake_te
from support.precision_shared import tiny_model

from fp8train.checkpoint.train_state import TrainState
from fp8train.config.load import Config
from fp8train.precision import build_precision
from fp8train.precision import te as te_backend
from fp8train.precision.spec import Fp8Spec
from fp8train.train.fp8_check import LossGapCheck

CPU = torch.device("cpu")


class Log:
    def __init__(self):
        self.warnings = []

    def warn(self, msg):
        self.warnings.append(msg)


def native(**cfg):
    torch.manual_seed(0)
    config = Config(use_fp8=True, fp8_backend="native", fp8_amax_history_len=4,
                    fp8_check_interval=1, **cfg)
    prec = build_precision(config, CPU, warn=pytest.fail)
    return config, prec.convert(tiny_model(n_layer=2)), prec


def fp8_state(model, prec):
    """Every tensor of the native FP8 state: the history and scales, each layer's amax record
    and watched-step statistics, and the weight cache."""
    out = {f"state.{k}": v.clone() for k, v in prec.state.state_dict().items()}
    for name, mod in model.named_modules():
        for b in ("fp8_amax", "fp8_stats"):
            if hasattr(mod, b):
                out[f"{name}.{b}"] = getattr(mod, b).clone()
    return out


def test_the_high_precision_forward_leaves_native_fp8_state_and_the_rng_as_they_were():
    """After two training micro-batches (a non-trivial history), on a watched step: the check's
    forward changes no FP8 tensor and no RNG state, and its loss is the same batch's loss in
    fp32, close to the FP8 forward's and not equal to it."""
    cfg, model, prec = native()
    x = torch.randint(0, 256, (4, 64))
    for _ in range(2):
        with prec.forward_context(training=True):
            model(x, x)[0].backward()
        prec.after_backward()
    prec.watch(True)
    before, rng = fp8_state(model, prec), torch.get_rng_state()
    check = LossGapCheck(cfg, prec, Log(), CPU)
    check.high_precision(lambda a, b: model(a, b), x, x)
    after = fp8_state(model, prec)
    assert before.keys() == after.keys() and all(before[k].equal(after[k]) for k in before)
    assert torch.get_rng_state().equal(rng)
    with torch.no_grad():
        with prec.high_precision():
            reference = model(x, x)[1]
        with prec.forward_context(training=True):
            fp8_ce = model(x, x)[1]
    assert check.high.item() == reference.item()
    gap, high = check.gap_tensor(fp8_ce).tolist()
    assert high == reference.item() and 0 < abs(gap) < 0.02 and check.high is None


def test_under_te_the_check_runs_outside_fp8_autocast(monkeypatch):
    """TE: the check's forward is in autocast(enabled=False) and enters no FP8 autocast. In TE's
    own code such a forward leaves the amax history and scales alone (init_fp8_metadata returns
    before allocating, and set_meta_tensor keeps existing delayed-scaling state), which the GPU
    test tests/gpu/test_gpu_te.py::test_the_loss_gap_check_leaves_tes_amax_history_alone
    checks on real TE."""
    te = install_fake_te(monkeypatch)
    cfg = Config(use_fp8=True, fp8_backend="te", fp8_check_interval=1)
    prec = te_backend.TransformerEngine(Fp8Spec.of(cfg),
                                        build_precision(Config(), CPU, pytest.fail))
    prec.te, prec.recipes = te, te.recipes
    model = prec.convert(tiny_model())
    x = torch.randint(0, 256, (2, 64))
    LossGapCheck(cfg, prec, Log(), CPU).high_precision(lambda a, b: model(a, b), x, x)
    assert te.entered == [(False, prec.recipe)]


def check_with(gaps, **cfg):
    """A check of a native backend given `gaps` one after the other, at steps 1, 2, ..."""
    config, model, prec = native(**cfg)
    log, st = Log(), TrainState()
    check = LossGapCheck(config, prec, log, CPU)
    rows = []
    for gap in gaps:
        st.step += 1
        rows.append(check.report(gap, 3.0, st))
    return check, prec, log, st, rows


def test_a_gap_beyond_the_bound_either_way_for_the_window_is_warned_about_once():
    """Three checks in a row beyond 0.05 (a negative gap counts: the model has adapted to
    FP8's errors; so does a NaN), after a run of two that did not make a window: one warning,
    and FP8 stays on with fp8_gap_action: warn."""
    check, prec, log, st, rows = check_with(
        [0.1, 0.2, 0.0, 0.1, -0.3, math.nan, 0.2, 0.2, 0.2])
    assert len(log.warnings) == 1 and "(step 6:" in log.warnings[0]
    assert "fp8_max_loss_gap 0.05 at 3 checks in a row" in log.warnings[0]
    assert not prec.disabled and prec.margin() == 0
    assert rows[4] == {"step": 5, "tokens": 0, "fp8/loss_gap": -0.3,
                       "fp8/loss_gap_rel": pytest.approx(-0.1)}
    assert check.summary() == {"fp8_loss_gap": dict(checks=9, last=0.2,
                                                    mean=pytest.approx(0.7 / 8), max=-0.3)}


def test_recover_raises_the_margin_then_switches_fp8_off_if_the_gap_stays():
    """fp8_gap_action: recover, fp8_recovery: margin, a window of 2: the first window raises
    the margin (recorded in the precision's state, which checkpoints keep for resume), the next
    switches FP8 off, with its reason in the precision's description; checks then stop being
    due."""
    check, prec, log, st, rows = check_with([0.1] * 4, fp8_gap_action="recover",
                                            fp8_gap_window=2)
    assert [("recovery/fp8_on" in r, r.get("recovery/fp8_on")) for r in rows] == \
        [(False, None), (True, 1), (False, None), (True, 0)]
    assert "fp8_margin 0 -> 1" in log.warnings[0] and "FP8 switched off" in log.warnings[1]
    assert prec.state_dict() == dict(margin_added=1, off=True, handed_over=False,
                                     handed_over_tokens=None,
                                     off_reason="for its loss gap (fp8_gap_action: recover)")
    assert "switched off for its loss gap" in prec.derived()["fp8"]
    assert not check.due(5)


def test_checks_are_due_every_interval_while_fp8_is_on_only():
    config, model, prec = native()
    check = LossGapCheck(SimpleNamespace(**{**vars(config), "fp8_check_interval": 4}), prec,
                         Log(), CPU)
    assert [s for s in range(1, 13) if check.due(s)] == [4, 8, 12]
    prec.recover("bf16")
    assert not check.due(16)
    plain = build_precision(Config(fp8_check_interval=4), CPU, warn=pytest.fail)
    assert not LossGapCheck(Config(fp8_check_interval=4), plain, Log(), CPU).due(4)
    assert LossGapCheck(config, prec, Log(), CPU).summary() == {}
