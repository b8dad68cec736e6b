"""The fixtures every test folder shares; the helpers are in tests/support (support.runs).
tests/ and the repository root are put on sys.path, so that tests import `support.*` and the
checkout's fp8train."""
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS.parent))
sys.path.insert(0, str(TESTS))

from support.runs import DATA_DIR, require_corpus  # noqa: E402


@pytest.fixture(scope="session")
def data_dir() -> str:
    return DATA_DIR


@pytest.fixture(scope="session")
def gpu_corpus() -> str:
    """The corpus of tests/gpu (gpu_support.needs_corpus): a test that cannot find it FAILS,
    saying where it looked. On a GPU machine a skip reads as a pass. Session-scoped, so that it
    runs before any module fixture that would train on the missing file."""
    return require_corpus()


@pytest.fixture
def no_accelerate_state_left():
    """For tests that build an Accelerator in the test process: its process-wide state would
    reach later tests (tests/e2e/test_fsdp_fp8.py reads it). Reset after each test, as
    Accelerate's own AccelerateTestCase.tearDown does. Used as
    `pytestmark = pytest.mark.usefixtures("no_accelerate_state_left")`."""
    yield
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def gloo_world_of_one():
    """A default process group of one CPU process over gloo (a free local port), for tests that
    wrap a model in DDP in the test process; destroyed after the test."""
    import os
    import socket

    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
