"""Loss: cross-entropy and the two documented penalties against hand computations."""
import math

import pytest
import torch

from fp8train.loss import lm_loss


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
