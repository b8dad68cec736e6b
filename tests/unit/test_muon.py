"""Muon's update (fp8train/optim/muon.py): the batched Newton-Schulz iteration gives each
matrix's own result, matrices are bucketed by shape with each rank's share, fused projections
are orthogonalised as their parts, and one step launches far fewer kernels than a matrix at a
time. Two ranks against one process, and the compiled update: tests/e2e/test_optimizer.py."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8train.config.load import Config, section
from fp8train.model import GPT, model_config_from
from fp8train.optim.muon import MuonUpdate, buckets_of, orthogonalise
from fp8train.optim.optimizer import build_optimizer, muon_flops_per_step, muon_parts


def test_newton_schulz_leaves_singular_values_near_one():
    torch.manual_seed(0)
    for shape in [(64, 32), (32, 64), (384, 128)]:
        g = torch.randn(shape) * 1e3
        s = torch.linalg.svdvals(orthogonalise(g).float())
        assert orthogonalise(g).shape == g.shape
        assert 0.5 < s.min() and s.max() < 1.3      # ~ U V^T, as Muon's iteration is tuned to


@pytest.mark.parametrize("shape", [(48, 32), (32, 48)])
def test_a_batch_is_orthogonalised_as_each_matrix_alone(shape):
    """Bit for bit: a matrix's update does not depend on which others share its batch (or on
    which rank computes it)."""
    torch.manual_seed(0)
    batch = torch.randn(5, *shape)
    together = orthogonalise(batch)
    for i in range(5):
        assert torch.equal(together[i], orthogonalise(batch[i]))
        assert torch.equal(together[i], orthogonalise(batch[i:i + 1])[0])


def test_buckets_split_fused_matrices_and_share_them_between_ranks():
    qkv = torch.nn.Parameter(torch.zeros(96, 32))     # q 64 rows, k 16, v 16
    proj = torch.nn.Parameter(torch.zeros(32, 32))
    fc = torch.nn.Parameter(torch.zeros(64, 32))       # gate 32, up 32
    parts = {qkv: [64, 16, 16], fc: [32, 32]}
    shapes = {b.shape: [(id(p), a, z) for p, a, z in b.items]
              for b in buckets_of([qkv, proj, fc], parts, 0, 1)}
    assert shapes == {(64, 32): [(id(qkv), 0, 64)],
                      (16, 32): [(id(qkv), 64, 80), (id(qkv), 80, 96)],
                      (32, 32): [(id(proj), 0, 32), (id(fc), 0, 32), (id(fc), 32, 64)]}
    # Three ranks over the three 32 x 32 matrices: one each; over the two 16 x 32: the third
    # rank has none (its all-gather slice is padding).
    owns = [{b.shape: b.own for b in buckets_of([qkv, proj, fc], parts, r, 3)} for r in range(3)]
    assert [o[(32, 32)] for o in owns] == [(0,), (1,), (2,)]
    assert [o[(16, 32)] for o in owns] == [(0,), (1,), ()]
    assert [o[(64, 32)] for o in owns] == [(0,), (), ()]
    whole = {b.shape: len(b.items) for b in buckets_of([qkv, proj, fc], {}, 0, 2)}
    assert whole == {(96, 32): 1, (32, 32): 1, (64, 32): 1}


def test_a_fused_matrix_is_updated_as_its_parts_would_be_alone():
    """With parts, the q/k/v rows of one fused weight get exactly the update three separate
    matrices with the same gradients get (each orthogonalised and scaled on its own)."""
    torch.manual_seed(0)
    fused = torch.nn.Parameter(torch.randn(96, 32))
    alone = [torch.nn.Parameter(t.detach().clone()) for t in fused.split([64, 16, 16])]
    group = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
    split = MuonUpdate({fused: [64, 16, 16]})
    separate = MuonUpdate({})
    state_a: dict = {fused: {}}
    state_b: dict = {p: {} for p in alone}
    for _ in range(3):
        fused.grad = torch.randn(96, 32)
        for p, g in zip(alone, fused.grad.split([64, 16, 16]), strict=True):
            p.grad = g.clone()
        split.step(dict(group, params=[fused]), state_a, None, None)
        separate.step(dict(group, params=alone), state_b, None, None)
    assert torch.equal(fused, torch.cat(alone))


def test_the_parts_come_from_the_model_and_count_their_flops():
    model = GPT(model_config_from("tiny-llama", 256, 64, n_layer=2))   # 4 heads, 2 KV, d 128
    cfg = Config(optimizer="muon")
    parts = {n: r for n, p in model.named_parameters()
             for q, r in muon_parts(model, cfg).items() if p is q}
    assert parts == {f"blocks.{i}.{name}": rows for i in range(2) for name, rows in
                     (("attn.qkv.weight", [128, 64, 64]), ("mlp.fc.weight", [384, 384]))}
    assert muon_parts(model, Config(optimizer="muon", muon_split_fused=False)) == {}
    ns = lambda m, n: 5 * (4 * m * m * n + 2 * m ** 3)
    whole = 2 * (ns(128, 256) + ns(128, 128) + ns(128, 768) + ns(128, 384))
    split = 2 * (ns(128, 128) + 2 * ns(64, 128) + ns(128, 128) + 2 * ns(128, 384)
                 + ns(128, 384))
    assert muon_flops_per_step(model) == whole
    assert muon_flops_per_step(model, cfg) == split


class CountOps(TorchDispatchMode):
    """The aten operator calls that compute (views and aliases left out): what a GPU launches
    as a kernel each, eagerly."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not func.is_view and func.__name__ not in (
            "detach.default", "lift_fresh.default", "_unsafe_view.default")
        return func(*args, **(kwargs or {}))


def muon_step_ops(model, opt) -> int:
    """Operator calls of one Muon step alone (AdamW's groups left out), after a first step."""
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    muon = [g for g in opt.param_groups if g["muon"]]
    opt.param_groups, groups = muon, opt.param_groups
    try:
        with CountOps() as count:
            opt.muon.step(muon[0], opt.state, torch.zeros(()), None)
    finally:
        opt.param_groups = groups
    return count.n


def test_one_step_launches_a_few_kernels_per_matrix_and_newton_schulz_once_per_shape():
    """A 16-block Llama (64 matrices in 4 shapes, as llama-1b): torch.optim.Muon, a matrix at a
    time, calls over 20 computing operators per matrix (each a kernel on a GPU); here, eager,
    a matrix costs 5 elementwise calls and the Newton-Schulz iteration runs once per shape.
    (Compiled, the elementwise calls fuse further: tests/e2e/test_optimizer.py.)"""
    torch.manual_seed(0)
    model = GPT(model_config_from("tiny-llama", 256, 64, n_layer=16, n_embd=64))
    hidden = [p for n, p in model.named_parameters() if n.startswith("blocks") and p.dim() == 2]
    assert len(hidden) == 64
    ref = torch.optim.Muon(hidden, lr=0.02)
    for p in hidden:
        p.grad = torch.randn_like(p)
    ref.step()
    with CountOps() as per_matrix:
        ref.step()
    opt = build_optimizer(model, section(Config(optimizer="muon", muon_split_fused=False),
                                         "optimizer"))
    ours = muon_step_ops(model, opt)
    assert per_matrix.n >= 20 * 64, per_matrix.n
    assert ours <= 5 * 64 + 25 * 4, ours
    assert ours <= 0.3 * per_matrix.n, (ours, per_matrix.n)


def test_the_iteration_runs_in_bf16_on_a_gpu_and_fp32_on_a_cpu():
    """CPUs without bf16 matrix instructions emulate them (870 ms of a 1.15 s demo step on a
    2-core EPYC): on a CPU Muon orthogonalises in fp32, on a GPU in bf16, as Muon is tuned."""
    from fp8train.optim.muon import ns_dtype_for
    assert ns_dtype_for(torch.device("cpu")) == torch.float32
    assert ns_dtype_for(torch.device("cuda")) == torch.bfloat16
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(48, 32))
    w.grad = torch.randn(48, 32)
    start = w.detach().clone()
    MuonUpdate({}).step(dict(params=[w], lr=0.02, weight_decay=0.0, momentum=0.95), {w: {}},
                        None, None)
    blend = w.grad.lerp(0.05 * w.grad, 0.95)     # Nesterov on a fresh buffer
    expected = start - 0.02 * 1.5 ** 0.5 * orthogonalise(blend, dtype=torch.float32)
    torch.testing.assert_close(w.detach(), expected, rtol=0, atol=1e-6)
