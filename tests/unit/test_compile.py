"""compile.py without compiling anything heavy: which scope a config compiles, the model found
inside its wrappers, what the log says, and the eager stance that sampling runs under. The
compiles themselves, with the real compiler: tests/e2e/test_compile.py."""
import pytest
import torch

from fp8train.compile import compile_model, eager, inner_model, scope_of
from fp8train.config.load import Config
from fp8train.model import GPT, model_config_from


@pytest.mark.parametrize("compile_,scope,mode,expected", [
    (False, "auto", "default", ""),
    (True, "auto", "default", "blocks"),
    (True, "auto", "max-autotune-no-cudagraphs", "blocks"),
    (True, "auto", "reduce-overhead", "model"),    # CUDA graphs of separate blocks: #152887
    (True, "auto", "max-autotune", "model"),
    (True, "blocks", "max-autotune-no-cudagraphs", "blocks"),
    (True, "model", "default", "model"),
])
def test_the_scope_a_config_compiles(compile_, scope, mode, expected):
    assert scope_of(Config(compile=compile_, compile_scope=scope, compile_mode=mode)) == expected


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_blocks_with_cuda_graphs_are_refused_in_one_line(mode):
    """pytorch#152887: the CUDA graphs of separately compiled blocks overwrite each other's
    outputs, a crash on the GPU; the config says so before anything runs."""
    from fp8train.config.validate import validate
    from fp8train.errors import BadInput
    with pytest.raises(BadInput, match=f"key 'compile_scope' is 'blocks' with compile_mode "
                                       f"'{mode}', whose CUDA graphs"):
        validate(Config(compile=True, compile_scope="blocks", compile_mode=mode))
    validate(Config(compile=True, compile_scope="auto", compile_mode=mode))


def tiny() -> GPT:
    return GPT(model_config_from("tiny", 256, 32, n_layer=2, n_embd=32))


def test_compile_off_leaves_the_model_as_it_is():
    model = tiny()
    run, how = compile_model(model, Config())
    assert run is model and how == "compile: off (eager)"
    assert all(b._compiled_call_impl is None for b in model.blocks)


def test_per_block_compiles_in_place_and_says_so():
    model = tiny()
    names = [n for n, _ in model.named_parameters()]
    run, how = compile_model(model, Config(compile=True))
    assert run is model
    assert how == ("compile: per block (2 Block blocks, one graph shared by all; the output "
                   "layer and loss a region of their own), mode default")
    assert all(b._compiled_call_impl is not None for b in model.blocks)
    assert [n for n, _ in model.named_parameters()] == names
    assert "output_loss" in model.__dict__ and "output_loss" not in model.state_dict()


def test_the_whole_model_under_cuda_graph_modes_says_why():
    model = tiny()
    run, how = compile_model(model, Config(compile=True, compile_mode="reduce-overhead"))
    assert run is not model and run._orig_mod is model
    assert how == ("compile: the whole model (compile_scope auto: reduce-overhead's CUDA graphs "
                   "need one graph), mode reduce-overhead")


def test_the_model_is_found_inside_its_wrappers():
    model = tiny()

    class Wrapper(torch.nn.Module):   # DDP's shape: the model as `.module`
        def __init__(self, m):
            super().__init__()
            self.module = m

    assert inner_model(Wrapper(Wrapper(model))) is model
    assert inner_model(model) is model


def test_output_loss_is_the_forward_loss():
    torch.manual_seed(0)
    model = tiny()
    x = torch.randint(0, 256, (2, 32))
    loss, ce, pen = model(x, x, penalty_type="z_loss", penalty_weight=1e-3)
    h = model.drop(model.wte(x) + model.wpe(torch.arange(32)))
    for block in model.blocks:
        h = block(h)
    assert torch.equal(model.output_loss(h, x, "z_loss", 1e-3)[0], loss)
    assert torch.equal(model.logits(h), model(x))


def test_eager_runs_compiled_code_without_compiling():
    counter = torch._dynamo.testing.CompileCounter()
    fn = torch.compile(lambda t: t * 2, backend=counter)
    with eager():
        assert torch.equal(fn(torch.ones(3)), torch.full((3,), 2.0))
    assert counter.frame_count == 0
    fn(torch.ones(3))
    assert counter.frame_count == 1
    torch._dynamo.reset()
