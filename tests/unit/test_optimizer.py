"""The optimizer: AdamW's groups, and Muon for the hidden matrices (compared with
torch.optim.Muon, which computes the same update), skipping a non-finite step on the device,
its state through a checkpoint, and its FLOPs. Muon's update itself (batched, shared between
ranks, compiled): tests/unit/test_muon.py."""
import copy

import pytest
import torch

from fp8train.config.load import Config, section
from fp8train.errors import BadInput
from fp8train.model import GPT, model_config_from
from fp8train.optim.muon import NS_STEPS
from fp8train.optim.optimizer import (MuonAdamW, build_optimizer, check_distributed,
                                      muon_flops_per_step)


def tiny(seed=0):
    torch.manual_seed(seed)
    return GPT(model_config_from("tiny", 256, 64, n_layer=2))


def names_of(model, params):
    ids = {id(p) for p in params}
    return sorted(n for n, p in model.named_parameters() if id(p) in ids)


def test_adamw_decays_matrices_and_embeddings_only():
    model = tiny()
    opt = build_optimizer(model, section(Config(weight_decay=0.1), "optimizer"))
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"]
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = tiny()
    cfg = Config(optimizer="muon", learning_rate=1e-3, muon_lr=0.02, weight_decay=0.1,
                 muon_weight_decay=0.01, muon_momentum=0.9)
    opt = build_optimizer(model, section(cfg, "optimizer"))
    decay, no_decay, hidden = opt.param_groups
    assert [g["muon"] for g in opt.param_groups] == [False, False, True]
    assert names_of(model, decay["params"]) == ["wpe.weight", "wte.weight"]   # head tied to wte
    assert names_of(model, hidden["params"]) == sorted(
        f"blocks.{i}.{m}.weight" for i in range(2)
        for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"))
    assert all(p.dim() == 1 for p in no_decay["params"])
    assert (hidden["weight_decay"], hidden["momentum"]) == (0.01, 0.9)
    assert hidden["lr_scale"] == pytest.approx(20.0) and decay["lr_scale"] == 1.0
    n = sum(len(g["params"]) for g in opt.param_groups)
    assert n == len(list(model.parameters()))


@pytest.mark.parametrize("shape", [(48, 32), (32, 48)])
def test_the_muon_update_is_torch_optim_muons(shape):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(shape))
    ref_w = torch.nn.Parameter(w.detach().clone())
    ours = MuonAdamW([{"params": [w], "muon": True, "weight_decay": 0.1, "momentum": 0.95}],
                     lr=0.02, fused=True, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon([ref_w], lr=0.02, weight_decay=0.1, momentum=0.95)
    for _ in range(4):
        w.grad = torch.randn(shape)
        ref_w.grad = w.grad.clone()
        ours.step()
        ref.step()
        # The same Newton-Schulz bits; the LR and decay factors are device tensors here (not
        # constants of a compiled graph; a skipped step multiplies them by 0), rounded in fp32
        # where torch.optim.Muon rounds Python floats: a last-bit difference at most.
        torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.state[w]["momentum_buffer"],
                                   ref.state[ref_w]["momentum_buffer"], rtol=0, atol=1e-7)


def test_a_non_finite_step_is_skipped_on_the_device_by_both_parts():
    """found_inf = 1: Muon's matrix, its momentum and AdamW's parameter and moments untouched;
    then a good step continues exactly as if the bad one never came (as torch.optim.Muon)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(48, 32))
    b = torch.nn.Parameter(torch.randn(32))
    ref_w = torch.nn.Parameter(w.detach().clone())
    ref_b = torch.nn.Parameter(b.detach().clone())
    ours = MuonAdamW([{"params": [b], "weight_decay": 0.0},
                      {"params": [w], "muon": True, "weight_decay": 0.1, "momentum": 0.95}],
                     lr=0.02, fused=True, ns_dtype=torch.bfloat16)
    muon = torch.optim.Muon([ref_w], lr=0.02, weight_decay=0.1, momentum=0.95)
    adamw = torch.optim.AdamW([ref_b], lr=0.02, weight_decay=0.0, fused=True)
    grads = [(torch.randn(48, 32), torch.randn(32)) for _ in range(3)]
    for i, (gw, gb) in enumerate(grads):
        ours.found_inf = torch.zeros(())
        if i == 1:   # a bad step first: NaN gradients, skipped
            ours.found_inf = torch.ones(())
            w.grad, b.grad = torch.full_like(w, float("nan")), torch.full_like(b, float("inf"))
            ours.step()
            ours.found_inf = torch.zeros(())
        w.grad, b.grad = gw.clone(), gb.clone()
        ref_w.grad, ref_b.grad = gw.clone(), gb.clone()
        ours.step()
        muon.step()
        adamw.step()
        assert torch.allclose(w, ref_w, atol=1e-6, rtol=0) and torch.equal(b, ref_b)
    assert torch.isfinite(ours.state[w]["momentum_buffer"]).all()
    assert ours.state[b]["step"].item() == 3


def test_the_state_round_trips_through_a_state_dict():
    """What a checkpoint holds: a fresh optimizer loaded from it continues identically."""
    model, twin = tiny(), tiny()
    cfg = Config(optimizer="muon", learning_rate=1e-3)
    opt = section(cfg, "optimizer")
    a, b = build_optimizer(model, opt), build_optimizer(twin, opt)
    x = torch.randint(0, 256, (2, 16))

    def step(m, opt):
        opt.zero_grad()
        m(x, x)[0].backward()
        opt.step()
    step(model, a)
    twin.load_state_dict(model.state_dict())
    b.load_state_dict(copy.deepcopy(a.state_dict()))   # as read back from disk: no shared tensor
    assert [g["muon"] for g in b.param_groups] == [False, False, True]
    for _ in range(2):
        step(model, a)
        step(twin, b)
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_muon_flops_are_counted_per_matrix():
    model = tiny()
    per_block = [(128, 384), (128, 128), (128, 512), (128, 512)]   # (smaller, larger) side
    want = 2 * sum(NS_STEPS * (4 * m * m * n + 2 * m ** 3) for m, n in per_block)
    assert muon_flops_per_step(model) == want


def test_muon_is_refused_under_fsdp_in_one_line():
    cfg = Config(optimizer="muon")
    check_distributed(section(cfg, "optimizer"), "MULTI_GPU")    # DDP: whole matrices, fine
    check_distributed(section(Config(), "optimizer"), "FSDP")     # AdamW under FSDP, fine
    with pytest.raises(BadInput, match="key 'optimizer': muon orthogonalises whole matrices, "
                                       "which FSDP shards"):
        check_distributed(section(cfg, "optimizer"), "FSDP")


def test_gradients_left_scaled_by_fp16s_grad_scaler_are_unscaled_for_muon():
    """GradScaler gives a fused optimizer its scale (grad_scale) instead of unscaling when
    nothing unscaled first: Muon's momentum must see the true gradient."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(48, 32))
    ref_w = torch.nn.Parameter(w.detach().clone())
    ours = MuonAdamW([{"params": [w], "muon": True, "weight_decay": 0.0, "momentum": 0.95}],
                     lr=0.02, fused=True, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon([ref_w], lr=0.02, weight_decay=0.0, momentum=0.95)
    for scale in (1024.0, 4096.0):
        g = torch.randn(48, 32)
        w.grad, ref_w.grad = g * scale, g.clone()
        ours.grad_scale = torch.tensor(scale)
        ours.step()
        ref.step()
        assert torch.allclose(ours.state[w]["momentum_buffer"],
                              ref.state[ref_w]["momentum_buffer"], rtol=1e-6, atol=1e-7)
        assert torch.allclose(w, ref_w, atol=1e-6, rtol=0)
