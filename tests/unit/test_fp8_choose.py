"""fp8train/precision/choose.py (fp8_recipe: auto, fp8_backend: auto) on CPU. The candidates,
their availability, the cache, the table and the choice are real; the timings are injected (a
CPU timing of emulated FP8 means nothing), and so are the numerics where a test needs a given
verdict. The real numerics check runs on CPU too, emulated: a sound recipe passes, a
deliberately broken one does not."""
import json

import pytest
import torch
from support.precision_shared import tiny_model

from fp8train.config.load import Config
from fp8train.errors import BadInput
from fp8train.precision import build_precision
from fp8train.precision.choose import MAX_GRAD_ERROR, MAX_OUTPUT_ERROR, choose, step_seconds
from fp8train.precision.numerics import checker, gaussian
from fp8train.precision.spec import Fp8Spec
from fp8train.precision.timing import Timed

CPU = torch.device("cpu")
# native delayed 2 ms per shape, current 1 ms; torchao tensorwise 1.5, rowwise 0.5; bf16 3 ms
SECONDS = {("native", "delayed"): 2e-3, ("native", "current"): 1e-3,
           ("torchao", "tensorwise"): 1.5e-3, ("torchao", "rowwise"): 0.5e-3}
GOOD = (0.03, 0.07)


class Log:
    def __init__(self):
        self.lines, self.warnings = [], []


class FakeTimer:
    """timing.LayerTimer's interface on made-up seconds: the base precision 3 ms per shape,
    each candidate `seconds[(backend, recipe)]`; every call recorded. `fail`: candidates whose
    timing raises; `host`: Python's share of a step (host / device)."""

    def __init__(self, seconds=SECONDS, fail=None, host=0.1):
        self.seconds, self.fail, self.host = seconds, fail or {}, host
        self.timed, self.graphs = [], 0

    def base(self, shape):
        self.timed.append(("base", shape))
        return Timed(3e-3, 3e-3 * self.host)

    def fp8(self, backend, shape):
        key = (backend.spec.backend, backend.spec.recipe)
        if key in self.fail:
            raise self.fail[key]
        self.timed.append((key, shape))
        self.graphs += 1
        return Timed(self.seconds[key], self.seconds[key] * self.host)

    def forget(self):
        self.timed.append(("forget", None))


def run_choose(tmp_path, numerics=None, saved=None, seconds=SECONDS, timer=None, **cfg):
    """choose() for the tiny model with injected timings (SECONDS per shape, bf16 3 ms) and
    numerics (GOOD unless `numerics` maps (backend, recipe) to other errors). Returns the
    precision, the log and the (candidate, shape) pairs timed."""
    config = Config(use_fp8=True, output_dir=str(tmp_path), fp8_layers="all", **cfg)
    prec = build_precision(config, CPU, warn=pytest.fail, run_dir=str(tmp_path))
    prec.set_tokens(4 * 64)
    timer = timer or FakeTimer(seconds)

    def numerics_for(backend):
        return (numerics or {}).get((backend.spec.backend, backend.spec.recipe), GOOD)

    log = Log()
    out = choose(prec, tiny_model(n_layer=2), saved, log.lines.append, log.warnings.append,
                 timer=timer, numerics_for=numerics_for)
    return out, log, [(k, shape) for k, shape in timer.timed if k not in ("base", "forget")]


def test_the_fastest_recipe_of_the_backend_is_chosen_and_its_timings_cached(tmp_path):
    """native, fp8_recipe auto: delayed and current timed over the model's 4 distinct shapes;
    current is twice as fast and chosen; the backend returned runs it; the table is in the log
    and in the derived values; a second start reads every timing from the cache."""
    prec, log, timed = run_choose(tmp_path, fp8_backend="native", fp8_recipe="auto")
    assert (prec.label, prec.spec.recipe, prec.spec.decided) == ("native", "current", "chosen")
    assert not prec.auto and len(timed) == 8 and {k for k, _ in timed} == {("native", "delayed"),
                                                          ("native", "current")}
    assert "fp8 auto: native current chosen" in log.lines
    rows = [line for line in log.lines if line.startswith("  native")]
    assert "slower: 2.00x the chosen one's time" in rows[0] and rows[1].endswith("chosen")
    choice = prec.fp8_choice
    assert choice["chosen"] == "native current" and len(choice["table"]) == 2
    assert choice["table"][1]["seconds"] == pytest.approx(4 * 1e-3 * 2)  # 4 shapes × 2 layers
    assert prec.tokens == 256
    cache = json.loads((tmp_path / "fp8_layers.json").read_text())
    assert len(cache["entries"] if "entries" in cache else cache) >= 2
    again, log, timed = run_choose(tmp_path, fp8_backend="native", fp8_recipe="auto")
    assert not timed and again.spec.recipe == "current"
    assert all(", cached)" in line for line in log.lines if line.startswith("  native"))


def test_a_faster_recipe_whose_numerics_fail_loses_to_a_slower_sound_one(tmp_path):
    bad = {("native", "current"): (0.5, 0.9)}
    prec, log, _ = run_choose(tmp_path, bad, fp8_backend="native", fp8_recipe="auto")
    assert prec.spec.recipe == "delayed"
    row = next(line for line in log.lines if line.startswith("  native current"))
    assert f"numerics: output error 50.0% (at most {MAX_OUTPUT_ERROR:.0%})" in row
    assert f"gradient 90.0% (at most {MAX_GRAD_ERROR:.0%})" in row


def test_fp8_backend_auto_weighs_every_backend_and_lists_the_ones_that_cannot_run(tmp_path):
    """fp8_backend auto: TE cannot run on this machine (listed with its reason, three recipes),
    torchao and native are timed; torchao rowwise is fastest and the returned backend is
    torchao's."""
    prec, log, timed = run_choose(tmp_path, fp8_backend="auto")
    assert (prec.label, prec.spec.recipe) == ("torchao", "rowwise")
    te_rows = [line for line in log.lines if line.startswith("  te ")]
    assert len(te_rows) == 3 and all("cannot run: Transformer Engine needs a CUDA GPU" in row
                                     for row in te_rows)
    assert {k for k, _ in timed} == set(SECONDS)


def test_when_no_recipe_passes_the_default_stays_with_a_warning(tmp_path):
    bad = {k: (0.9, 0.9) for k in SECONDS}
    prec, log, _ = run_choose(tmp_path, bad, fp8_backend="native", fp8_recipe="auto")
    assert prec.spec.recipe == "delayed" and prec.fp8_choice["chosen"] is None
    assert prec.spec.decided == "default"
    assert len(log.warnings) == 1 and "no recipe passed the numerics check" in log.warnings[0]


def test_a_resumed_run_keeps_its_checkpoints_choice_without_timing(tmp_path):
    saved = {"fp8_backend": "native", "fp8_recipe": "current"}
    prec, log, timed = run_choose(tmp_path, saved=saved, fp8_backend="auto")
    assert not timed and (prec.label, prec.spec.recipe) == ("native", "current")
    assert prec.spec.decided == "resumed"
    assert "as the resumed checkpoint's run chose" in log.lines[0]


def test_on_a_cpu_auto_times_nothing_and_takes_the_default(tmp_path):
    config = Config(use_fp8=True, fp8_backend="auto")
    prec = build_precision(config, CPU, warn=pytest.fail)
    assert (prec.label, prec.spec.recipe) == ("native", "delayed")   # provisional
    log = Log()
    out = choose(prec, tiny_model(), None, log.lines.append, log.warnings.append)
    assert out is prec and "nothing timed on cpu" in log.lines[0]
    assert (out.spec.decided, out.auto) == ("default", False)
    assert out.fp8_choice["chosen"] == "native delayed"


def test_with_fp8_layers_auto_a_recipe_is_timed_as_the_run_would_run_it():
    """Shapes where FP8 does not win by the margin count at their base-precision time."""
    timings = {(128, 384, True): (1.0, 0.5), (128, 128, True): (1.0, 0.99)}
    counts = {(128, 384, True): 2, (128, 128, True): 3}
    assert step_seconds(timings, counts, "auto", 0.05) == (2 * 0.5 + 3 * 1.0, 5.0)
    assert step_seconds(timings, counts, "all", 0.05) == (2 * 0.5 + 3 * 0.99, 5.0)


def test_the_numerics_check_passes_sound_recipes_and_fails_a_broken_one(monkeypatch):
    """The real check, emulated on CPU, on the tiny model's largest shape: native delayed and
    current land well inside the bounds; E5M2 inputs with scales 2^32 too small do not."""
    from fp8train.precision import native
    from fp8train.precision.scaling import E5M2
    shapes = [(128, 512, True)]
    check = checker(gaussian(shapes, CPU, 1024), CPU)
    for recipe in ("delayed", "current"):
        prec = build_precision(Config(use_fp8=True, fp8_backend="native", fp8_recipe=recipe),
                               CPU, warn=pytest.fail)
        out, grad = check(prec)
        assert 0 < out < MAX_OUTPUT_ERROR / 2 and 0 < grad < MAX_GRAD_ERROR / 2, (recipe, out,
                                                                                grad)
    monkeypatch.setattr(native, "FORMATS", dict(native.FORMATS, hybrid=(E5M2, E5M2)))
    update = native.update_delayed_scaling
    monkeypatch.setattr(native, "update_delayed_scaling",
                        lambda h, s, f, m, a: update(h, s, f, m + 32, a))
    prec = build_precision(Config(use_fp8=True, fp8_backend="native"), CPU, warn=pytest.fail)
    out, grad = check(prec)
    assert out > MAX_OUTPUT_ERROR and grad > MAX_GRAD_ERROR, (out, grad)


def test_provisional_takes_the_first_backend_that_runs_and_its_default_recipe():
    auto = Config(use_fp8=True, fp8_backend="auto")
    first = Fp8Spec.of(auto).provisional(lambda b: b == "torchao")
    assert (auto.fp8_recipe, first.backend, first.decided) == ("auto", "torchao", "provisional")
    assert Fp8Spec.of(auto).provisional(lambda b: False).recipe == "delayed"   # native's
    te = Config(use_fp8=True, fp8_backend="te", fp8_recipe="auto")
    assert Fp8Spec.of(te).provisional(lambda b: True).recipe == "delayed"
    named = Fp8Spec.of(Config(use_fp8=True, fp8_backend="torchao", fp8_recipe="rowwise"))
    assert named.provisional(lambda b: True) is named and named.decided == "config"


@pytest.mark.parametrize("keys, says", [
    (dict(fp8_backend="auto", fp8_recipe="current"),
     r"key 'fp8_recipe' \('current'\) applies only with a named fp8_backend \(auto chooses the "
     r"recipe too\), but fp8_backend is 'auto'"),
    (dict(fp8_backend="torchao", fp8_recipe="auto", fp8_fsdp_all_gather=True),
     "key 'fp8_fsdp_all_gather' .true. applies only with fp8_backend: torchao and fp8_recipe: "
     "tensorwise, but fp8_backend is 'torchao', fp8_recipe is 'auto'"),
])
def test_auto_with_keys_it_cannot_honour_is_one_config_error(keys, says):
    from fp8train.config.load import load_config
    with pytest.raises(BadInput, match=says):
        load_config(["--use_fp8", *(f"--{k}={v}" for k, v in keys.items())])


def test_a_candidate_that_fails_is_listed_with_why_and_the_others_still_compete(tmp_path):
    """An error while timing one candidate (out of memory at the run's token count, a kernel
    the GPU lacks) is that candidate's verdict; a NaN error fails its numerics."""
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    bad = {("native", "current"): (float("inf"), 0.1)}
    out, log, _ = run_choose(tmp_path, bad, timer=FakeTimer(fail={("torchao", "rowwise"): oom}),
                             fp8_backend="auto")
    assert (out.label, out.spec.recipe) == ("torchao", "tensorwise")
    row = next(line for line in log.lines if line.startswith("  torchao rowwise"))
    assert "failed: OutOfMemoryError: CUDA out of memory" in row
    assert "numerics: output error inf%" in next(
        line for line in log.lines if line.startswith("  native current"))


def test_fp8_slower_than_bf16_for_every_recipe_is_warned_about(tmp_path):
    slow = {k: 4e-3 for k in SECONDS}
    prec, log, _ = run_choose(tmp_path, seconds=slow, fp8_backend="native", fp8_recipe="auto")
    assert len(log.warnings) == 1 and "use_fp8: false trains faster" in log.warnings[0]
    assert "takes 1.33x their fp32 time" in log.warnings[0]


def test_a_finished_runs_config_reads_as_the_recipe_it_chose():
    """What scripts/evaluate.py builds to evaluate in FP8 (fp8_eval): the derived
    choice in place of auto; a named backend and recipe, or no choice recorded, stay as they
    are."""
    derived = {"fp8_backend": "torchao", "fp8_recipe": "rowwise"}
    spec = Fp8Spec.of(Config(use_fp8=True, fp8_backend="auto")).as_chosen(derived)
    assert (spec.backend, spec.recipe, spec.decided) == ("torchao", "rowwise", "resumed")
    named = Fp8Spec.of(Config(use_fp8=True, fp8_backend="native", fp8_recipe="current"))
    assert named.as_chosen(derived) is named
    auto = Fp8Spec.of(Config(use_fp8=True, fp8_recipe="auto"))
    assert auto.as_chosen({}) is auto
    # Built to evaluate the finished run: its choice, not a provisional backend to choose anew.
    prec = build_precision(Config(use_fp8=True, fp8_backend="auto"), CPU, pytest.fail,
                           chosen={"fp8_backend": "native", "fp8_recipe": "current"})
    assert (prec.spec.recipe, prec.spec.decided, prec.auto) == ("current", "resumed", False)


def test_a_plan_probed_again_for_the_chosen_recipe_builds_its_trials_with_it():
    """After fp8 auto chose, decide_batch's trials (each one `prec.fresh(device)`) build the
    chosen backend and recipe, not `auto` again (which would measure the provisional backend
    a second time), each a new object ready to convert."""
    chosen = build_precision(Config(use_fp8=True, fp8_backend="torchao", fp8_recipe="rowwise"),
                             CPU, warn=pytest.fail)
    from fp8train.model import GPT, model_config_from
    trial = chosen.fresh(CPU)
    assert trial is not chosen and trial.name == chosen.name
    for prec in (trial, chosen):
        prec.convert(GPT(model_config_from("tiny", 256, 64)))
    assert (trial.derived()["fp8_backend"], trial.derived()["fp8_recipe"]) == ("torchao",
                                                                               "rowwise")
    assert trial.derived()["fp8"] == chosen.derived()["fp8"]   # emulated on CPU, as the run
    plain = build_precision(Config(), CPU, warn=pytest.fail)
    assert plain.fresh(CPU) is not plain and plain.fresh(CPU).name == "fp32"


def test_the_cost_of_the_choice_is_logged_and_recorded(tmp_path):
    prec, log, _ = run_choose(tmp_path, fp8_backend="native", fp8_recipe="auto")
    line = next(x for x in log.lines if x.startswith("fp8 auto: 2 candidates"))
    assert "(2 measured) in " in line and "; 8 graphs compiled; budget 300 s" in line
    assert prec.fp8_choice["graphs"] == 8 and prec.fp8_choice["ranks"] == 1
    assert prec.fp8_choice["seconds"] >= 0


def test_candidates_past_the_budget_are_listed_as_not_timed(tmp_path):
    """fp8_choice_budget_s 0.1: each FP8 timing takes 0.05 s; after the first shape the two
    candidates are projected at 0.4 s, so current, the faster one but the second, is not
    timed, and delayed is (the first always is) and chosen; the table says why."""
    import time

    class Slow(FakeTimer):
        def fp8(self, backend, shape):
            time.sleep(0.05)
            return super().fp8(backend, shape)

    prec, log, timed = run_choose(tmp_path, timer=Slow(), fp8_backend="native",
                                  fp8_recipe="auto", fp8_choice_budget_s=0.1)
    assert prec.spec.recipe == "delayed"
    # the first shape of both (base, then each candidate), then delayed alone
    assert [k[1] for k, _ in timed] == ["delayed", "current", "delayed", "delayed", "delayed"]
    row = next(line for line in log.lines if line.startswith("  native current"))
    assert row.endswith("not timed: fp8_choice_budget_s (0.1 s) would be spent before it")
    assert "1 over the budget" in next(x for x in log.lines if "candidates (" in x)


def test_host_bound_timings_are_shown_and_warned_about(tmp_path):
    _, log, _ = run_choose(tmp_path, timer=FakeTimer(host=1.2), fp8_backend="native",
                           fp8_recipe="auto")
    rows = [line for line in log.lines if line.startswith("  native")]
    assert all("host/device 1.20 host-bound" in row for row in rows)
    assert any("host-bound" in w and "compile: true" in w for w in log.warnings)
    _, log, _ = run_choose(tmp_path / "b", timer=FakeTimer(host=0.1), fp8_backend="native",
                           fp8_recipe="auto")
    assert not log.warnings and all("host/device 0.10)" in row for row in log.lines
                                    if row.startswith("  native"))


def test_the_numerics_gate_runs_on_the_models_own_activations():
    """capture: the first Linear of each shape, its weights, the rows it was fed and the
    gradient at its output, from one forward and backward of the model on real tokens; the
    gate then checks a recipe on them (native delayed, emulated: sound)."""
    torch.manual_seed(0)
    model = tiny_model(n_layer=2)
    from fp8train.precision.layers import shape_of
    from fp8train.precision.numerics import capture
    from fp8train.precision.policy import eligible_shapes
    shapes = list(eligible_shapes(model, ["lm_head"]))
    seen = {}
    first = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            first.setdefault(shape_of(m), (name, m))
    def remember(mod, args, out):
        seen.setdefault(shape_of(mod), args[0].detach().reshape(-1, mod.in_features).clone())

    for name, m in first.values():
        m.register_forward_hook(remember)
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(1))
    base = build_precision(Config(), CPU, warn=pytest.fail)
    samples = capture(model, tokens, base, shapes)
    assert set(samples) == set(shapes)
    for shape, s in samples.items():
        assert torch.equal(s.x, seen[shape])                     # the rows the layer saw
        assert torch.equal(s.weight, first[shape][1].weight)     # its own weights
        assert s.grad.shape == (128, shape[1]) and s.grad.abs().sum() > 0
        # not unit noise (the Gaussian fallback):
        assert float(s.grad.std()) < 0.1   # gradients as small as the loss makes them
    prec = build_precision(Config(use_fp8=True, fp8_backend="native"), CPU, warn=pytest.fail)
    out, grad = checker(samples, CPU)(prec)
    assert 0 < out < MAX_OUTPUT_ERROR and 0 < grad < MAX_GRAD_ERROR, (out, grad)
