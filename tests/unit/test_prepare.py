"""In-process tests: The data pipeline: scripts/prepare_data.py on local .jsonl / .parquet / .txt
files through the real `datasets` code path (no hub), with the byte tokenizer and a BPE
tokenizer ... The whole story, and the tests that start processes: tests/e2e/test_prepare.py."""


import numpy as np
import pytest

from fp8train.data.windows import RandomWindows, ShardedTokens


@pytest.mark.parametrize("world,micro,accum", [(2, 4, 2), (8, 2, 1), (8, 3, 2)])
def test_ranks_read_disjoint_windows_within_an_epoch(world, micro, accum):
    """Simulated ranks take their slice of each step exactly as the training loop does."""
    tokens = ShardedTokens([np.arange(n, dtype=np.uint16) for n in (4000, 3000, 5000)])
    seq = 16
    sampler = RandomWindows(tokens, seq, seed=5)
    n = sampler.n_windows
    effective = micro * accum * world
    per_rank = {r: [] for r in range(world)}
    for step in range(n // effective):
        for r in range(world):
            first = step * effective + r * micro * accum
            for m in range(accum):
                per_rank[r] += sampler.starts(first + m * micro, micro).tolist()
    seen = [s for r in per_rank for s in per_rank[r]]
    assert len(seen) == len(set(seen)) == (n // effective) * effective
    assert all(s % seq == 0 and 0 <= s <= len(tokens) - seq - 1 for s in seen)
    # Windows that cross a shard boundary read both shards.
    x, y = sampler.batch(0, n)
    assert (y[:, :-1] == x[:, 1:]).all()
    flat = np.arange(12000)  # the three shards hold 0..3999, 0..2999, 0..4999
    concat = np.concatenate([flat[:4000], flat[:3000], flat[:5000]])
    starts = sampler.starts(0, n)
    assert (x.numpy() == concat[starts[:, None] + np.arange(seq)]).all()


def test_loader_is_deterministic_and_resumes_at_the_same_position():
    tokens = np.arange(50_000, dtype=np.uint16)
    a, b = RandomWindows(tokens, 32, seed=1), RandomWindows(tokens, 32, seed=1)
    straight = [a.batch(pos, 8)[0] for pos in range(0, 400, 8)]
    resumed = [b.batch(pos, 8)[0] for pos in range(200, 400, 8)]  # data_position 200 on resume
    assert all((s == r).all() for s, r in zip(straight[25:], resumed, strict=True))
    # A new epoch is a new order of the same windows.
    n = a.n_windows
    e0, e1 = a.starts(0, n), a.starts(n, n)
    assert sorted(e0) == sorted(e1) and (e0 != e1).any()


@pytest.mark.parametrize("depth", [0, 3])
def test_batch_stream_yields_the_loop_order_with_or_without_prefetch(depth):
    """The background prefetch changes when batches are made, never which: rank 1 of 2,
    micro 4 × accum 3, resumed at data position 48."""
    from fp8train.data.windows import BatchStream
    tokens = np.arange(20_000, dtype=np.uint16)
    sampler = RandomWindows(tokens, 16, seed=3)
    stream = BatchStream(sampler, position=48, rank_offset=12, micro=4, accum=3, effective=24,
                         pin=False, depth=depth)
    got = [stream.next()[0] for _ in range(9)]
    stream.close()
    want = [sampler.batch(48 + s * 24 + 12 + m * 4, 4)[0] for s in range(3) for m in range(3)]
    assert all((g == w).all() for g, w in zip(got, want, strict=True))
