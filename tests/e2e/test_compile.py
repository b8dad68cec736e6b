"""Per-block compile (fp8train/compile.py) with the real compiler, in process: every block runs
compiled and all of them share one graph, the output layer and loss are a region of their own,
and training gives eager's numbers, alone, under activation checkpointing, under DDP and with
FP8 layers. A compile that silently does not run fails these tests: they count the frames
torch compiled. (In-process compiles of tens of seconds each, hence the e2e tier; the fast
checks of the module are in tests/unit/test_compile.py.)"""
import pytest
import torch

from fp8train.compile import compile_model
from fp8train.config.load import Config
from fp8train.model import GPT, model_config_from
from fp8train.precision import build_precision


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def frames() -> int:
    """The frames dynamo compiled so far (test-only: dynamo's own counters)."""
    return torch._dynamo.utils.counters["frames"]["ok"]


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    preset = kw.pop("preset", "tiny-llama")
    return GPT(model_config_from(preset, 256, 32, **{"n_layer": 4, "n_embd": 64, **kw}))


def train(model, run, steps: int = 3, prec=None, ac: bool = False):
    """Losses and final gradients of `steps` AdamW steps of `run` (model compiled or not)."""
    model.activation_checkpointing = ac
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 32), generator=gen)
        ctx = prec.forward_context(training=True) if prec else torch.autocast("cpu",
                                                                                enabled=False)
        with ctx:
            loss, _, _ = run(x, x.roll(-1, 1))
        loss.backward()
        if prec:
            prec.after_backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def compiled(model, scope="blocks"):
    run, how = compile_model(model, Config(compile=True, compile_scope=scope))
    return run, how


def assert_same(a, b, rtol=1e-4):
    (la, ga), (lb, gb) = a, b
    assert la == pytest.approx(lb, rel=rtol)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=rtol * 10, atol=1e-6, msg=name)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny"])
def test_every_block_runs_compiled_from_one_graph_with_eager_numbers(preset):
    eager = train(*[tiny(preset=preset)] * 2)
    model = tiny(preset=preset)
    names = [n for n, _ in model.named_parameters()]
    run, how = compiled(model)
    assert run is model and "per block (4 Block blocks" in how
    out = train(model, run)
    # Two frames: Block.forward, traced once for all four blocks, and output_loss. A compile
    # that did not run would count none; one graph per block would count four more.
    assert frames() == 2 and graphs() == 2
    assert [n for n, _ in model.named_parameters()] == names   # checkpoints keep their keys
    assert_same(out, eager)


def test_the_whole_model_is_one_frame():
    eager = train(*[tiny()] * 2)
    model = tiny()
    run, how = compiled(model, "model")
    assert run is not model and "the whole model" in how
    out = train(model, run)
    assert frames() == 1
    assert_same(out, eager)


def test_activation_checkpointing_recomputes_compiled_blocks_with_eager_gradients():
    eager = train(*[tiny()] * 2, ac=True)
    model = tiny()
    run, _ = compiled(model)
    out = train(model, run, ac=True)
    assert frames() == 2 and graphs() == 2
    assert_same(out, eager)


def test_blocks_compiled_inside_ddp_train_like_eager(gloo_world_of_one):
    """Under DDP the blocks found inside the wrapper are compiled in place; dynamo splits each
    block's graph at DDP's bucket boundaries (1 MB buckets, 3 MB blocks), the same split for
    every block, and DDP's gradient hooks see every block's gradients."""
    eager = train(*[tiny(n_embd=256)] * 2)
    model = tiny(n_embd=256)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    run, how = compiled(ddp)
    assert run is ddp and "per block" in how
    out = train(model, run)
    assert graphs() == 2, graphs()   # dynamo's graphs; the bucket split is below them
    assert_same(out, eager)


@pytest.mark.parametrize("backend", ["native", "torchao"])
def test_fp8_blocks_share_one_graph_and_every_layer_reports_its_scales(backend):
    """FP8 layers inside compiled blocks: a plain and a watched step are two graphs of the
    same block code (not one per block), the watched step reads every layer's scales, and the
    losses follow the eager FP8 run."""
    pytest.importorskip("torchao")

    def converted():
        prec = build_precision(Config(use_fp8=True, fp8_backend=backend, fp8_layers="all"),
                               torch.device("cpu"), warn=pytest.fail)
        return prec, prec.convert(tiny())

    prec_e, eager_model = converted()
    eager = train(eager_model, eager_model, prec=prec_e)
    prec, model = converted()
    run, _ = compiled(model)
    out = train(model, run, prec=prec)
    prec.watch(True)
    with prec.forward_context(training=True):
        loss, _, _ = run(*(torch.randint(0, 256, (4, 32)),) * 2)
    loss.backward()
    prec.after_backward()
    stats = {k: v.item() for k, v in prec.stats().items()}
    prec.watch(False)
    names = prec.selection.chosen
    assert len(names) == 16
    for name in names:
        assert stats[f"fp8/{name}/fwd_scale_input"] > 0, name
        assert stats[f"fp8/{name}/bwd_scale_grad_output"] > 0, name
    block_graphs = graphs() - 1   # less output_loss's
    assert block_graphs <= 2, block_graphs   # plain and watched, shared by the four blocks
    assert out[0] == pytest.approx(eager[0], rel=1e-3)
