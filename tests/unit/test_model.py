"""Model presets match published shapes; the forward pass is causal and sane."""
import pytest
import torch

from fp8train.model import GPT, PRESETS, model_config_from


def count(preset, vocab, block, **kw):
    cfg = model_config_from(preset, vocab, block, **kw)
    with torch.device("meta"):  # shapes only: no memory for a 1B model
        return GPT(cfg)


@pytest.mark.parametrize("preset,vocab,block,expected", [
    ("gpt2-124m", 50257, 1024, 124_439_808),    # HF gpt2
    ("gpt2-350m", 50257, 1024, 354_823_168),    # HF gpt2-medium
    ("llama-1b", 128256, 2048, 1_235_814_400),  # Llama 3.2 1B
])
def test_published_parameter_counts(preset, vocab, block, expected):
    assert count(preset, vocab, block, pad_vocab_multiple=1).num_params() == expected


def test_llama_350m_shape():
    m = count("llama-350m", 32000, 2048, pad_vocab_multiple=1)
    d, ffn, L = 1024, 2816, 24
    per_layer = 4 * d * d + 3 * d * ffn + 2 * d  # attention, SwiGLU, two RMSNorm gains
    assert m.num_params() == L * per_layer + 32000 * d + d
    assert (m.mcfg.n_layer, m.mcfg.n_head, m.mcfg.head_dim) == (24, 16, 64)
    assert all(p.dim() > 1 or "norm" in n for n, p in m.named_parameters())  # no biases


def test_vocab_is_padded_to_a_multiple_of_128():
    m = count("gpt2-124m", 50257, 1024)
    assert m.wte.weight.shape[0] == 50304
    assert m.num_params() == 124_439_808 + (50304 - 50257) * 768


def test_overrides_and_derived_mlp_width():
    m = count("llama-350m", 256, 64, n_layer=2, n_embd=256, n_head=4)
    assert (m.mcfg.n_layer, m.mcfg.n_embd, m.mcfg.ffn_hidden_size) == (2, 256, 768)
    with pytest.raises(ValueError, match="not divisible"):
        model_config_from("gpt2-124m", 256, 64, n_head=5)


def test_flops_per_token_follows_6n_plus_attention():
    m = count("gpt2-124m", 50257, 1024, pad_vocab_multiple=1)
    c = m.mcfg
    matmul = 12 * (c.n_embd * 3 * c.n_embd + c.n_embd ** 2 + 2 * c.n_embd * 4 * c.n_embd) \
        + 50257 * c.n_embd
    assert m.flops_per_token() == 6 * matmul + 12 * 12 * 768 * 1024


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_forward_is_causal(preset):
    torch.manual_seed(0)
    m = GPT(model_config_from(preset, 256, 32)).eval()
    x = torch.randint(0, 256, (2, 32))
    logits = m(x)
    assert logits.shape == (2, 32, 256) and torch.isfinite(logits).all()
    x2 = x.clone()
    x2[:, 20:] = (x2[:, 20:] + 1) % 256  # change the future
    torch.testing.assert_close(m(x2)[:, :20], logits[:, :20])
    assert not torch.allclose(m(x2)[:, 20:], logits[:, 20:])


def test_initial_loss_is_near_uniform():
    torch.manual_seed(0)
    m = GPT(model_config_from("tiny", 256, 32))
    x, y = torch.randint(0, 256, (2, 4, 32))
    loss = torch.nn.functional.cross_entropy(m(x).view(-1, 256), y.reshape(-1))
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    m = GPT(model_config_from("tiny-llama", 256, 32))
    x = torch.randint(0, 256, (2, 32))
    grads = []
    for ac in (False, True):
        m.zero_grad()
        m.activation_checkpointing = ac
        m(x).float().pow(2).mean().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_presets_all_build():
    for name in PRESETS:
        assert count(name, 256, 64).num_params() > 0


def test_last_only_logits_equal_the_last_position_of_the_full_forward():
    torch.manual_seed(0)
    model = GPT(model_config_from("tiny-llama", 256, 64)).eval()
    x = torch.randint(0, 256, (3, 40))
    with torch.no_grad():
        torch.testing.assert_close(model(x, last_only=True), model(x)[:, -1:])


@pytest.mark.parametrize("penalty", [("none", 0.0), ("z_loss", 1e-2)])
def test_given_targets_the_model_returns_the_loss_of_its_logits(penalty):
    """model(x, y) is lm_loss(model(x), y) exactly: the training step and the evaluation take
    their loss from the model, so that torch.compile puts it in the forward's graph."""
    from fp8train.loss import lm_loss
    torch.manual_seed(0)
    m = GPT(model_config_from("tiny", 256, 32))
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    got = m(x, y, penalty_type=penalty[0], penalty_weight=penalty[1])
    want = lm_loss(m(x), y, *penalty)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    got[0].backward()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    want[0].backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, m.parameters(), strict=True))

