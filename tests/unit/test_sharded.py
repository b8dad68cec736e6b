"""fp8train/batch/sharded.py: the FSDP2 accounting of the micro-batch probe, on models of known
sizes. Its check against a real FSDP2 step over gloo: tests/e2e/test_fsdp_batch.py."""
import torch
from torch import nn

from fp8train.batch.sharded import as_sharded, fsdp_dtypes, sharding, units
from fp8train.batch.speed import StepTimes


class Toy(nn.Module):
    """A root unit (an embedding of 10 × 4, tied to the head: counted once) and two Blocks of
    5 × 3 weights + 5 biases and 7 × 3 + 7."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.wte.weight
        self.blocks = nn.ModuleList([nn.Linear(3, 5), nn.Linear(3, 7)])


def test_each_unit_holds_its_own_parameters_and_tied_ones_once():
    blocks, root = units(Toy())
    assert [sum(p.numel() for p in ps) for ps in blocks] == [20, 28]
    assert [p.numel() for p in root] == [40]


def test_the_accounting_of_a_toy_model_over_two_ranks():
    """State: 88 fp32 parameters × 4 copies × 4 bytes. A rank's share pads dim 0: 5 rows -> 3
    per rank (3·3 + 3 of the first Block), 7 -> 4 (4·3 + 4), 10 -> 5 (5·4). Gathered at once:
    the root and twice the largest Block in the gather dtype; every gradient unsharded (the
    accumulation's) and one Block's in flight, in the reduce dtype (bf16 both)."""
    s = sharding(Toy(), 2, torch.bfloat16, torch.bfloat16)
    assert s.state_bytes == 88 * 4 * 4
    assert s.shard_bytes == (9 + 3 + 12 + 4 + 20) * 4 * 4
    assert s.gathered_bytes == (40 + 2 * 28) * 2 + (88 + 28) * 2
    assert s.footprint(10_000) == 10_000 - s.state_bytes + s.shard_bytes + s.gathered_bytes
    with torch.device("meta"):
        assert sharding(Toy(), 2, torch.bfloat16, torch.bfloat16) == s


def test_a_sharded_trial_counts_its_peaks_as_sharded_and_an_unsharded_one_is_left_alone():
    s = sharding(Toy(), 4, torch.float32, torch.float32)

    def trial(micro):
        return 1_000_000 * micro

    trial.timed = lambda micro, steps: StepTimes(1_000_000 * micro, 0.5, 0.1)
    wrapped = as_sharded(s, trial)
    assert wrapped(3) == s.footprint(3_000_000)
    assert wrapped.timed(2, 5) == StepTimes(s.footprint(2_000_000), 0.5, 0.1)
    assert as_sharded(None, trial) is trial


def test_the_gather_dtype_is_the_base_precision_on_a_gpu_and_fp32_otherwise():
    assert fsdp_dtypes("bf16", True) == (torch.bfloat16, torch.bfloat16)
    assert fsdp_dtypes("fp16", True) == (torch.float16, torch.float16)
    assert fsdp_dtypes("bf16", False) == fsdp_dtypes("no", True) == (torch.float32, torch.float32)
