"""Loss: cross-entropy and the two documented penalties against hand computations; the chunked
loss against lm_loss, values and gradients."""
import math

import pytest
import torch
import torch.nn.functional as F

from fp8train.loss import chunked_lm_loss, default_chunk_tokens, lm_loss


@pytest.fixture
def batch():
    torch.manual_seed(0)
    return torch.randn(2, 5, 11) * 3, torch.randint(0, 11, (2, 5))


def manual_ce(logits, targets):
    total = 0.0
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            row = logits[b, t].double()
            total += (torch.logsumexp(row, 0) - row[targets[b, t]]).item()
    return total / (logits.shape[0] * logits.shape[1])


def test_cross_entropy_only(batch):
    logits, y = batch
    total, ce, pen = lm_loss(logits, y)
    assert ce.item() == pytest.approx(manual_ce(logits, y), rel=1e-5)
    assert total.item() == ce.item() and pen.item() == 0.0


def test_z_loss(batch):
    logits, y = batch
    total, ce, pen = lm_loss(logits, y, "z_loss", 1e-2)
    z = sum(torch.logsumexp(logits[b, t].double(), 0).item() ** 2
            for b in range(2) for t in range(5)) / 10
    assert pen.item() == pytest.approx(1e-2 * z, rel=1e-5)
    assert total.item() == pytest.approx(ce.item() + 1e-2 * z, rel=1e-5)


def test_logit_l2(batch):
    logits, y = batch
    _, _, pen = lm_loss(logits, y, "logit_l2", 0.5)
    assert pen.item() == pytest.approx(0.5 * logits.double().pow(2).mean().item(), rel=1e-5)


def test_penalty_has_a_gradient_that_shrinks_logits(batch):
    logits, y = batch
    logits = logits.clone().requires_grad_(True)
    _, _, pen = lm_loss(logits, y, "logit_l2", 1.0)
    pen.backward()
    assert torch.sign(logits.grad).eq(torch.sign(logits.detach())).all()


def test_bf16_logits_are_upcast():
    logits = torch.randn(1, 4, 50304).bfloat16()
    y = torch.randint(0, 50304, (1, 4))
    _, ce, _ = lm_loss(logits, y)
    assert ce.dtype == torch.float32 and math.isfinite(ce.item())


# chunked_lm_loss: lm_loss of F.linear(hidden, weight), a chunk of tokens at a time.

B, T, C, V = 2, 7, 8, 40          # 14 tokens


def loss_inputs(dtype=torch.float32, ignored=()):
    torch.manual_seed(1)
    hidden = torch.randn(B, T, C).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, C) * 0.5).to(dtype).requires_grad_(True)
    targets = torch.randint(0, V, (B, T))
    for b, t in ignored:
        targets[b, t] = -100
    return hidden, weight, targets


def values_and_grads(fn, hidden, weight):
    """fn()'s three values, then the gradients of its total w.r.t. hidden and weight."""
    hidden.grad = weight.grad = None
    out = fn()
    out[0].backward()
    return [o.detach() for o in out] + [hidden.grad.clone(), weight.grad.clone()]


def assert_all_close(got, want, rel):
    """Each tensor within rel of the largest magnitude of its reference."""
    names = ("total", "ce", "penalty", "d hidden", "d weight") if len(got) > 2 else ("dh", "dw")
    for name, g, w in zip(names, got, want):
        assert g.dtype == w.dtype, name
        scale = max(w.abs().max().item(), 1e-12)
        assert (g.double() - w.double()).abs().max().item() <= rel * scale, name


@pytest.mark.parametrize("penalty", [("none", 0.0), ("z_loss", 1e-2), ("logit_l2", 0.5)])
@pytest.mark.parametrize("chunk_tokens", [1, 4, 5, 7, 14, 100, None])   # 5: 5+5+4; 100 > 14
def test_chunked_loss_is_lm_loss(penalty, chunk_tokens):
    hidden, weight, y = loss_inputs()
    want = values_and_grads(lambda: lm_loss(F.linear(hidden, weight), y, *penalty),
                            hidden, weight)
    got = values_and_grads(lambda: chunked_lm_loss(hidden, weight, y, *penalty,
                                                   chunk_tokens=chunk_tokens), hidden, weight)
    assert_all_close(got, want, 1e-5)
    if penalty[0] == "none":
        assert got[2].item() == 0.0 and got[0].item() == got[1].item()


@pytest.mark.parametrize("part", [1, 2])            # the cross-entropy alone, the penalty alone
@pytest.mark.parametrize("penalty", [("z_loss", 1e-2), ("logit_l2", 0.5)])
def test_chunked_loss_gradient_of_each_part(penalty, part):
    hidden, weight, y = loss_inputs(ignored=[(1, 2)])
    grads = []
    for fn in (lambda: lm_loss(F.linear(hidden, weight), y, *penalty),
               lambda: chunked_lm_loss(hidden, weight, y, *penalty, chunk_tokens=4)):
        hidden.grad = weight.grad = None
        fn()[part].backward()
        grads.append([hidden.grad.clone(), weight.grad.clone()])
    assert_all_close(grads[1], grads[0], 1e-5)


@pytest.mark.parametrize("penalty", [("none", 0.0), ("z_loss", 1e-2), ("logit_l2", 0.5)])
def test_chunked_loss_scores_only_the_tokens_not_ignored(penalty):
    """-100 targets (a whole chunk of them too) leave the cross-entropy's sum and its count;
    the penalties stay means over every token, as lm_loss's are."""
    ignored = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 6)]
    hidden, weight, y = loss_inputs(ignored=ignored)
    want = values_and_grads(lambda: lm_loss(F.linear(hidden, weight), y, *penalty),
                            hidden, weight)
    got = values_and_grads(lambda: chunked_lm_loss(hidden, weight, y, *penalty,
                                                   chunk_tokens=4), hidden, weight)
    assert_all_close(got, want, 1e-5)
    scored = [(b, t) for b in range(B) for t in range(T) if (b, t) not in ignored]
    logits = F.linear(hidden, weight).detach().double()
    manual = sum((torch.logsumexp(logits[b, t], 0) - logits[b, t, y[b, t]]).item()
                 for b, t in scored) / len(scored)
    assert got[1].item() == pytest.approx(manual, rel=1e-5)
    if penalty[0] == "none":                  # an ignored token has no gradient then
        assert not got[3][0, :4].any()


def test_chunked_loss_with_every_token_ignored_is_nan_as_lm_losss():
    hidden, weight, y = loss_inputs()
    y.fill_(-100)
    assert lm_loss(F.linear(hidden, weight), y)[1].isnan()
    assert chunked_lm_loss(hidden, weight, y, chunk_tokens=4)[1].isnan()


def test_chunked_loss_softcaps_the_logits():
    hidden, weight, y = loss_inputs()
    hidden.data.mul_(3)                      # logits well past the cap
    cap = 2.5
    want = values_and_grads(lambda: lm_loss(cap * torch.tanh(F.linear(hidden, weight) / cap),
                                            y, "z_loss", 1e-2), hidden, weight)
    got = values_and_grads(lambda: chunked_lm_loss(hidden, weight, y, "z_loss", 1e-2,
                                                   softcap=cap, chunk_tokens=3), hidden, weight)
    assert_all_close(got, want, 1e-5)
    capped = cap * torch.tanh(F.linear(hidden, weight).detach().double() / cap)
    assert capped.abs().max() < cap
    manual = sum((torch.logsumexp(capped[b, t], 0) - capped[b, t, y[b, t]]).item()
                 for b in range(B) for t in range(T)) / (B * T)
    assert got[1].item() == pytest.approx(manual, rel=1e-5)


def test_chunked_loss_on_bf16_inputs():
    """The GEMMs stay in bf16 (the model's dtype), the loss is fp32; the weight's gradient is a
    sum of per-chunk bf16 GEMMs where lm_loss's is one, hence the looser tolerance."""
    hidden, weight, y = loss_inputs(torch.bfloat16, ignored=[(1, 1)])
    want = values_and_grads(lambda: lm_loss(F.linear(hidden, weight), y, "z_loss", 1e-2),
                            hidden, weight)
    got = values_and_grads(lambda: chunked_lm_loss(hidden, weight, y, "z_loss", 1e-2,
                                                   chunk_tokens=4), hidden, weight)
    assert got[0].dtype == torch.float32 and got[3].dtype == torch.bfloat16
    assert_all_close(got[:3], want[:3], 1e-5)
    assert_all_close(got, want, 2e-2)


def saved_shapes(fn):
    """fn()'s result and the shapes of the tensors autograd keeps for the backward meanwhile."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, shapes


def test_chunked_loss_keeps_only_its_inputs_for_the_backward():
    hidden, weight, y = loss_inputs()
    _, kept = saved_shapes(lambda: chunked_lm_loss(hidden, weight, y, "z_loss", 1e-2,
                                                   chunk_tokens=5))
    # hidden, weight and targets, and the count of scored tokens that the mean divides by
    assert sorted(kept) == sorted([(B * T, C), (V, C), (B * T,), ()])
    assert (B * T, V) in saved_shapes(lambda: lm_loss(F.linear(hidden, weight), y))[1]


def test_chunked_loss_under_autocast_computes_as_f_linear_would():
    """Under bf16 autocast F.linear's GEMM is bf16 from fp32 inputs; the chunked loss casts the
    same way and hands the fp32 weight a fp32 gradient."""
    hidden, weight, y = loss_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = values_and_grads(lambda: lm_loss(F.linear(hidden, weight), y, "z_loss", 1e-2),
                                hidden, weight)
        got = values_and_grads(lambda: chunked_lm_loss(hidden, weight, y, "z_loss", 1e-2,
                                                       chunk_tokens=4), hidden, weight)
    assert got[4].dtype == torch.float32
    assert_all_close(got[:3], want[:3], 1e-5)
    assert_all_close(got, want, 2e-2)


def test_chunked_loss_under_torch_compile():
    """Inductor on the CPU matches eager and keeps no logits, the chunk loop one operator in
    the graph (traced through, inductor fused the chunks' kernels: every chunk's logits, or
    every chunk's weight gradient, alive at once). The compile takes most of this file's time:
    about 10-30 s on a busy 2-core machine with an empty inductor cache."""
    from torch._dynamo.testing import CompileCounterWithBackend
    hidden, weight, y = loss_inputs(ignored=[(0, 3)])

    def loss(h, w, t):
        return chunked_lm_loss(h, w, t, "z_loss", 1e-2, softcap=4.0, chunk_tokens=5)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    want = values_and_grads(lambda: loss(hidden, weight, y), hidden, weight)
    kept = []

    def run():
        out, shapes = saved_shapes(lambda: compiled(hidden, weight, y))
        kept.extend(shapes)
        return out

    got = values_and_grads(run, hidden, weight)
    assert_all_close(got, want, 1e-5)
    assert kept and not [s for s in kept if s[-1:] == (V,)]
    (graph,) = counter.graphs
    calls = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert calls.count("fp8train.chunked_lm_loss_sums.default") == 1
    assert not [c for c in calls if "linear" in c or "checkpoint" in c]


def test_default_chunk_rows():
    assert default_chunk_tokens(128256) == 512            # Llama 3: 65.7M logits a chunk
    assert default_chunk_tokens(152064) == 384            # Qwen 2
    assert default_chunk_tokens(50304) == 1280
    assert default_chunk_tokens(2 ** 20) == 64
    assert default_chunk_tokens(2 ** 21) == 32            # under 64 rows: not rounded
    assert default_chunk_tokens(2 ** 28) == 1


def test_chunked_loss_rejects_what_lm_loss_rejects():
    hidden, weight, y = loss_inputs()
    with pytest.raises(ValueError, match="unknown penalty_type 'l1'"):
        chunked_lm_loss(hidden, weight, y, "l1", 0.1)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_lm_loss(hidden, weight, y, chunk_tokens=0)
