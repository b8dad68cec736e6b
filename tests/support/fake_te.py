"""Transformer Engine as the CPU tests see it: TE's real recipe module, read from its wheel
(FP8TRAIN_TE_WHEEL), beside a stand-in for transformer_engine.pytorch (te.Linear a plain Linear,
autocast a recorder, the availability functions answering what the test says), which needs
CUDA. Used by tests/unit/test_te_recipes.py and tests/unit/test_diagnose_gpu.py."""
import contextlib
import os
import sys
import types
import zipfile
from pathlib import Path

import pytest
from torch import nn

RECIPE = "transformer_engine.common.recipe"
_WHEEL_MODULE: dict = {}
BLOCK_REASON = "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."


def _wheel_recipe_module():
    """TE's recipe module from its wheel, under its real name (pickles name their classes by
    module), built once; tests register it in sys.modules through the `te` fixture."""
    wheel = os.environ.get("FP8TRAIN_TE_WHEEL")
    if not wheel or not Path(wheel).is_file():
        pytest.skip("FP8TRAIN_TE_WHEEL not set (CI sets it to a transformer_engine wheel)")
    if "mod" not in _WHEEL_MODULE:
        src = zipfile.ZipFile(wheel).read("transformer_engine/common/recipe/__init__.py")
        mod = types.ModuleType(RECIPE)
        saved = sys.modules.get(RECIPE)
        sys.modules[RECIPE] = mod   # pydantic resolves the annotations through sys.modules
        try:
            exec(compile(src, f"{wheel}!recipe/__init__.py", "exec"), mod.__dict__)
        finally:
            if saved is None:
                del sys.modules[RECIPE]
            else:
                sys.modules[RECIPE] = saved
        _WHEEL_MODULE["mod"] = mod
    return _WHEEL_MODULE["mod"]


class FakeTE(types.ModuleType):
    """transformer_engine.pytorch as fp8train uses it, for a GPU that runs FP8 (its
    availability functions answer `fp8` and `block`, as TE 2.9+ does with return_reason=True)."""

    class Linear(nn.Linear):
        def __init__(self, i, o, bias=True, params_dtype=None, device=None):
            super().__init__(i, o, bias=bias, dtype=params_dtype, device=device)

    def __init__(self):
        super().__init__("transformer_engine.pytorch")
        self.fp8, self.block = (True, ""), (True, "")
        self.entered = []

    def is_fp8_available(self, return_reason=False):
        return self.fp8 if return_reason else self.fp8[0]

    def is_fp8_block_scaling_available(self, return_reason=False):
        return self.block if return_reason else self.block[0]

    def autocast(self, enabled, recipe):
        self.entered.append((enabled, recipe))
        return contextlib.nullcontext()

    @staticmethod
    def checkpoint(block, x, use_reentrant):
        return block(x)


def install_fake_te(monkeypatch) -> FakeTE:
    """The stand-in transformer_engine.pytorch, with TE's real recipe module beside it, in
    sys.modules for the test's duration."""
    recipes = _wheel_recipe_module()
    fake = FakeTE()
    top, common = types.ModuleType("transformer_engine"), types.ModuleType(
        "transformer_engine.common")
    top.__version__, top.pytorch, top.common, common.recipe = "2.20.2", fake, common, recipes
    for name, mod in (("transformer_engine", top), ("transformer_engine.common", common),
                      (RECIPE, recipes), ("transformer_engine.pytorch", fake)):
        monkeypatch.setitem(sys.modules, name, mod)
    fake.recipes = recipes
    return fake
