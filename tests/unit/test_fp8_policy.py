"""In-process tests: fp8_layers (all | min_size | auto) on CPU. The auto decision, its cache and
the agreement between ranks take an injected timer here (made-up timings, calls counted); the
CUDA ... The whole story, and the tests that start processes: tests/e2e/test_fp8_policy.py."""


import json

import pytest
import torch
from support.fp8_policy_shared import CPU, WINS
from torch import nn

from fp8train.config.load import Config, load_config
from fp8train.errors import BadInput
from fp8train.precision import build_precision, policy
from fp8train.precision.layers import select_linears
from fp8train.precision.native import Fp8Linear
from fp8train.precision.plain import FP32
from fp8train.precision.spec import Fp8Spec
from fp8train.precision.te import TransformerEngine, recipe_kwargs
from fp8train.ranks import on_rank0

CLOSE = (64, 64, False)      # FP8 3% faster: below the 5% margin


LOSES = (128, 64, True)      # FP8 slower


TIMES = {WINS: (2e-3, 1e-3), CLOSE: (1.03e-3, 1e-3), LOSES: (1e-3, 1.5e-3)}


def model():
    m = nn.Sequential()
    m.add_module("a1", nn.Linear(64, 128))
    m.add_module("b", nn.Linear(64, 64, bias=False))
    m.add_module("c1", nn.Linear(128, 64))
    m.add_module("a2", nn.Linear(64, 128))
    m.add_module("c2", nn.Linear(128, 64))
    m.add_module("odd", nn.Linear(64, 40))          # not divisible by 16: never timed
    m.add_module("lm_head", nn.Linear(64, 256))     # excluded by default: never timed
    return m


class FakeTimer:
    def __init__(self, times=TIMES):
        self.times, self.calls = times, []

    def __call__(self, shape):
        self.calls.append(shape)
        return self.times[shape]


def backend(tmp_path, timer=None, tokens=256, lines=None, **kw):
    cfg = Config(use_fp8=True, fp8_backend="native", output_dir=str(tmp_path), **kw)
    prec = build_precision(cfg, CPU, warn=pytest.fail)
    prec.timer = timer
    if tokens is not None:
        prec.set_tokens(tokens, (lines if lines is not None else []).append)
    return prec


def test_auto_converts_exactly_the_shapes_where_fp8_wins_by_the_margin(tmp_path):
    timer, lines = FakeTimer(), []
    prec = backend(tmp_path, timer, lines=lines)
    m = prec.convert(model())
    sel = prec.selection
    assert sel.chosen == ["a1", "a2"]
    assert isinstance(m.a1, Fp8Linear) and type(m.b) is nn.Linear and type(m.c2) is nn.Linear
    assert sel.skipped["b"] == "auto: FP8 1.00 ms vs fp32 1.03 ms"   # 3% < 5%: kept
    assert sel.skipped["c1"] == sel.skipped["c2"] == "auto: FP8 1.50 ms vs fp32 1.00 ms"
    assert sel.skipped["odd"] == "dims not divisible by 16"
    assert sel.skipped["lm_head"] == "excluded by fp8_exclude"
    # one timing per distinct eligible shape, in model order
    assert timer.calls == [WINS, CLOSE, LOSES]
    assert "kept in high precision: c1, c2 (auto: FP8 1.50 ms vs fp32 1.00 ms)" in sel.describe()
    # the table: header, column names, one row per shape with its layer count
    assert lines[0].startswith("fp8_layers auto: forward + backward of one layer at 256 tokens,"
                               " fp32 vs FP8 native; FP8 where at least 1.05× faster (timed in ")
    assert lines[1].split() == ["shape", "(in", "×", "out)", "layers", "fp32", "ms", "fp8", "ms",
                                "speed-up", "decision"]
    rows = {line.split("  ")[1].strip(): line.split() for line in lines[2:]}
    assert rows["64 × 128 + bias"][-5:] == ["2", "2.000", "1.000", "2.00×", "fp8"]
    assert rows["64 × 64"][-5:] == ["1", "1.030", "1.000", "1.03×", "fp32"]
    assert rows["128 × 64 + bias"][-5:] == ["2", "1.000", "1.500", "0.67×", "fp32"]
    assert prec.derived()["fp8_layer_policy"] == "auto: 1/3 shapes in FP8 (timed at 256 tokens)"


def test_margin_zero_converts_every_shape_that_is_faster_at_all(tmp_path):
    prec = backend(tmp_path, FakeTimer(), fp8_auto_margin=0.0)
    prec.convert(model())
    assert prec.selection.chosen == ["a1", "b", "a2"]


def test_cache_hit_times_nothing_and_says_cached(tmp_path):
    first = FakeTimer()
    backend(tmp_path, first).convert(model())
    path = tmp_path / "fp8_layers.json"
    entry, = json.loads(path.read_text()).values()
    assert entry["key"]["tokens"] == 256 and entry["key"]["backend"] == "native"
    assert sorted(map(tuple, entry["key"]["shapes"])) == sorted([WINS, CLOSE, LOSES])
    again, lines = FakeTimer(), []
    prec = backend(tmp_path, again, lines=lines)
    prec.convert(model())
    assert again.calls == [] and prec.selection.chosen == ["a1", "a2"]
    assert f"(cached in {path}: nothing timed)" in lines[0]
    assert prec.layer_policy == "auto: 1/3 shapes in FP8 (cached at 256 tokens)"
    # the margin is applied after the cache: a new margin re-decides without timing
    prec = backend(tmp_path, again, fp8_auto_margin=0.0)
    prec.convert(model())
    assert again.calls == [] and prec.selection.chosen == ["a1", "b", "a2"]


@pytest.mark.parametrize("change", ["tokens", "versions", "format", "reprobe", "damaged"])
def test_a_changed_key_times_again(tmp_path, monkeypatch, change):
    backend(tmp_path, FakeTimer()).convert(model())
    kw, tokens = {}, 256
    if change == "tokens":
        tokens = 512
    elif change == "versions":
        real = policy.versions
        monkeypatch.setattr(policy, "versions", lambda b: {**real(b), "torch": "99.0"})
    elif change == "format":
        kw["fp8_format"] = "e4m3"
    elif change == "reprobe":
        kw["reprobe"] = True
    else:
        (tmp_path / "fp8_layers.json").write_text("{not json")
    timer = FakeTimer()
    backend(tmp_path, timer, tokens=tokens, **kw).convert(model())
    assert timer.calls == [WINS, CLOSE, LOSES]


def test_an_unwritable_cache_is_reported_and_the_run_goes_on(tmp_path):
    (tmp_path / "fp8_layers.json").mkdir()     # a directory where the file should be
    lines = []
    prec = backend(tmp_path, FakeTimer(), lines=lines)
    prec.convert(model())
    assert prec.selection.chosen == ["a1", "a2"] and "not cached: cannot write" in lines[0]


def test_cache_lives_beside_the_batch_probe_cache(tmp_path):
    cfg = Config(output_dir=str(tmp_path / "run"), batch_cache_dir=str(tmp_path / "shared"))
    assert policy.cache_path(Fp8Spec.of(cfg)) == str(tmp_path / "shared" / "fp8_layers.json")
    assert policy.cache_path(Fp8Spec.of(Config(output_dir="runs/x"))) == \
        "runs/x/fp8_layers.json"
    # A sweep trial's own directory (run_dir) when batch_cache_dir is unset.
    assert policy.cache_path(Fp8Spec.of(Config(output_dir="runs/x"), "runs/x/trial-3")) == \
        "runs/x/trial-3/fp8_layers.json"


def test_all_and_min_size_give_the_old_selections_without_timing(tmp_path):
    timer = FakeTimer()
    prec = backend(tmp_path, timer, fp8_layers="all")
    prec.convert(model())
    old_all = select_linears(model(), 0, ["lm_head"])
    assert prec.selection == old_all and prec.selection.chosen == ["a1", "b", "c1", "a2", "c2"]
    prec = backend(tmp_path, timer, fp8_layers="min_size", fp8_min_layer_size=8192)
    prec.convert(model())
    assert prec.selection == select_linears(model(), 8192, ["lm_head"])
    assert prec.selection.chosen == ["a1", "c1", "a2", "c2"]
    assert prec.selection.skipped["b"] == "smaller than fp8_min_layer_size 8,192"
    assert prec.derived()["fp8_layer_policy"] == "min_size"
    assert timer.calls == [] and not (tmp_path / "fp8_layers.json").exists()


def test_auto_on_cpu_is_all_with_a_one_line_note(tmp_path):
    lines = []
    prec = backend(tmp_path, timer=None, lines=lines)    # no injected timer: the real path
    prec.convert(model())
    assert prec.selection == select_linears(model(), 0, ["lm_head"])
    assert lines == ["fp8_layers auto: nothing timed on cpu (FP8 is emulated there, always "
                     "slower): every eligible layer is converted, as with fp8_layers: all"]
    assert prec.derived()["fp8_layer_policy"] == "auto: as all (cpu, FP8 emulated: not timed)"
    assert not (tmp_path / "fp8_layers.json").exists()


def test_without_a_token_count_auto_times_nothing(tmp_path):
    """The micro-batch probe's throw-away precisions never get set_tokens: auto is all there."""
    timer = FakeTimer()
    prec = backend(tmp_path, timer, tokens=None)
    prec.convert(model())
    assert timer.calls == [] and prec.selection.chosen == ["a1", "b", "c1", "a2", "c2"]


def test_plain_precisions_accept_the_token_count():
    plain = build_precision(Config(), CPU, warn=pytest.fail)
    plain.set_tokens(1024, print)
    assert plain.convert(model()) is not None


class FakeGroup:
    """all_gather_object between ranks run one after the other: each rank sees what the ranks
    before it sent (rank 0 goes first, as it would block the others in a real gather)."""

    def __init__(self, world=2):
        self.sent = [None] * world

    def gather_for(self, rank):
        def gather(obj):
            self.sent[rank] = obj
            return list(self.sent)
        return gather


def test_rank0_times_and_every_rank_makes_its_decision(tmp_path):
    counts = policy.eligible_shapes(model(), ["lm_head"])
    assert dict(counts) == {WINS: 2, CLOSE: 1, LOSES: 2}
    key = policy.cache_key("GPU", "native", {}, "bf16", {}, 256, counts)
    path = str(tmp_path / "fp8_layers.json")
    group, results = FakeGroup(), []
    rank0_timer = FakeTimer()

    def never(shape):
        pytest.fail("only rank 0 times")

    for rank, timer in [(0, rank0_timer), (1, never)]:
        lines = []
        keep, measured = policy.decide(counts, key, path, timer, 0.05, "bf16", "native", 256,
                                       lines.append, rank=rank, world=2,
                                       gather=group.gather_for(rank))
        results.append((keep, measured.timings, lines))
    assert results[0] == results[1]
    assert set(results[0][0]) == {CLOSE, LOSES} and len(rank0_timer.calls) == 3


def test_an_error_on_rank0_stops_every_rank_with_its_message():
    group, errors = FakeGroup(), []

    def broken():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    for rank in (0, 1):
        with pytest.raises(RuntimeError) as e:
            on_rank0(broken if rank == 0 else pytest.fail,
                     "fp8_layers auto: timing the layer shapes", rank=rank,
                     gather_fn=group.gather_for(rank))
        errors.append(str(e.value))
    assert errors[0] == errors[1]
    assert errors[0].startswith("fp8_layers auto: timing the layer shapes failed on rank 0: "
                                "OutOfMemoryError: CUDA out of memory.")


@pytest.mark.parametrize("name", ["native", "torchao"])
def test_timer_steps_run_the_backends_converted_layer_forward_and_backward(name):
    """What the device timer times, on CPU (the FP8 GEMMs emulated): the backend's own
    conversion of one Linear and a training step of it; the run's backend is left as it was."""
    from fp8train.precision import timing
    if name == "torchao":
        pytest.importorskip("torchao")
        from torchao.float8.float8_linear import Float8Linear as converted
    else:
        converted = Fp8Linear
    prec = build_precision(Config(use_fp8=True, fp8_backend=name), CPU, warn=pytest.fail)
    trial, layer = timing.fp8_layer(WINS, prec, CPU)
    assert isinstance(layer, converted) and trial is not prec and trial.emulate
    assert prec.selection is None
    step = timing.layer_step(layer, torch.randn(32, 64, requires_grad=True), prec.base, trial)
    step()
    step()
    if name == "native":       # a real training step: amaxes recorded, scales updated
        assert (trial.state.scale != 1).all()
    timer = timing.LayerTimer(CPU, 32, prec.base, prec.spec, warmup=1, repeats=1, iters=1)
    base, fp8 = timer.base(WINS), timer.fp8(prec, WINS)
    assert base.seconds > 0 and fp8.seconds > 0 and base.host_ratio == 1.0  # CPU: one clock
    assert timer.base(WINS) is base     # the base precision once per shape


def test_timing_warms_up_drops_the_first_round_and_takes_the_median(monkeypatch):
    """warmup steps first; then repeats + 1 rounds of iters steps, the first only measuring
    Python's queuing; the median round of the others."""
    from fp8train.precision import timing
    clock, calls = [0.0], []
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])

    def step():
        calls.append(1)
        # the 3 warm-up steps slow (compiling), one slow outlier round later: both ignored
        clock[0] += 5.0 if len(calls) <= 3 else 0.05 if 3 + 4 < len(calls) <= 3 + 8 else 0.002

    timer = timing.LayerTimer(CPU, 8, None, Fp8Spec.of(Config()), warmup=3, repeats=5, iters=4)
    timed = timer._time(step)
    assert len(calls) == 3 + 6 * 4
    assert timed.seconds == pytest.approx(0.002) and timed.host_seconds == pytest.approx(0.002)


def test_config_keys():
    cfg = load_config([])
    assert (cfg.fp8_layers, cfg.fp8_auto_margin, cfg.fp8_min_layer_size) == ("auto", 0.05, 0)
    assert load_config(["--use_fp8", "--fp8_layers=min_size",
                        "--fp8_min_layer_size=4096"]).fp8_layers == "min_size"
    for argv, key in [(["--fp8_layers=some"], "'fp8_layers'"),
                      (["--fp8_auto_margin=-0.1"], "'fp8_auto_margin'"),
                      (["--use_fp8", "--fp8_min_layer_size=4096"], "'fp8_min_layer_size'"),
                      (["--use_fp8", "--fp8_layers=all", "--fp8_min_layer_size=1"],
                       "'fp8_min_layer_size'")]:
        with pytest.raises(BadInput) as e:
            load_config(argv)
        assert key in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(BadInput, match="applies only with fp8_layers: min_size, but "
                                          "fp8_layers is 'auto'"):
        load_config(["--use_fp8", "--fp8_min_layer_size=4096"])


def test_timing_copies_convert_everything_and_te_does_not_reduce_amax_over_ranks():
    cfg = Config(use_fp8=True, fp8_backend="te", fp8_exclude=["*"], fp8_log_layers=True)
    spec = Fp8Spec.of(cfg)
    te = TransformerEngine(spec, FP32())
    copy = te.timing_copy()
    assert type(copy) is TransformerEngine and copy.base is te.base
    assert (copy.spec.layers, copy.spec.exclude, copy.spec.log_layers) == \
        ("all", (), False)
    assert te.reduce_amax is True and copy.reduce_amax is False
    assert recipe_kwargs(spec)["reduce_amax"] is True
    assert recipe_kwargs(spec, reduce_amax=False)["reduce_amax"] is False
    assert te.spec.exclude == ("*",)   # the run's own spec is untouched


def test_a_resumed_run_converts_the_checkpoints_layers_without_timing():
    """fp8_layers auto on resume: the checkpoint's recorded decision, not a new timing (the
    weights load only into the same layers); a pre-policy checkpoint means every layer."""
    from fp8train.config.load import Config
    from fp8train.model import GPT, model_config_from
    from fp8train.precision import build_precision
    cpu = torch.device("cpu")

    def fresh():
        prec = build_precision(Config(use_fp8=True, fp8_backend="native"), cpu, warn=pytest.fail)
        prec.set_tokens(4096)
        prec.timer = lambda shape: pytest.fail("timed on resume")
        return prec, GPT(model_config_from("tiny", 256, 64))

    prec, model = fresh()
    names = ["blocks.0.attn.qkv", "blocks.1.mlp.fc"]
    prec.resume_layers({"fp8": "native (emulated on CPU)", "fp8_layer_names": names})
    assert prec.select(model) == names
    assert prec.selection.skipped["blocks.0.mlp.fc"] == \
        "kept in high precision, as in the resumed checkpoint"
    assert prec.derived()["fp8_layer_names"] == names
    prec, model = fresh()
    prec.resume_layers({"fp8": "native"})                # written before fp8_layers existed
    assert len(prec.select(model)) == 16
    prec, model = fresh()
    prec.resume_layers({"fp8": "off (fallback: ...)"})  # a bf16 checkpoint: decide as usual
    assert prec.resumed_layers is None
