"""In-process tests of FP8 weight all-gather under FSDP2 (key fp8_fsdp_all_gather, torchao
tensorwise). The whole story, the two-process runs on the real trainer over gloo and their
driver: tests/e2e/test_fsdp_fp8.py."""


import pytest

pytest.importorskip("torchao")


@pytest.mark.parametrize("distribution, key, recipe, trials, on, caution", [
    ("FSDP2", None, "tensorwise", False, True, None),
    ("FSDP2", True, "tensorwise", False, True, None),
    ("FSDP2", False, "tensorwise", False, False, None),
    ("FSDP2", None, "rowwise", False, False, None),
    ("FSDP2", None, "tensorwise", True, False, None),     # the micro-batch probe's models
    ("MULTI_GPU", None, "tensorwise", False, False, None),
    ("MULTI_GPU", True, "tensorwise", False, False, "(DDP)"),
    ("NO", True, "tensorwise", False, False, "(one process)"),
])
def test_when_the_weights_are_gathered_in_fp8(monkeypatch, distribution, key, recipe, trials, on,
                                              caution):
    """On for FSDP2 with tensorwise unless the key is false; never for trial models; true
    without FSDP2 does nothing and says so once. What Accelerate will do at prepare() is
    stood in for (the 2-process run above reads it from a real Accelerator)."""
    import torch
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Wrapped

    from fp8train.config.load import Config
    from fp8train.model import GPT, model_config_from
    from fp8train.precision import ao, build_precision
    monkeypatch.setattr(ao, "distribution", lambda: distribution)
    cfg = Config(use_fp8=True, fp8_backend="torchao", fp8_recipe=recipe, fp8_layers="all",
                 fp8_fsdp_all_gather=key)
    prec = build_precision(cfg, torch.device("cpu"), warn=pytest.fail)
    prec = prec.for_trials() if trials else prec
    model = prec.convert(GPT(model_config_from("tiny", 256, 64, n_layer=1)))
    qkv = model.blocks[0].attn.qkv
    assert prec.fsdp_all_gather is on and qkv.config.enable_fsdp_float8_all_gather is on
    assert isinstance(qkv.weight, Wrapped) is on
    assert prec.derived()["fp8_fsdp_all_gather"] is on
    assert ("all-gathers the weights in FP8" in prec.describe()) is on
    said = [c for c in prec.cautions() if "fp8_fsdp_all_gather" in c]
    assert said == ([] if caution is None else [
        f"fp8_fsdp_all_gather: true does nothing here: this run is not sharded with FSDP2 "
        f"{caution}, so no weight is all-gathered; it applies under FSDP2 (fsdp_version: 2, "
        f"on CUDA)"])


def test_ram_efficient_loading_keeps_the_gather_in_the_base_precision(monkeypatch):
    """FSDP2's cpu_ram_efficient_loading reloads the model from the meta device, which
    torchao's FP8-gather weight wrappers cannot go through (Accelerate refuses the pair for its
    own torchao path): the weights are then gathered as usual, and the run says why once."""
    import torch

    from fp8train.config.load import Config
    from fp8train.model import GPT, model_config_from
    from fp8train.precision import ao, build_precision
    monkeypatch.setattr(ao, "distribution", lambda: "FSDP2")
    monkeypatch.setattr(ao, "fsdp_ram_efficient_loading", lambda: True)
    prec = build_precision(Config(use_fp8=True, fp8_backend="torchao", fp8_layers="all"),
                           torch.device("cpu"), warn=pytest.fail)
    model = prec.convert(GPT(model_config_from("tiny", 256, 64, n_layer=1)))
    assert not prec.fsdp_all_gather
    assert not model.blocks[0].attn.qkv.config.enable_fsdp_float8_all_gather
    said = [c for c in prec.cautions() if "fp8_fsdp_all_gather" in c]
    assert len(said) == 1 and "cpu_ram_efficient_loading" in said[0]


def test_under_fsdp2_in_bf16_the_models_loss_is_not_cast_to_bf16(monkeypatch):
    """The model returns its loss; Accelerate's FSDP2 policy would cast the root module's outputs
    to bf16 (its MixedPrecisionPolicy output_dtype), rounding the loss to about 0.02. fp8train
    gives Accelerate the launch's plugin with no output cast. CUDA is mocked (it cannot exist
    here): only whether the plugin is built, and how, is checked; the FSDP_* variables are the
    ones `accelerate launch` sets from accelerate_configs/fsdp_8xh100.yaml."""
    import torch

    from fp8train.train.build import fsdp2_plugin
    for var, value in (("ACCELERATE_USE_FSDP", "true"), ("FSDP_VERSION", "2"),
                       ("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"),
                       ("FSDP_TRANSFORMER_CLS_TO_WRAP", "Block")):
        monkeypatch.setenv(var, value)
    assert fsdp2_plugin("bf16") is None   # no CUDA: Accelerate runs DDP, nothing to change
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plugin = fsdp2_plugin("bf16")
    policy = plugin.mixed_precision_policy
    assert plugin.fsdp_version == 2 and policy.output_dtype is None
    assert policy.param_dtype == policy.reduce_dtype == torch.bfloat16
    assert fsdp2_plugin("no") is None      # fp32: Accelerate's policy casts nothing
    monkeypatch.setenv("FSDP_VERSION", "1")
    assert fsdp2_plugin("bf16") is None
