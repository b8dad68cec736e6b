"""hf_model.py: a transformers causal LM behind the interface fp8train trains (model: hf:...).

Tiny models of three families (Llama, Qwen3, Gemma), written to local directories by
support/hf_models.py: real transformers classes, offline."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from fp8train.config.schema import Config
from fp8train.errors import BadInput
from fp8train.hf_model import HFCausalLM, hf_model_config, model_config
from fp8train.optim.optimizer import hidden_matrices
from fp8train.precision import build_precision
from support.hf_models import FAMILIES, VOCAB, write_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_models")
    return {f: write_model(str(root / f), f) for f in FAMILIES + ("gpt2", "mistral")}


def build(directory: str, seq_len: int = 64, seed: int = 0) -> HFCausalLM:
    torch.manual_seed(seed)
    return hf_model_config(directory, "scratch", seq_len).build()


def batch(seed: int = 0, b: int = 2, t: int = 64):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (b, t + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


@pytest.mark.parametrize("family", FAMILIES + ("mistral",))
def test_logits_and_loss_are_the_transformers_models_own(dirs, family):
    """Our forward (backbone, output layer, chunked loss) gives the transformers model's own
    logits, and its loss and gradients are cross-entropy of those logits."""
    model = build(dirs[family])
    x, y = batch()
    assert model.check_logits() < 1e-5
    total, ce, penalty = model(x, y)
    ref = F.cross_entropy(model.hf(input_ids=x).logits.float().flatten(0, 1), y.flatten())
    torch.testing.assert_close(ce, ref, rtol=1e-5, atol=1e-6)
    assert total is ce and penalty.item() == 0.0
    ours = torch.autograd.grad(ce, list(model.parameters()))
    theirs = torch.autograd.grad(ref, list(model.parameters()))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert model(x, last_only=True).shape == (2, 1, VOCAB)


def test_gemma_soft_capping_is_applied_like_its_own(tmp_path):
    """Gemma 2 caps its logits (final_logit_softcapping): ours are capped the same way."""
    import transformers
    config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16,
                                       final_logit_softcapping=2.0, max_position_embeddings=128)
    config.save_pretrained(tmp_path)
    model = build(str(tmp_path))
    assert model.softcap == 2.0
    assert model.check_logits() < 1e-5
    assert model(batch()[0]).abs().max() <= 2.0


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_are_the_decoder_layers(dirs, family):
    model = build(dirs[family])
    assert len(model.blocks) == 2
    assert model.blocks is model.hf.base_model.layers
    assert model._no_split_modules == [type(model.blocks[0]).__name__]
    assert type(model.blocks[0]).__name__.endswith("DecoderLayer")


def test_parameter_count_and_flops(dirs):
    """Tied embeddings count once; the output layer counts as a matmul either way."""
    for family in ("llama", "qwen3"):
        model = build(dirs[family])
        c = model.mcfg
        assert model.num_params() == model.hf.num_parameters()
        embed = VOCAB * c.n_embd
        assert model.num_params(exclude_embeddings=True) == model.num_params() - embed
        matrices = sum(p.numel() for b in model.blocks for p in b.parameters() if p.dim() == 2)
        attention = 12 * c.n_layer * c.n_head * c.head_dim * 64
        assert model.flops_per_token() == 6 * (matrices + embed) + attention
    assert build(dirs["llama"]).mcfg.tie_embeddings is False
    assert build(dirs["qwen3"]).mcfg.tie_embeddings is True


def test_muon_takes_the_decoder_layers_matrices_only(dirs):
    model = build(dirs["qwen3"])
    names = {n for n, _ in hidden_matrices(model)}
    assert len(names) == 2 * 7   # q, k, v, o, gate, up, down in each of 2 layers
    assert all(".layers." in n and n.endswith("proj.weight") for n in names)
    assert model.fused_parts() == {}


@pytest.mark.parametrize("family", FAMILIES)
def test_activation_checkpointing_recomputes_each_layer_with_the_same_gradients(dirs, family):
    """With activation_checkpointing on, each decoder layer goes through checkpoint_fn (the
    recompute a precision may replace) in training, and the gradients are eager's."""
    x, y = batch()
    plain, ckpt = build(dirs[family]), build(dirs[family])
    ckpt.activation_checkpointing = True
    calls = []
    default = ckpt.checkpoint_fn

    def counting(fn, *args):
        calls.append(args[0].shape)
        return default(fn, *args)
    ckpt.checkpoint_fn = counting
    g1 = torch.autograd.grad(plain(x, y)[0], list(plain.parameters()))
    g2 = torch.autograd.grad(ckpt(x, y)[0], list(ckpt.parameters()))
    assert len(calls) == 2
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        ckpt(x)
    assert len(calls) == 2   # no recompute without gradients


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", ["native", "torchao"])
def test_fp8_converts_the_layers_and_training_lowers_the_loss(dirs, family, backend):
    """Every FP8 backend converts the decoder layers' Linears (the output layer stays out, by
    fp8_exclude's default), and 12 AdamW steps on one batch lower the loss well below ln(V)."""
    if backend == "torchao":
        pytest.importorskip("torchao")
    model = build(dirs[family])
    prec = build_precision(Config(use_fp8=True, fp8_backend=backend), CPU, warn=pytest.fail)
    model = prec.convert(model)
    assert len(prec.selection.chosen) == 14
    assert prec.selection.skipped == {"hf.lm_head": "excluded by fp8_exclude"}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batch()
    losses = []
    for _ in range(12):
        with prec.forward_context(training=True):
            loss = model(x, y)[0]
        loss.backward()
        prec.after_backward()
        opt.step()
        prec.after_optimizer_step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[0] > math.log(VOCAB) - 0.5
    assert losses[-1] < losses[0] - 1.0, losses


def test_pretrained_weights_are_loaded(tmp_path):
    """init_from: pretrained starts from the directory's weights; scratch from fresh ones."""
    d = write_model(str(tmp_path / "w"), "llama", weights=True, seed=3)
    import transformers
    saved = transformers.AutoModelForCausalLM.from_pretrained(d)
    torch.manual_seed(0)
    loaded = hf_model_config(d, "pretrained", 64).build()
    fresh = build(d)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(loaded.hf.state_dict()[w], saved.state_dict()[w])
    assert not torch.equal(fresh.hf.state_dict()[w], saved.state_dict()[w])


def test_shapes_on_the_meta_device_read_no_weights(tmp_path):
    d = write_model(str(tmp_path / "w"), "llama", weights=True)
    with torch.device("meta"):
        model = hf_model_config(d, "pretrained", 64).build()
    assert all(p.is_meta for p in model.parameters())


def test_model_config_checks_the_vocabulary_and_the_context(dirs):
    cfg = Config(model="hf:" + dirs["llama"], seq_len=64)
    mcfg = model_config(cfg, 256)
    assert (mcfg.vocab_size, mcfg.padded_vocab_size, mcfg.n_layer, mcfg.arch) == \
        (256, VOCAB, 2, "llama")
    with pytest.raises(BadInput, match="has 320 token ids, but the data's tokenizer"):
        model_config(cfg, 50257)
    with pytest.raises(BadInput, match="seq_len 512 is longer than .*max_position_embeddings 256"):
        model_config(Config(model="hf:" + dirs["llama"], seq_len=512), 256)


def test_what_cannot_be_loaded_is_one_line(tmp_path, monkeypatch, dirs):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BadInput) as e:
        hf_model_config("some-org/no-such-model", "scratch", 64)
    assert "offline mode is set (HF_HUB_OFFLINE=1)" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(BadInput, match="cannot load model config '/no/such/dir'"):
        hf_model_config("/no/such/dir", "scratch", 64)
    import transformers
    transformers.ViTConfig().save_pretrained(tmp_path / "vit")
    with pytest.raises(BadInput, match="a vit model, which transformers has no causal LM class"):
        hf_model_config(str(tmp_path / "vit"), "scratch", 64)


def test_conv1d_projections_are_named(dirs):
    """GPT-2's transformers class computes its projections in Conv1D, which no FP8 backend
    converts: named, so that the run can refuse FP8 for it in one line."""
    model = build(dirs["gpt2"])
    assert model.not_linear()[:2] == ["0.attn.c_attn (Conv1D)", "0.attn.c_proj (Conv1D)"]
    assert build(dirs["llama"]).not_linear() == []


def test_multimodal_and_mixture_of_experts_models_are_refused(tmp_path):
    import transformers
    transformers.Gemma3Config(text_config=dict(vocab_size=VOCAB, hidden_size=64,
                                               intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=16)).save_pretrained(tmp_path / "mm")
    with pytest.raises(BadInput, match="multimodal gemma3 model; .* text-only"):
        hf_model_config(str(tmp_path / "mm"), "scratch", 64)
    transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2,
                                num_experts=4).save_pretrained(tmp_path / "moe")
    with pytest.raises(BadInput, match="mixture-of-experts model .num_experts 4"):
        hf_model_config(str(tmp_path / "moe"), "scratch", 64)


def test_a_model_without_sdpa_loads_its_weights_with_its_own_attention(tmp_path):
    """Gemma 2 has no SDPA attention: the choice is made on the meta device, then its weights
    load once, with transformers' eager attention."""
    import transformers
    config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=128)
    torch.manual_seed(1)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = hf_model_config(str(tmp_path), "pretrained", 64).build()
    assert model.attention == "eager"
    assert model.layer_kinds == ["full_attention", "sliding_attention"]
    assert model.check_logits() < 1e-5


def test_a_recorded_config_rebuilds_the_model_without_its_source(tmp_path):
    """What a run records (derived.hf_config) is enough: the directory may be gone."""
    import shutil
    d = write_model(str(tmp_path / "m"), "qwen3")
    first = hf_model_config(d, "scratch", 64)
    shutil.rmtree(d)
    again = model_config(Config(model=f"hf:{d}", seq_len=64), 256,
                         saved={"hf_config": first.hf_config})
    assert again == dataclasses.replace(first, vocab_size=256)
    assert again.transformers_config().to_dict() == first.transformers_config().to_dict()


def test_compile_block_compiles_each_layers_forward_inside_the_checkpointing(dirs):
    """compile.py's per-block compile of an hf: model: one compiled forward for every decoder
    layer, called by the layer's own forward, so the recompute stays outside the graph."""
    model = build(dirs["llama"])
    for block in model.blocks:
        model.compile_block(block, None)
    bodies = {id(b.fp8train_body) for b in model.blocks}
    assert len(bodies) == 1 and model.blocks[0].fp8train_body is not None


def test_a_tied_output_layer_cut_from_its_embedding_is_seen(dirs):
    model = build(dirs["qwen3"])
    assert model.ties_kept()
    head = model.hf.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone())
    assert not model.ties_kept()
    assert build(dirs["llama"]).ties_kept()   # nothing tied, nothing to keep


def test_fp8_exclude_names_an_hf_models_layers_by_their_transformers_names():
    from fp8train.precision.layers import excluded
    assert excluded("hf.lm_head", ["lm_head"]) and excluded("lm_head", ["lm_head"])
    assert excluded("hf.model.layers.0.mlp.down_proj", ["model.layers.0.*"])
    # A preset's names are matched whole, as before: no pattern reaches inside a name.
    assert not excluded("blocks.0.attn.proj", ["proj"])
    assert not excluded("blocks.0.attn.proj", ["attn.proj"])


def test_fp8_auto_weighs_the_recipes_on_an_hf_models_shapes(dirs, tmp_path):
    """fp8_recipe auto over a Qwen3's decoder-layer shapes, built on the meta device as the run
    builds them: each distinct shape timed for both native recipes (timings injected: emulated
    FP8 on a CPU says nothing), the real numerics check run on each, the fastest sound one
    chosen."""
    from unit.test_fp8_choose import FakeTimer, Log
    with torch.device("meta"):
        shapes = hf_model_config(dirs["qwen3"], "scratch", 64).build()
    config = Config(use_fp8=True, fp8_backend="native", fp8_recipe="auto", fp8_layers="all",
                    output_dir=str(tmp_path))
    prec = build_precision(config, CPU, warn=pytest.fail, run_dir=str(tmp_path))
    prec.set_tokens(4 * 64)
    from fp8train.precision.choose import choose
    timer, log = FakeTimer(), Log()
    chosen = choose(prec, shapes, None, log.lines.append, log.warnings.append, device=CPU,
                    timer=timer)
    assert (chosen.spec.recipe, chosen.spec.decided) == ("current", "chosen"), "\n".join(log.lines + log.warnings)
    timed = {shape for key, shape in timer.timed if key not in ("base", "forget")}
    # q/o (64 -> 64), k/v (64 -> 32), gate/up (64 -> 128), down (128 -> 64); not the head
    assert timed == {(64, 64, False), (64, 32, False), (64, 128, False), (128, 64, False)}
    assert "fp8 auto: native current chosen" in log.lines
