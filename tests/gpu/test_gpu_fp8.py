"""FP8 on a real GPU (H100/H200; skipped without CUDA, the FP8 parts without compute capability
8.9+): each backend, with its default recipe and the other recipes it offers without
Transformer Engine (native current scaling, torchao rowwise), trains the tiny model 100 steps,
eager and under torch.compile; the loss stays finite and within 2% of the bf16 run (3% of the
eager run of the same backend when compiled) at every logged step, the scales are logged, and
the native GEMMs match their emulation. fp8_layers auto's CUDA timer times each backend, and a
run times once, then reads the cache.

Tolerances hold for non-deterministic kernels (flash attention's backward accumulates in a
different order from run to run): two bf16 runs of the same seed differ by far less than 2%.
The tests marked gpu_quick are the quick tier (`pytest -m gpu_quick tests/gpu`)."""
import json
import math

import pytest
import torch
import yaml
from gpu_support import backend_skip, needs_corpus, needs_cuda, needs_fp8, run_train, train_rows
from support.runs import tiny_args

pytestmark = [pytest.mark.gpu, needs_cuda]

RUN = dict(max_steps=100, warmup_steps=10, learning_rate=1e-3, batch_size=16, seq_len=128,
           n_layer=4, log_interval=20, eval_interval=100, checkpoint_interval=100)
BACKENDS = ["native", "torchao", "te"]
quick = pytest.mark.gpu_quick
# (backend, fp8_recipe): None is the backend's default (native delayed, torchao tensorwise,
# TE delayed). TE's other recipes are in test_gpu_te_recipes.py.
RECIPES = [pytest.param("native", None, marks=quick), pytest.param("torchao", None, marks=quick),
           ("te", None), ("native", "current"), ("torchao", "rowwise")]


def losses(out):
    return [row["train/loss"] for row in train_rows(out)]


@pytest.fixture(scope="module")
def bf16_curve(tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16")
    r = run_train(*tiny_args(out, **RUN))
    assert r.returncode == 0, r.stderr[-3000:]
    return losses(out)


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    """fp8_run(backend, compile, recipe) -> (run directory, completed process): each run made
    once per module and shared by the tests that compare against it."""
    done = {}

    def run(backend: str, compile: bool = False, recipe=None):
        if (backend, compile, recipe) not in done:
            out = tmp_path_factory.mktemp(f"{backend}-{recipe or 'default'}-"
                                          f"{'compiled' if compile else 'eager'}")
            r = run_train(*tiny_args(out, **RUN), "--use_fp8", f"--fp8_backend={backend}",
                          "--fp8_fallback=error", "--fp8_layers=all",  # auto may keep tiny layers
                          f"--compile={str(compile).lower()}",
                          *([f"--fp8_recipe={recipe}"] if recipe else []))
            done[backend, compile, recipe] = (out, r)
        return done[backend, compile, recipe]

    return run


@needs_corpus
@needs_fp8
@pytest.mark.parametrize("backend,recipe", RECIPES)
def test_fp8_backend_tracks_bf16_on_gpu(bf16_curve, fp8_run, backend, recipe):
    backend_skip(backend)
    out, r = fp8_run(backend, recipe=recipe)
    assert r.returncode == 0, r.stderr[-3000:]
    d = yaml.safe_load(open(out / "config.yaml"))["derived"]
    assert d["fp8"] == backend and d["precision"] == "bf16" and d["fp8_layers"] == 16
    if recipe:
        assert d["fp8_recipe"] == recipe
    curve = losses(out)
    assert len(curve) == len(bf16_curve) == 5
    for a, b in zip(curve, bf16_curve):
        assert a == pytest.approx(b, rel=0.02), (backend, curve, bf16_curve)
    for row in train_rows(out):
        assert row["fp8/fwd_scale"] > 0 and row["fp8/bwd_scale"] > 0 and row["fp8/amax"] > 0
        assert "fp8/blocks.0.attn.qkv/fwd_scale_input" in row


@needs_corpus
@needs_fp8
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native", pytest.param("torchao", marks=quick), "te"])
def test_fp8_backend_trains_under_compile(fp8_run, backend):
    """--compile=true with each FP8 backend: the run trains (finite, falling loss) with every
    eligible layer converted, and tracks the eager run of the same backend within 3% at every
    logged step (compiled kernels round differently; FP8 numerics are the same). The scales
    are read inside the compiled graph (no graph break: the logged step costs one
    recompilation, once); the two runs' steady-state tokens/s are printed."""
    backend_skip(backend)
    out, r = fp8_run(backend, compile=True)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = yaml.safe_load(open(out / "config.yaml"))
    assert cfg["compile"] is True
    assert cfg["derived"]["fp8"] == backend and cfg["derived"]["fp8_layers"] == 16
    curve = losses(out)
    assert len(curve) == 5 and all(math.isfinite(x) for x in curve), curve
    assert curve[-1] < curve[0], curve
    eager_out, eager = fp8_run(backend)
    assert eager.returncode == 0, eager.stderr[-3000:]
    eager_curve = losses(eager_out)
    for a, b in zip(curve, eager_curve):
        assert a == pytest.approx(b, rel=0.03), (backend, curve, eager_curve)
    # every layer's scales, forward and backward, read inside the compiled graphs (a layer's
    # record lost to a split graph would read 0 and drag the geometric means to ~1e-28)
    last = train_rows(out)[-1]
    for layer in cfg["derived"]["fp8_layer_names"]:
        assert last[f"fp8/{layer}/fwd_scale_input"] > 0, layer
        assert last[f"fp8/{layer}/bwd_scale_grad_output"] > 0, layer
    eager_last = train_rows(eager_out)[-1]
    for agg in ("fp8/fwd_scale", "fp8/bwd_scale"):
        assert last[agg] == pytest.approx(eager_last[agg], rel=1.0), (agg, last, eager_last)
    speed = [json.load(open(o / "summary.json"))["tokens_per_sec"] for o in (out, eager_out)]
    print(f"{backend}: steady-state tokens/s compiled {speed[0]:,.0f}, eager {speed[1]:,.0f}")


@needs_fp8
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_device_timer_times_both_variants_of_a_shape(backend):
    backend_skip(backend)
    from fp8train.config.load import Config
    from fp8train.precision import build_precision, policy
    dev = torch.device("cuda")
    prec = build_precision(Config(use_fp8=True, fp8_backend=backend, fp8_fallback="error"), dev,
                           warn=pytest.fail)
    rng = torch.cuda.get_rng_state()
    base_s, fp8_s = policy.device_timer(prec, dev, 8192)((4096, 4096, True))
    assert 0 < base_s < 1 and 0 < fp8_s < 1, (base_s, fp8_s)
    assert torch.equal(torch.cuda.get_rng_state(), rng)   # the run's RNG is untouched
    print(f"{backend}: 4096 x 4096 at 8192 tokens: bf16 {base_s * 1e3:.3f} ms, "
          f"fp8 {fp8_s * 1e3:.3f} ms ({base_s / fp8_s:.2f}x)")


@needs_corpus
@needs_fp8
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


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@needs_fp8
@quick
def test_native_scaled_mm_matches_its_emulation_on_gpu():
    """The native backend's three GEMMs on torch._scaled_mm (forward with fast accumulation,
    both backward GEMMs without) give what its fp32 emulation gives, on the same FP8 operands
    and the same delayed scales. The loss is (y * g).sum() with a fixed random g, so that
    grad_output and with it every gradient is O(1) (a mean-square loss would make them ~1e-5,
    below any useful absolute tolerance), and the comparison is norm-relative: the only
    difference allowed is accumulation order and precision, measured as ||real - emu|| / ||emu||
    < 1e-2, while FP8 rounding itself moves these results by 3-6% from fp32 (asserted too, so
    that the comparison cannot pass because nothing was quantized). Three iterations: the first
    with the initial scale 1, the next two with scales from the amax history."""
    from torch import nn

    from fp8train.precision.native import Fp8Linear, Fp8State
    torch.manual_seed(0)
    base = nn.Linear(256, 512, device="cuda")
    x = torch.randn(256, 256, device="cuda")
    g = torch.randn(256, 512, device="cuda")   # d loss / d y
    reference = nn.Linear(256, 512, device="cuda")
    reference.load_state_dict(base.state_dict())
    xr = x.clone().requires_grad_()
    yr = reference(xr)
    (yr * g).sum().backward()
    exact = dict(y=yr.detach(), grad_x=xr.grad, grad_w=reference.weight.grad)

    results = {}
    for emulate in (False, True):
        state = Fp8State(["l"], emulate=emulate).cuda()
        layer = Fp8Linear.from_linear(nn.Linear(256, 512, device="cuda"), state, 0, "l")
        layer.load_state_dict(base.state_dict())
        steps = []
        for _ in range(3):
            xi = x.clone().requires_grad_()
            layer.zero_grad(set_to_none=True)
            y = layer(xi)
            (y * g).sum().backward()
            steps.append(dict(y=y.detach(), grad_x=xi.grad, grad_w=layer.weight.grad.clone(),
                              scale=state.scale.clone()))
            state.update()
        results[emulate] = steps
    for i, (real, emu) in enumerate(zip(results[False], results[True])):
        # Same operands, same amaxes: the delayed scales agree exactly.
        assert torch.equal(real["scale"], emu["scale"]), (i, real["scale"], emu["scale"])
        for name in ("y", "grad_x", "grad_w"):
            assert real[name].abs().mean() > 0.1, (i, name)      # O(1), not vanishing
            err = _relative_error(real[name], emu[name])
            fp8_err = _relative_error(emu[name], exact[name])
            assert err < 1e-2, (i, name, err, fp8_err)
            assert fp8_err > 2e-2, (i, name, fp8_err)   # FP8 really rounded the operands
    assert not torch.equal(results[True][1]["scale"], results[True][0]["scale"])  # scales moved


@needs_corpus
def test_fp16_with_loss_scaling_trains_on_gpu(tmp_path, bf16_curve):
    out = tmp_path / "fp16"
    r = run_train(*tiny_args(out, **RUN), "--precision=fp16")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = train_rows(out)
    assert all(row["train/loss_scale"] > 1 for row in rows)
    assert losses(out)[-1] == pytest.approx(bf16_curve[-1], rel=0.02)


@needs_corpus
@needs_fp8
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native", "torchao", "te"])
def test_muon_and_the_fp8_until_hand_over_on_gpu(tmp_path, backend):
    """Muon with each FP8 backend, compiled, with fp8_until handing the last 40% of the schedule
    to bf16 (the switch recompiles the graphs once): the run finishes with a falling, finite
    loss, says the hand-over once, and splits its tokens; Muon's orthogonalisation runs in bf16
    on the GPU (its cost in MFU)."""
    backend_skip(backend)
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, **dict(RUN, optimizer="muon", lr_schedule="wsd",
                                         min_lr_ratio=0.0)),
                  "--use_fp8", f"--fp8_backend={backend}", "--fp8_fallback=error",
                  "--fp8_layers=all", "--compile=true", "--fp8_until=0.6")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "optimizer: Muon" in r.stdout
    assert r.stdout.count("fp8_until: step 60 reached") == 1, r.stdout[-3000:]
    curve = losses(out)
    assert all(math.isfinite(x) for x in curve) and curve[-1] < curve[0], curve
    summary = json.load(open(out / "summary.json"))
    per_step = 16 * 2 * 128                      # micro 16 × accum 2 (tiny_args) × seq_len
    assert (summary["tokens_fp8"], summary["tokens_after_fp8"]) == (60 * per_step, 40 * per_step)
    assert summary["mfu"] is None or summary["mfu"] > 0


@needs_corpus
@needs_fp8
@pytest.mark.parametrize("backend", ["native", "torchao", "te"])
def test_the_loss_gap_check_on_gpu(tmp_path, backend, fp8_run):
    """fp8_check_interval 10, compiled (the check's bf16 forward is a graph of its own): ten
    rows of fp8/loss_gap, each under 1% of the loss, and the training curve that of the same run
    unchecked within 1% (GPU kernels are not bit-reproducible between processes)."""
    backend_skip(backend)
    base, r0 = fp8_run(backend, True)
    assert r0.returncode == 0, r0.stderr[-3000:]
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, **RUN), "--use_fp8", f"--fp8_backend={backend}",
                  "--fp8_fallback=error", "--fp8_layers=all", "--compile=true",
                  "--fp8_check_interval=10")
    assert r.returncode == 0, r.stderr[-3000:]
    gaps = [row for row in map(json.loads, open(out / "metrics.jsonl")) if "fp8/loss_gap" in row]
    assert [g["step"] for g in gaps] == list(range(10, 101, 10))
    assert all(abs(g["fp8/loss_gap_rel"]) < 0.01 for g in gaps), gaps
    for a, b in zip(losses(out), losses(base)):
        assert a == pytest.approx(b, rel=0.01)


@needs_corpus
@needs_fp8
@pytest.mark.parametrize("backend", ["native", "torchao", "te", "auto"])
def test_fp8_recipe_auto_times_the_recipes_and_runs_the_chosen_one(tmp_path, backend):
    """fp8_recipe auto (fp8_backend auto: every installed backend), compiled: each candidate is
    timed (a line of the table each, TE's block either timed or said not to run), the chosen
    recipe is the one config.yaml and summary.json record and the run trains with it; a second
    run in the same directory reads every timing from the cache."""
    if backend != "auto":
        backend_skip(backend)
    out = tmp_path / "run"
    args = [*tiny_args(out, **dict(RUN, max_steps=20)), "--use_fp8",
            f"--fp8_backend={backend}", "--fp8_recipe=auto", "--fp8_fallback=error",
            "--compile=true"]
    r = run_train(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("  ") and "ms (" in line]
    assert rows, r.stdout[-3000:]
    chosen = json.load(open(out / "summary.json"))["fp8_choice"]["chosen"]
    assert chosen and f"fp8 auto: {chosen} chosen" in r.stdout
    derived = yaml.safe_load(open(out / "config.yaml"))["derived"]
    assert f"{derived['fp8_backend']} {derived['fp8_recipe']}" == chosen
    r = run_train(*args[:-1], "--compile=true", f"--output_dir={tmp_path / 'again'}",
                  f"--batch_cache_dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    again = [line for line in r.stdout.splitlines() if line.startswith("  ") and "ms (" in line]
    assert again and all(", cached)" in line for line in again), r.stdout[-3000:]
