"""The fixtures every test folder shares; the helpers are in tests/support (support.runs).
tests/ and the repository root are put on sys.path, so that tests import `support.*` and the
checkout's fp8train."""
import contextlib
import fcntl
import os
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS.parent))
sys.path.insert(0, str(TESTS))

from support.runs import DATA_DIR, require_corpus  # noqa: E402

# Two pytest-xdist workers (`-n 2`, as the README's test command and CI run the suite) share
# the machine. Each test's processes then run on one thread, and compile in that process (no
# pool of compile workers), so that two tests take one core each instead of every process
# fighting over both. Tests that time the machine (marked `alone`) hold it alone: no other test
# runs beside them.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: times the machine; under pytest-xdist no other "
                                       "test runs beside it")


@contextlib.contextmanager
def _share_the_machine(alone: bool):
    """Hold the machine shared (any test) or alone (a test marked `alone`) for one test, its
    fixtures included, among this run's workers. Two locks: the gate is taken to start any test
    and kept by an `alone` test while it runs, so that a test waiting to run alone is not
    overtaken by the other worker's next tests."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "run")
    base = Path(tempfile.gettempdir()) / f"fp8train-tests-{run}"
    with open(f"{base}.gate", "a") as gate, open(f"{base}.cpu", "a") as cpu:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(cpu, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(cpu, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(optionalhook=True)   # a hook of pytest-xdist, when it runs the suite
def pytest_xdist_make_scheduler(config, log):
    """`-n N` hands out whole test files (unless --dist says otherwise): a module's trained runs
    are then made once, in one worker, not once per worker."""
    if config.getoption("dist") == "load":
        from xdist.scheduler import LoadFileScheduling
        return LoadFileScheduling(config, log)
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not WORKER:
        yield
        return
    with _share_the_machine(item.get_closest_marker("alone") is not None):
        yield


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
