"""One training step traced on a fake CUDA device, on a CPU: what the CUDA path of each FP8
backend hands to torch._scaled_mm and to the fused AdamW kernel, checked as CUDA checks it.

A stand-in for the GPU tests (tests/gpu) where no GPU is: the tensors live on "cuda" under
PyTorch's FakeTensorMode and every op runs through its meta function (see cuda_trace.py), so
the step runs with the real CUDA code path (native FP8 with emulate=False, torchao with
emulate=False, bf16 autocast on "cuda", the fused AdamW step with found_inf) and the tests
check devices, dtypes, shapes and strides, the layout, dtype and scale rules of _scaled_mm
(its meta checks plus the kernel's own, cuda_trace.KernelRecorder), and the fused AdamW
kernel's. What cannot exist here is mocked (cuda_trace.fake_cuda and host_autograd): a no-op
CUDA device guard, torch.cuda's capability and bf16 queries (an sm90 GPU), and stream-free
autograd in backward.

Limits: no value is computed (no numerics, no speed, no memory); an op's meta function may
differ from its kernel; attention runs the math path of scaled_dot_product_attention (a CPU
build dispatches no flash or cuDNN attention); activation checkpointing's recompute and
torch.compile cannot be traced this way (cuda_trace's docstring says why)."""
import re
from types import SimpleNamespace

import pytest
import torch
from support.cuda_trace import KernelRecorder, KernelRuleError, backward, fake_cuda, is_row_major
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fp8train.config.load import Config, section
from fp8train.model import GPT, model_config_from
from fp8train.precision.ao import TorchAO
from fp8train.precision.native import Fp8Linear, Fp8State, Native
from fp8train.precision.plain import BF16
from fp8train.precision.spec import Fp8Spec
from fp8train.train.health import Health
from fp8train.loss import lm_loss
from fp8train.optim.optimizer import build_optimizer

# torchao asks for the autocast dtype the deprecated way.
pytestmark = pytest.mark.filterwarnings("ignore:torch.get_autocast_gpu_dtype:DeprecationWarning")

CUDA = torch.device("cuda", 0)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BATCH, SEQ, VOCAB = 2, 32, 200      # 64 rows per GEMM: _scaled_mm wants multiples of 16
PRESET = {"gpt2": "tiny", "llama": "tiny-llama"}


def gpt(arch: str) -> nn.Module:
    """The tiny model, built on the GPU. (The trainer builds it on the host and moves it; under
    FakeTensorMode, Module.to swaps parameters, which fails for fake ones that an in-place init
    touched: "Cannot swap t1 because it has weakref associated with it".)"""
    cfg = model_config_from(PRESET[arch], vocab_size=VOCAB, block_size=SEQ, n_layer=2)
    with torch.device(CUDA):
        return GPT(cfg)


def train_step(model, prec, micro_batches=1, accelerator=None):
    """The trainer's step: micro-batches forward (bf16 autocast, as Accelerate applies it) and
    backward, the precision's hooks, clipping, the health check, and the fused AdamW step that
    skips on the device (optimizer.found_inf)."""
    opt = build_optimizer(model, section(Config(), "optimizer"))
    prec.after_prepare(accelerator or SimpleNamespace(gradient_accumulation_steps=micro_batches,
                                                      distributed_type="NO",
                                                      sync_gradients=True))
    health = Health(CUDA, spike_factor=0.0)
    prec.watch(True)
    rec = KernelRecorder()
    with rec:
        for i in range(micro_batches):
            if accelerator is not None:
                accelerator.sync_gradients = i == micro_batches - 1
            x = torch.randint(0, VOCAB, (BATCH, SEQ), device=CUDA)
            y = torch.randint(0, VOCAB, (BATCH, SEQ), device=CUDA)
            with prec.forward_context(training=True), \
                    torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss, ce, penalty = lm_loss(logits, y)
            backward(loss / micro_batches)
            prec.after_backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        skip = health.step(grad_norm, ce, penalty)
        opt.found_inf = skip
        opt.step()
    return SimpleNamespace(logits=logits, loss=loss, grad_norm=grad_norm, skip=skip, opt=opt,
                           rec=rec, stats=prec.stats())


def assert_step_on_cuda(model, step):
    """What holds for every backend: outputs, gradients and optimizer state on the GPU with the
    parameters' shapes, dtypes and strides, and the optimizer step fed the health verdict."""
    padded = model.mcfg.padded_vocab_size
    assert step.logits.shape == (BATCH, SEQ, padded)
    assert step.logits.dtype == torch.bfloat16 and step.logits.device == CUDA
    assert step.logits.is_contiguous()
    for t in (step.loss, step.grad_norm, step.skip):
        assert t.shape == () and t.dtype == torch.float32 and t.device == CUDA
    params = [p for p in model.parameters() if p.requires_grad]
    for name, p in model.named_parameters():
        assert p.device == CUDA, name
        assert p.grad is not None, name
        g = p.grad
        assert (g.shape, g.dtype, g.device, g.stride()) == \
            (p.shape, p.dtype, p.device, p.stride()), name
        state = step.opt.state[p]
        for k in ("exp_avg", "exp_avg_sq"):
            assert (state[k].shape, state[k].dtype, state[k].device) == (p.shape, p.dtype, CUDA)
        assert state["step"].shape == () and state["step"].dtype == torch.float32
        assert state["step"].device == CUDA
    # One fused kernel per parameter group (decay, no decay), each with the health verdict.
    assert len(step.rec.adamw) == 2
    assert sum(len(call.params) for call in step.rec.adamw) == len(params)
    for call in step.rec.adamw:
        assert call.found_inf is step.skip
        assert call.grad_scale is None
    for name, v in step.stats.items():
        assert v.shape == () and v.dtype == torch.float32 and v.device == CUDA, name


# --- the checks themselves -------------------------------------------------------------------

def test_scaled_mm_layout_rules_are_checked_on_the_fake_cuda_device_only():
    with fake_cuda():
        s = torch.ones((), device=CUDA)
        a = torch.empty(64, 32, device=CUDA, dtype=E4M3)       # row-major [M, K]
        w = torch.empty(48, 32, device=CUDA, dtype=E4M3)       # a weight [N, K], row-major
        out = torch._scaled_mm(a, w.t(), s, s, out_dtype=torch.bfloat16)
        assert (out.shape, out.dtype, out.device) == ((64, 48), torch.bfloat16, CUDA)
        assert is_row_major(out)

        bad = {
            "mat2 must be col_major": lambda: torch._scaled_mm(
                a, w.t().contiguous(), s, s, out_dtype=torch.bfloat16),
            "self must be row_major": lambda: torch._scaled_mm(
                a.t().contiguous().t(), w.t(), s, s, out_dtype=torch.bfloat16),
            "divisible by 16": lambda: torch._scaled_mm(
                a[:, :24], w[:, :24].t(), s, s, out_dtype=torch.bfloat16),
            "must be float (fp32)": lambda: torch._scaled_mm(
                a, w.t(), s.bfloat16(), s.bfloat16(), out_dtype=torch.bfloat16),
            "Invalid scaling configuration": lambda: torch._scaled_mm(
                a, w.t(), torch.ones(64, 1, device=CUDA), torch.ones(1, 32, device=CUDA),
                out_dtype=torch.bfloat16),
        }
        for msg, call in bad.items():
            with pytest.raises(RuntimeError, match=re.escape(msg)):
                call()

        # The same row-major mat2 on a (fake) CPU passes: only the CUDA device checks layouts.
        cpu = torch.device("cpu")
        out = torch._scaled_mm(a.to(cpu), w.to(cpu).t().contiguous(), s.to(cpu), s.to(cpu),
                               out_dtype=torch.bfloat16)
        assert out.device == cpu


def test_kernel_recorder_rejects_what_the_cuda_kernels_reject_and_meta_accepts():
    with fake_cuda():
        s = torch.ones((), device=CUDA)
        a = torch.empty(64, 32, device=CUDA, dtype=E5M2)
        w = torch.empty(48, 32, device=CUDA, dtype=E5M2)
        calls = {
            "two Float8_e5m2": lambda: torch._scaled_mm(a, w.t(), s, s,
                                                        out_dtype=torch.bfloat16),
            "same GPU": lambda: torch._scaled_mm(a.to(E4M3), w.t(), torch.ones(()), s,
                                                 out_dtype=torch.bfloat16),
            "row-wise": lambda: torch._scaled_mm(
                a.to(E4M3), w.to(E4M3).t(), torch.ones(64, 1, device=CUDA),
                torch.ones(1, 48, device=CUDA), out_dtype=torch.float32),
        }
        for msg, call in calls.items():
            call()                     # the meta function lets it through ...
            with KernelRecorder(), pytest.raises(KernelRuleError, match=re.escape(msg)):
                call()                 # ... the kernel would not

        p = torch.zeros(16, 32, device=CUDA, requires_grad=True)
        opt = torch.optim.AdamW([p], fused=True)
        p.grad = torch.zeros(32, 16, device=CUDA).t()        # the param's shape, not its strides
        opt.found_inf = torch.zeros((), device=CUDA)
        with KernelRecorder(), pytest.raises(KernelRuleError, match="strides"):
            opt.step()
        p.grad = torch.zeros_like(p)
        opt.found_inf = torch.zeros((), device=CUDA, dtype=torch.bfloat16)
        with KernelRecorder(), pytest.raises(KernelRuleError, match="found_inf must be one"):
            opt.step()
        with KernelRecorder() as rec:
            opt.found_inf = torch.zeros((), device=CUDA)
            opt.step()
        assert len(rec.adamw) == 1 and rec.adamw[0].found_inf is opt.found_inf


def test_fake_cuda_is_undone_on_exit():
    """fake_cuda's mocks hold inside it only: torch.cuda answers as before afterwards, and (on
    a CPU build) fake CUDA tensors have no device guard again, without which .contiguous() and
    autograd cannot run."""
    before = torch.cuda.is_bf16_supported
    with fake_cuda():
        assert torch.cuda.get_device_capability(CUDA) == (9, 0)
        t = torch.empty(16, 32, device=CUDA, dtype=E4M3).t().contiguous()
        assert t.device == CUDA and t.is_contiguous() and t.shape == (32, 16)
    assert torch.cuda.is_bf16_supported is before
    if not torch.backends.cuda.is_built():
        with FakeTensorMode(), pytest.raises(RuntimeError, match="not linked with support"):
            torch.empty(16, 32, device=CUDA).t().contiguous()


# --- the native backend -----------------------------------------------------------------------

LAYOUTS = ["row-major input", "transposed 2-D input", "transposed use of the output"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_native_fp8_linear_hands_scaled_mm_cuda_layouts(layout):
    """Forward and backward of one Fp8Linear on the CUDA path: three GEMMs, row-major mat1 and
    column-major mat2 whatever the layout of the input or of grad_output."""
    M, K, N = 64, 32, 48
    with fake_cuda():
        state = Fp8State(["lin"], "hybrid", history_len=4, emulate=False).to(CUDA)
        lin = Fp8Linear.from_linear(nn.Linear(K, N, device=CUDA), state, 0, "lin")
        lin.train()
        autocast = layout == "row-major input"
        if layout == "transposed 2-D input":
            x = torch.randn(K, M, device=CUDA).t().requires_grad_()
        else:
            x = torch.randn(BATCH, M // BATCH, K, device=CUDA, requires_grad=True)
        with KernelRecorder() as rec:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                y = lin(x)
            out_dtype = torch.bfloat16 if autocast else torch.float32
            assert (y.shape, y.dtype, y.device) == ((*x.shape[:-1], N), out_dtype, CUDA)
            if layout == "transposed use of the output":
                # grad_output arrives column-major: [M, N] with strides (1, M)
                loss = (y.reshape(M, N).t() * torch.randn(N, M, device=CUDA)).sum()
            else:
                loss = y.float().sum()
            backward(loss)
        fwd, grad_x, grad_w = rec.scaled_mm
        assert (fwd.a.shape, fwd.b.shape, fwd.out.shape) == ((M, K), (K, N), (M, N))
        assert (grad_x.a.shape, grad_x.b.shape, grad_x.out.shape) == ((M, N), (N, K), (M, K))
        assert (grad_w.a.shape, grad_w.b.shape, grad_w.out.shape) == ((N, M), (M, K), (N, K))
        assert (fwd.a.dtype, fwd.b.dtype) == (E4M3, E4M3)
        assert (grad_x.a.dtype, grad_x.b.dtype) == (E5M2, E4M3)
        assert (grad_w.a.dtype, grad_w.b.dtype) == (E5M2, E4M3)
        assert (fwd.fast_accum, grad_x.fast_accum, grad_w.fast_accum) == (True, False, False)
        assert (fwd.out.dtype, grad_x.out.dtype, grad_w.out.dtype) == \
            (out_dtype, x.dtype, torch.float32)
        for call in rec.scaled_mm:
            assert call.a.row_major and call.b.col_major, call
            for op in (call.a, call.b, call.scale_a, call.scale_b, call.out):
                assert op.device == CUDA
            assert call.scale_a.shape == call.scale_b.shape == ()
            assert call.scale_a.dtype == call.scale_b.dtype == torch.float32
        assert (x.grad.shape, x.grad.dtype, x.grad.device) == (x.shape, x.dtype, CUDA)
        for p in (lin.weight, lin.bias):
            assert (p.grad.shape, p.grad.dtype, p.grad.device) == (p.shape, p.dtype, CUDA)
        state.update()
        assert state.scale.device == state.amax_history.device == CUDA


@pytest.mark.parametrize("arch,micro_batches", [("gpt2", 2), ("llama", 2), ("gpt2", 1)])
def test_native_fp8_train_step_traces_on_cuda(arch, micro_batches):
    """The native backend as the trainer runs it on a GPU (emulate off), watched scale statistics,
    the delayed-scaling update and the fused AdamW step; with two micro-batches, under gradient
    accumulation (where the backend keeps the FP8 weights cast by the first for the second)."""
    cfg = Config(use_fp8=True, fp8_backend="native", fp8_layers="all", fp8_amax_history_len=16)
    with fake_cuda():
        backend = Native(Fp8Spec.of(cfg), BF16())
        assert backend.unavailable(CUDA) is None and not backend.emulate
        model = backend.convert(gpt(arch))
        layers = backend.selection.chosen
        assert len(layers) == 8 and model.fp8_state.scale.device == CUDA
        accelerator = SimpleNamespace(gradient_accumulation_steps=micro_batches,
                                      distributed_type="NO", sync_gradients=False)
        step = train_step(model, backend, micro_batches, accelerator)
        assert_step_on_cuda(model, step)
        calls = step.rec.scaled_mm
        assert len(calls) == 3 * len(layers) * micro_batches
        assert sum(c.fast_accum for c in calls) == len(layers) * micro_batches  # the forwards
        for c in calls:
            assert c.a.row_major and c.b.col_major, c
            assert c.a.dtype == (E4M3 if c.fast_accum else E5M2) and c.b.dtype == E4M3
            assert c.out.shape == (c.a.shape[0], c.b.shape[1])
            assert c.out.dtype in (torch.bfloat16, torch.float32)
            assert c.scale_a.shape == c.scale_b.shape == ()
        state = model.fp8_state
        for t in (state.amax_history, state.scale):
            assert t.device == CUDA and t.dtype == torch.float32
        assert state.scale.shape == (len(layers), 3)
        assert {"fp8/fwd_scale", "fp8/bwd_scale", "fp8/amax"} <= set(step.stats)


# --- torchao --------------------------------------------------------------------------------

# _scaled_mm calls per converted layer: rowwise_with_gw_hp computes grad_weight in bf16.
GEMMS = {"tensorwise": 3, "rowwise": 3, "rowwise_with_gw_hp": 2}


@pytest.mark.parametrize("recipe,arch", [("tensorwise", "gpt2"), ("rowwise", "llama"),
                                         ("rowwise_with_gw_hp", "gpt2")])
def test_torchao_fp8_train_step_traces_on_cuda(recipe, arch):
    cfg = Config(use_fp8=True, fp8_backend="torchao", fp8_recipe=recipe, fp8_layers="all")
    with fake_cuda():
        backend = TorchAO(Fp8Spec.of(cfg), BF16())
        assert backend.unavailable(CUDA) is None and not backend.emulate
        model = backend.convert(gpt(arch))
        layers = backend.selection.chosen
        assert len(layers) == 8
        step = train_step(model, backend)
        assert_step_on_cuda(model, step)
        calls = step.rec.scaled_mm
        assert len(calls) == GEMMS[recipe] * len(layers)
        forwards = [c for c in calls if c.fast_accum]
        assert len(forwards) == len(layers)
        for c in calls:
            assert c.a.row_major and c.b.col_major, c
            assert c.out.shape == (c.a.shape[0], c.b.shape[1]) and c.out.device == CUDA
        for c in forwards:
            assert c.out.dtype == torch.bfloat16
            if recipe.startswith("rowwise"):
                assert c.rowwise
                assert c.scale_a.shape == (c.a.shape[0], 1)
                assert c.scale_b.shape == (1, c.b.shape[1])
            else:
                assert c.scale_a.shape == c.scale_b.shape == ()
        assert {"fp8/fwd_scale", "fp8/bwd_scale"} <= set(step.stats)


# --- no FP8 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_bf16_train_step_traces_on_cuda(arch):
    with fake_cuda():
        model = gpt(arch)
        prec = BF16()
        assert prec.unavailable(CUDA) is None
        step = train_step(model, prec)
        assert_step_on_cuda(model, step)
        assert step.rec.scaled_mm == []
