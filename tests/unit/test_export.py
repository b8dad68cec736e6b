"""In-process tests: After training: export to transformers, sampling, evaluation of a checkpoint.
The whole story, and the tests that start processes: tests/e2e/test_export.py."""


import pytest
import torch
from support.export_shared import transformers


@pytest.mark.parametrize("arch,kw", [
    ("gpt2", dict(n_layer=2, n_head=4, n_embd=64, ffn_hidden_size=256)),
    # GQA, an untied head, a RoPE base other than transformers' default
    ("llama", dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden_size=192,
                   tie_embeddings=False, rope_theta=500000.0)),
])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_transformers_model_gives_our_logits(tmp_path, arch, kw, dtype):
    from fp8train.evaluate.hf_export import (DTYPES, LOGIT_TOLERANCE, _rounded, compare_logits,
                                             write_model)
    from fp8train.model import GPT, ModelConfig
    torch.manual_seed(0)
    mcfg = ModelConfig(arch=arch, vocab_size=100, block_size=48, **kw)  # padded to 128
    ours = GPT(mcfg).eval()
    with torch.no_grad():   # norms away from their init of 1 / 0, so a missed norm shows
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    write_model(str(tmp_path), mcfg, ours.state_dict(), DTYPES[dtype])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == ("GPT2LMHeadModel" if arch == "gpt2" else "LlamaForCausalLM")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.dtype == DTYPES[dtype] and hf.config.vocab_size == 100
    diff, scale = compare_logits(_rounded(ours, DTYPES[dtype]), hf, mcfg)
    assert scale > 0.1 and diff <= LOGIT_TOLERANCE * max(1.0, scale), (diff, scale)
    if dtype == "fp32":
        assert diff < 1e-5   # what docs/after_training.md states


def test_a_trained_runs_autocast_is_its_base_precisions():
    """evaluate.py, sample.py and the export's check compute as the run trained: fp32 on a CPU
    for precision auto (no autocast), and fp16 asked on a CPU said once and computed in fp32."""
    import torch

    from fp8train.config.load import Config
    from fp8train.evaluate.trained import autocast
    cpu = torch.device("cpu")
    said = []
    for cfg, on in ((Config(), False), (Config(precision="fp16"), False),
                    (Config(precision="bf16"), True)):
        with autocast(cfg, cpu, said.append):
            assert torch.is_autocast_enabled("cpu") == on
            if on:
                assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert said == ["<defaults>: key 'precision': fp16 with loss scaling needs a CUDA GPU; use "
                    "bf16 or fp32: computing in fp32"]
