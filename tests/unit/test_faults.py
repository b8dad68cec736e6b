"""In-process tests: Fault injection on real training processes: kill -9 anywhere, corrupt
checkpoints, NaN losses, failing checkpoint writes, changed configs on resume. Faults are placed
with the ... The whole story, and the tests that start processes: tests/e2e/test_faults.py."""


import torch


def test_a_skipped_step_leaves_parameters_and_adam_untouched():
    """The skip happens in the fused AdamW kernel (found_inf), without a host sync."""
    from fp8train.train.health import Health
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    health = Health(torch.device("cpu"), spike_factor=3.0)

    def step(scale):
        model(torch.randn(2, 4)).sum().mul(scale).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.found_inf = health.step(norm, torch.tensor(1.0), torch.tensor(0.0))
        opt.step()
        opt.zero_grad()

    step(1.0)
    before = [p.detach().clone() for p in model.parameters()]
    adam = {k: v.clone() for k, v in opt.state[model.weight].items()}
    step(float("nan"))
    step(float("inf"))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(torch.equal(adam[k], opt.state[model.weight][k]) for k in adam)  # step count too
    assert health.worst.item() == 2 and health.in_streak()
    step(1.0)
    assert not health.in_streak()
    loss_mean, _, bad, loss_max, worst = health.interval().tolist()
    assert (loss_mean, bad, loss_max, worst) == (1.0, 2.0, 1.0, 2.0)


def test_loss_spike_detection():
    from fp8train.train.health import Health
    h = Health(torch.device("cpu"), spike_factor=3.0)
    assert h.spike(2.0, 2.5) is None                  # the first interval sets the mean
    assert h.spike(2.0, 5.9) is None
    msg = h.spike(2.0, 6.5)
    assert msg and "3.2× the running mean 2.0000" in msg
    assert Health(torch.device("cpu"), spike_factor=0).spike(2.0, 100.0) is None
