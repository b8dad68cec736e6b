"""fp8train/train/plan.py in process: the plan made at start holds the FP8 spec as decided.
The run's length and schedule: tests/unit/test_config.py (run_length); whole runs that plan,
probe and choose: tests/e2e/test_autobatch.py and tests/e2e/test_fp8_choose.py."""
import numpy as np
import pytest

from fp8train.batch.plan import manual_plan
from fp8train.config.load import Config, section
from fp8train.model import model_config_from
from fp8train.observe.logger import Logger
from fp8train.precision import build_precision
from fp8train.train.plan import decide

pytestmark = pytest.mark.usefixtures("no_accelerate_state_left")


def plan_of(tmp_path, **keys):
    from accelerate import Accelerator
    cfg = Config(output_dir=str(tmp_path), batch_size=4, gradient_accumulation_steps=1,
                 max_steps=10, warmup_steps=2, **keys)
    acc = Accelerator(cpu=True)
    prec = build_precision(cfg, acc.device, warn=pytest.fail)
    mcfg = model_config_from("tiny", vocab_size=256, block_size=cfg.seq_len)
    tokens = np.arange(20_000, dtype=np.uint16) % 256
    written = manual_plan(section(cfg, "batch"), acc.num_processes)
    return decide(cfg, prec, acc, mcfg, tokens, written, {}, str(tmp_path), Logger(False))


def test_the_plan_holds_the_fp8_spec_as_decided(tmp_path):
    """fp8 auto on a CPU takes the backend's default (nothing timed): the plan's spec is that
    precision's, decided "default", with what the config asked kept; a named recipe is the
    config's; without FP8 the plan holds none."""
    prec, plan = plan_of(tmp_path / "auto", use_fp8=True, fp8_backend="auto")
    assert plan.fp8 is prec.spec and not prec.auto
    assert (plan.fp8.backend, plan.fp8.recipe, plan.fp8.decided, plan.fp8.asked) == \
        ("native", "delayed", "default", ("auto", "auto"))
    prec, plan = plan_of(tmp_path / "named", use_fp8=True, fp8_backend="native",
                         fp8_recipe="current")
    assert (plan.fp8.recipe, plan.fp8.decided) == ("current", "config")
    prec, plan = plan_of(tmp_path / "off")
    assert plan.fp8 is None and not prec.fp8
    # One epoch of 20,000 tokens at 4 × 1,024 tokens per step: 5 steps, before max_steps' 10.
    assert (plan.batch.plan.micro, plan.length.total_steps) == (4, 5)
