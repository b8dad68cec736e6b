"""What the GPU tests share: when to skip (and why, in one clear line), runs that never touch the
network, the corpus found without a download, and launching several processes.

Skips: every test in tests/gpu is skipped only when CUDA is absent, or, on a CUDA machine, when
what that test needs is missing: FP8 tensor cores (compute capability 8.9+), a second GPU, or a
backend library that is not installed (a library that is installed but fails to import is a
failure, not a skip). A missing tinyshakespeare corpus is a failure. The conditions below are
written so that on a machine without CUDA only "needs a CUDA GPU" applies, whatever else is
missing there."""
from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

import pytest
import torch
from support.runs import DATA_DIR
from support.runs import run_train as _run_train

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
CAPABILITY = torch.cuda.get_device_capability() if CUDA else (0, 0)
DEVICE_NAME = torch.cuda.get_device_name() if CUDA else "no GPU"

needs_cuda = pytest.mark.skipif(
    not CUDA, reason=f"needs a CUDA GPU (torch {torch.__version__}: torch.cuda.is_available() "
    "is False)")
needs_fp8 = pytest.mark.skipif(
    CUDA and CAPABILITY < (8, 9),
    reason=f"needs FP8 tensor cores (compute capability 8.9+: H100/H200, L40, RTX 4090); "
    f"{DEVICE_NAME} is {CAPABILITY[0]}.{CAPABILITY[1]}")
needs_two_gpus = pytest.mark.skipif(
    CUDA and GPUS < 2, reason=f"needs 2 or more CUDA GPUs; this machine has {GPUS}")


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def needs_library(module: str, pip: str):
    """Skip (on a CUDA machine) when `module` is not installed at all."""
    return pytest.mark.skipif(CUDA and not installed(module),
                              reason=f"{module} is not installed ({pip})")


needs_te = needs_library("transformer_engine",
                         "pip install --no-build-isolation 'transformer_engine[pytorch]'")
needs_torchao = needs_library("torchao", "pip install torchao")


def backend_skip(backend: str) -> None:
    """Skip a parametrized FP8 backend whose library is not installed (native needs none)."""
    module = {"te": "transformer_engine", "torchao": "torchao"}.get(backend)
    if module and not installed(module):
        pytest.skip(f"{module} is not installed: the {backend} backend cannot be tested")


# The corpus is never downloaded here, and a test that cannot find it fails (the gpu_corpus
# fixture of tests/conftest.py, which says where it looked): on a GPU box a skip reads as a pass. On a
# machine without CUDA, needs_cuda skips first.
needs_corpus = pytest.mark.usefixtures("gpu_corpus")

OFFLINE_ENV = {"FP8TRAIN_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "FP8TRAIN_DATA_DIR": DATA_DIR, "PYTHONUNBUFFERED": "1"}


def run_train(*args, env=None, timeout=900):
    """`python train_fp8.py ARGS` (tests/support/runs.py's run_train) with every download disabled:
    a missing file is an error, never a network access."""
    return _run_train(*args, env={**OFFLINE_ENV, **(env or {})}, timeout=timeout)


def offline_environ() -> dict:
    """os.environ plus OFFLINE_ENV: for launchers (torchrun, accelerate launch)."""
    return {**os.environ, **OFFLINE_ENV}


def free_port() -> int:
    """A TCP port nothing listens on now, for a launcher's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_rows(out) -> list:
    from support.runs import rows
    return rows(out, "train/loss")


def val_rows(out) -> list:
    from support.runs import rows
    return rows(out, "val/loss")


def te_state_manager():
    """Transformer Engine's FP8GlobalStateManager (quantization.py in current TE, fp8.py in
    older releases)."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return FP8GlobalStateManager


def te_extra_states(checkpoint: Path) -> dict:
    """layer name -> Transformer Engine's `_extra_state` of that layer in the checkpoint's
    model.safetensors, unpickled ({"scale_fwd", "amax_history_fwd", "scale_bwd",
    "amax_history_bwd", "recipe", ...}), after fp8train's own scan has passed every pickle in
    the checkpoint (the same scan resume runs before anything is unpickled)."""
    import pickle

    from safetensors import safe_open

    from fp8train.checkpoint.safe_load import unsafe_content
    why = unsafe_content(str(checkpoint))
    assert why is None, f"fp8train's checkpoint scan refuses a real TE checkpoint: {why}"
    states = {}
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():
                if key.endswith("._extra_state"):
                    t = fh.get_tensor(key)
                    if t.numel():
                        states[key[:-len("._extra_state")]] = pickle.loads(
                            t.contiguous().view(torch.uint8).numpy().tobytes())
    return states
