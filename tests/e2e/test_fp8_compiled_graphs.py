"""FP8 layers and their scale read-out inside torch.compile's graphs as a GPU run builds them,
on CPU: DDP's compiled graphs split at bucket boundaries (one process over gloo, buckets small
enough to split a 4-layer model many times), and activation checkpointing. Every layer writes
only tensors of its own: a tensor shared by all of them, written in place by each, made the
backward of the first logged step fail under DDP ("modified by an inplace operation"), read
back zeros for all but one block when split graphs wrote it back, and, written as a Python
flag inside a checkpointed block, sent the whole model back to eager for the rest of the run."""
import pytest
import torch

from fp8train.config.load import Config
from fp8train.model import GPT, model_config_from
from fp8train.precision import build_precision

pytest.importorskip("torchao")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    yield
    torch._dynamo.reset()


def converted(backend: str, **model_kw):
    torch.manual_seed(0)
    prec = build_precision(Config(use_fp8=True, fp8_backend=backend, fp8_layers="all"),
                           torch.device("cpu"), warn=pytest.fail)
    model = prec.convert(GPT(model_config_from("tiny", 256, 64, n_embd=256, **model_kw)))
    return prec, model.train()


def step(prec, model, x, watched: bool) -> dict:
    prec.watch(watched)
    with prec.forward_context(training=True):
        loss, _, _ = model(x, x)
    loss.backward()
    prec.after_backward()
    stats = {k: v.item() for k, v in prec.stats().items()}
    prec.watch(False)
    return stats


@pytest.mark.parametrize("backend", ["native", "torchao"])
def test_split_ddp_graphs_train_and_read_every_layers_scales(gloo_world_of_one, backend):
    prec, model = converted(backend)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    compiled = torch.compile(ddp)
    x = torch.randint(0, 256, (2, 64))
    for watched in (False, True, False, True):
        stats = step(prec, compiled, x, watched)
    names = prec.selection.chosen
    assert len(names) == 16
    for name in names:   # every layer's row, forward and backward: none lost to another graph
        assert stats[f"fp8/{name}/fwd_scale_input"] > 0, name
        assert stats[f"fp8/{name}/bwd_scale_grad_output"] > 0, name
    assert 1 < stats["fp8/fwd_scale"] < 1e6 and 1 < stats["fp8/bwd_scale"] < 1e12
    if backend == "native":   # every layer's amaxes reached the shared history
        assert (prec.state.amax_history > 0).any(dim=0).all()


def test_a_watched_step_under_activation_checkpointing_stays_compiled():
    """torchao under compile with activation checkpointing: after a watched step, the steps
    run compiled (no Float8Linear forward in eager), and the read-out has every layer."""
    from torchao.float8.float8_linear import Float8Linear
    prec, model = converted("torchao")
    model.activation_checkpointing = True
    eager = []
    forward = Float8Linear.forward

    def counted(self, x):
        if not torch.compiler.is_compiling():
            eager.append(1)
        return forward(self, x)
    compiled = torch.compile(model)
    x = torch.randint(0, 256, (2, 64))
    try:
        Float8Linear.forward = counted
        step(prec, compiled, x, False)
        stats = step(prec, compiled, x, True)
        eager.clear()
        step(prec, compiled, x, False)
    finally:
        Float8Linear.forward = forward
        torch._dynamo.reset()
    assert eager == []
    assert all(stats[f"fp8/{n}/bwd_scale_grad_output"] > 0 for n in prec.selection.chosen)
