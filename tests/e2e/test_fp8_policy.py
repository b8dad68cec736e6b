"""fp8_layers (all | min_size | auto) on CPU. The auto decision, its cache and the agreement
between ranks take an injected timer here (made-up timings, calls counted); the CUDA timer
itself needs a GPU (tests/gpu). A real run through train_fp8.py checks the CPU path of auto."""


import pytest
import torch
import yaml
from support.fp8_policy_shared import CPU, WINS
from support.runs import run_train, tiny_args

from fp8train.config.load import Config
from fp8train.precision import build_precision, policy


@pytest.mark.parametrize("compile_", [False, True])
def test_timer_steps_are_compiled_when_the_run_compiles(compile_):
    """torchao's casts (and the native ones) pay off only fused: timing them eagerly for a
    compiled run would keep layers in high precision that win there. Both variants of a shape
    run as the run will: compiled with the run's compile_mode, or eager."""
    from torch._dynamo.eval_frame import OptimizedModule

    from fp8train.precision.timing import LayerTimer, fp8_layer
    prec = build_precision(Config(use_fp8=True, fp8_backend="native", compile=compile_),
                           CPU, warn=pytest.fail)
    timer = LayerTimer(CPU, 32, prec.base, prec.spec)
    trial, layer = fp8_layer(WINS, prec, CPU)
    steps = [timer._step(torch.nn.Linear(*WINS), None), timer._step(layer, trial)]
    for step in steps:
        assert isinstance(step.layer, OptimizedModule) == compile_
    assert timer.graphs == 2 * compile_
    steps[1]()                      # the FP8 layer really runs that way (CPU: emulated)
    settings = policy.backend_settings(prec)
    assert ("compile_mode" in settings) == compile_   # eager and compiled timings cached apart


def test_train_with_auto_on_cpu_converts_every_layer_and_says_why(tmp_path):
    """Through train_fp8.py with the micro-batch probe on: the probe's models convert without
    the note, the run's model prints it once and converts all 8 Linears."""
    out = tmp_path / "auto"
    r = run_train(*tiny_args(out, max_steps=4, warmup_steps=1, log_interval=2, eval_interval=4,
                             checkpoint_interval=4, gradient_accumulation_steps="null",
                             auto_batch_size="true", target_effective_batch_size=8,
                             max_batch_size=4, eval_samples=0),
                  "--use_fp8", "--fp8_backend=native", "--fp8_layers=auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("fp8_layers auto: nothing timed on cpu") == 1, r.stdout
    assert "batch discovery: probing" in r.stdout
    assert "FP8: converted 8/8 linear layers" in r.stdout
    d = yaml.safe_load(open(out / "config.yaml"))["derived"]
    assert d["fp8_layers"] == 8 and d["fp8_layer_policy"].startswith("auto: as all (cpu")
    assert not (out / "fp8_layers.json").exists()


def test_fp8_auto_compiles_the_base_once_per_shape_and_each_candidate_once(tmp_path):
    """fp8_recipe auto under compile: true, the real timer on CPU (torchao emulated): two
    shapes (the MLP's), the base precision compiled and timed once per shape, then each of
    the two candidates once per shape, dynamo forgetting them in between; the graphs counted
    by the choice are the graphs dynamo built, and the log says how many."""
    from support.precision_shared import tiny_model

    from fp8train.precision.choose import choose
    from fp8train.precision.timing import LayerTimer
    pytest.importorskip("torchao")
    config = Config(use_fp8=True, fp8_backend="torchao", fp8_recipe="auto", compile=True,
                    fp8_layers="all", output_dir=str(tmp_path),
                    fp8_exclude=["lm_head", "*.attn.*"])
    prec = build_precision(config, CPU, warn=pytest.fail, run_dir=str(tmp_path))
    prec.set_tokens(64)
    timer = LayerTimer(CPU, 64, prec.base, prec.spec, warmup=1, repeats=1, iters=1)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    lines = []
    out = choose(prec, tiny_model(n_layer=1, n_embd=64), None, lines.append, lines.append,
                 timer=timer, numerics_for=lambda backend: (0.03, 0.07))
    assert timer.graphs == 2 + 2 * 2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == timer.graphs
    assert out.fp8_choice["graphs"] == 6
    assert any("; 6 graphs compiled; budget 300 s" in line for line in lines), lines
    torch._dynamo.reset()
