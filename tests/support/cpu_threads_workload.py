"""The README demo's training step, timed in a process of its own, with OpenMP's wait policy as
train_fp8.py sets it (`--policy trainer`: fp8train.train.threads.apply, before torch is
imported) or as libgomp leaves it (`--policy default`):

    python tests/support/cpu_threads_workload.py --policy trainer --seconds 3

The model is the demo's (`tiny`: 4 layers, d=128, byte vocabulary, context 64, micro-batch 24,
AdamW); after `--warmup` untimed steps it trains for `--seconds` (at least `--min_steps` steps)
and prints one JSON object: the steps, their wall and CPU seconds and seconds per step, torch's
thread count and the wait policy in effect. tests/e2e/test_cpu_threads.py runs it beside a
competing busy process."""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--policy", choices=("trainer", "default"), required=True)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--min_steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    from fp8train.train import threads
    if a.policy == "trainer":
        threads.apply()
    else:
        for name in threads.USER_CHOICES:
            os.environ.pop(name, None)
    import torch

    from fp8train.model import GPT, model_config_from
    torch.manual_seed(0)
    model = GPT(model_config_from("tiny", 256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 256, (24, 65))

    def step():
        loss = model(data[:, :-1], data[:, 1:])[0]     # (total, cross-entropy, penalty)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(a.warmup):
        step()
    start, cpu, steps = time.perf_counter(), time.process_time(), 0
    while steps < a.min_steps or time.perf_counter() - start < a.seconds:
        step()
        steps += 1
    wall = time.perf_counter() - start
    print(json.dumps({"policy": a.policy, "steps": steps, "wall_s": wall,
                      "cpu_s": time.process_time() - cpu, "s_per_step": wall / steps,
                      "threads": torch.get_num_threads(),
                      "wait_policy": os.environ.get("OMP_WAIT_POLICY")}))


if __name__ == "__main__":
    main()
