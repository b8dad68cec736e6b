"""The native FP8 backend on CPU: a model with no converted layer, the layouts that
torch._scaled_mm (cuBLASLt) needs from strided inputs and gradients, the cast path under
torch.compile (one graph, however many layers; the same numbers as eager), and the weight cast
once per optimizer step under gradient accumulation.

`graph_counts` and `eager_op_counts` below are also how the numbers in docs/records/benchmarks.md
("CPU: the native FP8 cast path under torch.compile") were measured."""
import collections
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
from accelerate.utils.modeling import id_tensor_storage
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fp8train.config.load import Config
from fp8train.model import GPT, model_config_from
from fp8train.precision import build_precision
from fp8train.precision.native import Fp8Linear, Fp8State
from fp8train.precision.scaling import E4M3

CPU = torch.device("cpu")


def native_gpt(n_layer=2, seq_len=64, **cfg):
    """The tiny GPT (d=128) with n_layer blocks, its Linears converted by the native backend
    (emulated on CPU): 4 FP8 Linears per block."""
    torch.manual_seed(0)
    model = GPT(model_config_from("tiny", 256, seq_len, n_layer=n_layer))
    prec = build_precision(Config(use_fp8=True, fp8_backend="native", fp8_amax_history_len=16,
                                  **cfg), CPU, warn=pytest.fail)
    return prec.convert(model), prec


def fake_accelerator(accum):
    """What Native reads from accelerate's Accelerator: the accumulation steps, the kind of
    distribution, and sync_gradients (True on the last micro-batch of a step)."""
    return SimpleNamespace(gradient_accumulation_steps=accum, distributed_type="NO",
                           sync_gradients=False)


def train_micro_batch(model, prec, x, acc=None, last=True):
    """One micro-batch as the trainer runs it: forward in the backend's context, backward,
    after_backward (with accelerate's sync_gradients for this micro-batch)."""
    if acc is not None:
        acc.sync_gradients = last
    with prec.forward_context(training=True):
        out = model(x)
    loss = torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), x.flatten())
    loss.backward()
    prec.after_backward()
    return loss.detach()


def graph_counts(n_layer, watching=False, accum=1, passes=3):
    """(graphs compiled, graphs run per training forward) for the native GPT of n_layer blocks
    under torch.compile, counted by a dynamo backend that runs each graph as traced. Every
    graph break adds a graph to run per forward."""
    torch._dynamo.reset()
    model, prec = native_gpt(n_layer)
    acc = fake_accelerator(accum) if accum > 1 else None
    if acc is not None:
        prec.after_prepare(acc)
    seen = dict(compiled=0, runs=0)

    def backend(gm, example_inputs):
        seen["compiled"] += 1

        def run(*args):
            seen["runs"] += 1
            return gm.forward(*args)
        return run

    compiled = torch.compile(model, backend=backend)
    x = torch.randint(0, 256, (2, 64))
    prec.watch(watching)
    runs = []
    for i in range(passes):
        before = seen["runs"]
        train_micro_batch(compiled, prec, x, acc, last=(i + 1) % accum == 0)
        runs.append(seen["runs"] - before)
    return seen["compiled"], max(runs)


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def eager_op_counts(watching=False):
    """aten ops dispatched by one eager FP8 Linear (128 -> 128, 256 rows): (forward, backward)."""
    torch.manual_seed(0)
    state = Fp8State(["l"], emulate=True)
    layer = Fp8Linear.from_linear(nn.Linear(128, 128), state, 0, "l")
    x = torch.randn(4, 64, 128, requires_grad=True)
    layer(x).sum().backward()
    state.watching = watching
    with _OpCount() as fwd:
        y = layer(x)
    with _OpCount() as bwd:
        y.backward(torch.randn_like(y))
    return sum(fwd.ops.values()), sum(bwd.ops.values())


# --- no layer converted ----------------------------------------------------------------------

def test_an_empty_state_is_valid_and_its_update_does_nothing():
    state = Fp8State([], history_len=8)
    assert state.amax_history.shape == (8, 0, 3)
    assert state.scale.shape == (0, 3) and state.fp8_max.shape == (0, 3)
    state.watch(True)
    state.update()
    assert state.stats.collect() == {}
    assert state.state_dict() == {}  # nothing to checkpoint
    state.load_state_dict({})


def test_native_with_no_converted_layer_trains_as_the_base_precision():
    """fp8_exclude matching every Linear (the tiny GPT's head is tied, so blocks.* is all):
    the model trains in fp32 exactly as without FP8, and logs no fp8/ metric."""
    model, prec = native_gpt(fp8_exclude=["blocks.*", "lm_head"])
    ref = GPT(model.mcfg)
    ref.load_state_dict(model.state_dict(), strict=False)
    assert prec.selection.chosen == [] and not any(isinstance(m, Fp8Linear)
                                                   for m in model.modules())
    prec.after_prepare(fake_accelerator(2))
    x = torch.randint(0, 256, (2, 64))
    for _ in range(2):
        prec.watch(True)
        loss = train_micro_batch(model, prec, x)
        assert prec.stats() == {}
    ref_loss = torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), x.flatten())
    assert loss.item() == ref_loss.item()
    # The empty state stays out of the checkpoint: empty tensors all share the null storage,
    # which accelerate's safetensors writer would take for aliasing (and keep one of them).
    sd = model.state_dict()
    assert not [k for k in sd if k.startswith("fp8_state.")]
    storages = [id_tensor_storage(t) for t in sd.values()]
    assert len(set(storages)) == len(storages)
    model.load_state_dict(safetensors.torch.load(safetensors.torch.save(sd)))  # strict
    assert model.fp8_state.scale.shape == (0, 3)


# --- _scaled_mm layouts ----------------------------------------------------------------------

class _ScaledMmLayouts(TorchDispatchMode):
    """Runs every aten._scaled_mm also on meta tensors of the same strides: torch's meta
    function applies the CUDA checks (mat1 row-major, mat2 column-major, as cuBLASLt needs),
    which its CPU kernel does not."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket is torch.ops.aten._scaled_mm:
            self.calls += 1
            meta = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
                    if isinstance(a, torch.Tensor) else a for a in args]
            func(*meta, **{k: v.to("meta") if isinstance(v, torch.Tensor) else v
                           for k, v in kwargs.items()})
        return func(*args, **kwargs)


def test_strided_input_and_gradient_reach_scaled_mm_row_major():
    """A transposed-view input and a transposed gradient (what a compiled backward can hand
    over) through the real autograd Function on torch._scaled_mm: every GEMM gets a row-major
    first and a column-major second operand, and the results equal the emulation."""
    torch.manual_seed(5)
    base = nn.Linear(32, 32)
    x_t = torch.randn(32, 32)            # x = x_t.t(): strides (1, 32)
    g = torch.randn(32, 32)
    outs = []
    for emulate in (False, True):
        state = Fp8State(["layer"], emulate=emulate)
        layer = Fp8Linear.from_linear(nn.Linear(32, 32), state, 0, "layer")
        layer.load_state_dict(base.state_dict())
        for step in range(2):            # the second pass runs with scales fitted to the first
            layer.zero_grad()
            xi = x_t.clone().requires_grad_()
            x = xi.t()
            assert not x.is_contiguous()
            y = layer(x)
            strides = []
            y.register_hook(lambda grad: strides.append(grad.stride()))
            with _ScaledMmLayouts() as check:
                (y.t() * g).sum().backward()  # dL/dy = g.t(): a strided gradient
            assert strides == [(1, 32)]
            state.update()
        assert check.calls == (2 if not emulate else 0)  # grad_input and grad_weight GEMMs
        with _ScaledMmLayouts() as check:
            y_eval = layer(x.detach())
        assert check.calls == (1 if not emulate else 0)
        outs.append((y_eval, xi.grad, layer.weight.grad))
    for real, emu in zip(*outs, strict=True):
        torch.testing.assert_close(real, emu, rtol=1e-5, atol=1e-6)


# --- the cast path under torch.compile -------------------------------------------------------

@pytest.mark.parametrize("watching", [False, True])
def test_compiled_model_is_one_graph_whatever_its_depth(watching):
    """No graph break around the FP8 Linears: the whole training forward of the native GPT is
    one graph, for 2 blocks as for 4 (before: one eager region per FP8 Linear, 18 graphs run
    per forward at 2 blocks, 36 at 4)."""
    for n_layer in (2, 4):
        compiled, runs = graph_counts(n_layer, watching)
        assert (compiled, runs) == (1, 1), (n_layer, compiled, runs)


def test_compiled_model_traces_with_fullgraph_under_weight_caching():
    """fullgraph=True (an error on any graph break) with the weights cast once per step (outside
    the graph) and read from the cache: one graph for every micro-batch, and one more for
    watched steps."""
    torch._dynamo.reset()
    model, prec = native_gpt(1)
    acc = fake_accelerator(2)
    prec.after_prepare(acc)
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.randint(0, 256, (2, 64))
    for watching in (True, False):
        prec.watch(watching)
        for last in (False, True):
            train_micro_batch(compiled, prec, x, acc, last)
    assert counter.frame_count == 2  # watched, not


def test_compiled_and_eager_native_give_the_same_losses_scales_and_gradients():
    """aot_eager (AOTAutograd's forward and backward graphs, with the state written in place
    in both) against eager: a watched step of two micro-batches, the second reusing the
    weights cast by the first."""
    results = []
    for backend in (None, "aot_eager"):
        torch._dynamo.reset()
        model, prec = native_gpt(1)
        acc = fake_accelerator(2)
        prec.after_prepare(acc)
        run = torch.compile(model, backend=backend, fullgraph=True) if backend else model
        prec.watch(True)
        gen = torch.Generator().manual_seed(1)
        losses = [train_micro_batch(run, prec, torch.randint(0, 256, (2, 64), generator=gen),
                                    acc, last) for last in (False, True)]
        stats = prec.stats()
        results.append((torch.stack(losses), stats, prec.state.amax_history.clone(),
                        prec.state.scale.clone(), [p.grad.clone() for p in model.parameters()]))
    (l_e, s_e, h_e, sc_e, g_e), (l_c, s_c, h_c, sc_c, g_c) = results
    torch.testing.assert_close(l_c, l_e, rtol=1e-6, atol=0)
    assert list(s_c) == list(s_e) and len(s_e) == 5 + 4 * 12
    torch.testing.assert_close(torch.stack(list(s_c.values())),
                               torch.stack(list(s_e.values())), rtol=1e-5, atol=0)
    torch.testing.assert_close(h_c, h_e, rtol=1e-6, atol=0)
    assert (h_e > 0).any() and torch.equal(sc_c, sc_e)
    for a, b in zip(g_c, g_e, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_eager_cast_path_dispatches_fewer_ops():
    """One FP8 Linear's forward + backward, eager: at most 63 aten ops (before: 74), 125 on a
    watched step (before: 152). Not a speed measure; it catches per-layer work creeping back."""
    assert sum(eager_op_counts(watching=False)) <= 63
    assert sum(eager_op_counts(watching=True)) <= 125


# --- the weight cast once per optimizer step -------------------------------------------------

class _WeightCasts(TorchDispatchMode):
    """Counts conversions to E4M3 (.to() or copy_ into an FP8 tensor) of tensors shaped like
    one of `shapes` (the weights)."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.n = set(shapes), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        src = {torch.ops.aten._to_copy: 0, torch.ops.aten.copy_: 1}.get(func.overloadpacket)
        if src is not None and out.dtype == E4M3 and args[src].dtype != E4M3 and \
                tuple(out.shape) in self.shapes:
            self.n += 1
        return out


@pytest.mark.parametrize("accum,casts_per_step", [(1, 1), (4, 1)])
def test_weights_are_cast_once_per_optimizer_step(accum, casts_per_step):
    """Under gradient accumulation each weight goes to FP8 on the step's first micro-batch only
    (before: once per micro-batch, 4 per step at accum 4)."""
    model, prec = native_gpt(1, seq_len=48)  # 96 rows: no input shaped like a weight
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    acc = fake_accelerator(accum)
    prec.after_prepare(acc)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randint(0, 256, (2, 48))
    with _WeightCasts(tuple(m.weight.shape) for m in layers) as casts:
        for step in range(2):
            for micro in range(accum):
                train_micro_batch(model, prec, x, acc, last=micro == accum - 1)
            opt.step()
            opt.zero_grad()
    assert casts.n == 2 * casts_per_step * len(layers)


def one_layer(base, cached, **cfg):
    """`base`'s copy converted by a native backend (through an accelerator with accumulation 2
    when `cached`), as fp8_layers auto converts a timing layer."""
    holder = nn.Module()
    holder.layer = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None)
    holder.layer.load_state_dict(base.state_dict())
    cfg.setdefault("fp8_amax_history_len", 4)
    prec = build_precision(Config(use_fp8=True, fp8_backend="native", **cfg),
                           CPU, warn=pytest.fail)
    prec.convert(holder)
    acc = fake_accelerator(2)
    if cached:
        prec.after_prepare(acc)
    return holder.layer, prec, acc


def test_reused_weight_keeps_the_scale_it_was_cast_with():
    """The second micro-batch of a step multiplies by the FP8 weight of the first, with that
    cast's scale (TE's is_first_microbatch), although the scales moved in between; the weight's
    amax still enters every micro-batch's history row. A weight changed within the step (a
    rollback, a load) is cast again, with the scale of the moment."""
    torch.manual_seed(6)
    base = nn.Linear(64, 32)
    x1, x2 = torch.randn(16, 64), torch.randn(16, 64) * 3
    layer, prec, acc = one_layer(base, cached=True)
    state = prec.state
    with prec.forward_context(training=True):   # micro-batch 1 casts with the initial scale 1
        layer(x1).sum().backward()
    prec.after_backward()                        # not the step's last: sync_gradients False
    assert state.scale[0, 1].item() != 1.0       # the weight's scale moved ...
    with prec.forward_context(training=True):
        y2 = layer(x2)                           # ... micro-batch 2 uses the cast with 1
    ref, ref_prec, _ = one_layer(base, cached=False)
    ref_prec.state.scale.copy_(state.scale)
    ref_prec.state.scale[0, 1] = 1.0
    torch.testing.assert_close(y2, ref(x2), rtol=0, atol=0)
    state.fold()   # the layer's records of this micro-batch into the history
    assert state.amax_history[0, 0, 1].item() == base.weight.abs().max().item()
    # A weight changed in place within the step: cast again, with the current scale.
    with torch.no_grad():
        layer.weight.mul_(2)
        ref.weight.mul_(2)
    ref_prec.state.scale.copy_(state.scale)
    with prec.forward_context(training=True):
        y3 = layer(x2)
    torch.testing.assert_close(y3, ref(x2), rtol=0, atol=0)


@pytest.mark.parametrize("cached", [False, True])
def test_current_scaling_scales_each_tensor_from_its_own_amax(cached):
    """fp8_recipe current (TE's Float8CurrentScaling): input, weight and grad_output are each
    cast with fp8_max / their own amax at that very cast (E4M3 448, E5M2 57344), whatever the
    previous step saw; the output is the FP8 product with those scales; no history is kept, so
    nothing is reduced or updated (a step 100x larger is scaled 100x smaller at once, where
    delayed scaling would saturate it). The watched statistics report the scales used."""
    from fp8train.precision.scaling import E5M2, FP8_MAX, quantize
    torch.manual_seed(7)
    base = nn.Linear(64, 32, bias=False)
    layer, prec, acc = one_layer(base, cached=cached, fp8_recipe="current")
    state = prec.state
    assert state.current and state.amax_history.shape == (1, 1, 3)
    for x in (torch.randn(16, 64), torch.randn(16, 64) * 100):
        x.requires_grad_(True)
        prec.new_step = True
        prec.watch(True)
        with prec.forward_context(training=True):
            y = layer(x)
        g = torch.randn_like(y) * 1e-3
        y.backward(g)
        prec.after_backward()
        s_in, s_w, s_g = (FP8_MAX[E4M3] / x.detach().abs().max(),
                          FP8_MAX[E4M3] / base.weight.detach().abs().max(),
                          FP8_MAX[E5M2] / g.abs().max())
        stats = prec.stats()
        name = next(iter(state.names))
        assert stats[f"fp8/{name}/fwd_scale_input"].item() == pytest.approx(s_in.item())
        assert stats[f"fp8/{name}/fwd_scale_weight"].item() == pytest.approx(s_w.item())
        assert stats[f"fp8/{name}/bwd_scale_grad_output"].item() == pytest.approx(s_g.item())
        assert stats[f"fp8/{name}/saturated_input"].item() == 0.0
        xq = quantize(x.detach(), s_in, E4M3).float() / s_in
        wq = quantize(base.weight.detach(), s_w, E4M3).float() / s_w
        torch.testing.assert_close(y, xq @ wq.t())
        assert not state.amax_history.any() and (state.scale == 1).all()
    assert prec.recover("margin").startswith("FP8 switched off")   # no margin to raise
