"""Parameter sets without the W&B server: a grid's combinations, or seeded random draws from
the parameters' distributions (for `local`)."""
from __future__ import annotations

import itertools
import math
import random

from ..errors import SweepError
from .spec import quantize, spec_distribution

# Distributions `local` can sample (the rest need the W&B server).
LOCAL_DISTRIBUTIONS = ("constant", "categorical", "int_uniform", "uniform", "q_uniform",
                       "log_uniform", "log_uniform_values", "q_log_uniform_values", "normal",
                       "q_normal", "log_normal", "beta")


def grid_trials(cfg: dict) -> list[dict]:
    """Every combination of the parameters' values, the last parameter varying fastest."""
    params = cfg["parameters"]
    axes = [_grid_axis(spec, spec_distribution(name, spec, "<sweep>"))
            for name, spec in params.items()]
    return [dict(zip(params, combo)) for combo in itertools.product(*axes)]


def _grid_axis(spec: dict, dist: str) -> list:
    if dist == "constant":
        return [spec["value"]]
    if dist == "categorical":
        return list(spec["values"])
    if dist == "int_uniform":
        return list(range(spec["min"], spec["max"] + 1))
    raise SweepError(f"grid search cannot enumerate distribution {dist}")


def sample_param(spec: dict, dist: str, rng: random.Random):
    """One draw from a W&B parameter spec."""
    if dist == "constant":
        return spec["value"]
    if dist == "categorical":
        if "probabilities" in spec:
            return rng.choices(spec["values"], weights=spec["probabilities"])[0]
        return rng.choice(spec["values"])
    lo, hi, q = spec.get("min"), spec.get("max"), spec.get("q", 1)
    ints = all(isinstance(x, int) for x in (lo, hi, q))
    if dist == "int_uniform":
        return rng.randint(lo, hi)
    if dist == "uniform":
        return rng.uniform(lo, hi)
    if dist == "q_uniform":
        v = quantize(rng.uniform(lo, hi), q)
        return int(v) if ints else v
    if dist == "log_uniform":  # W&B: min and max are natural-log exponents
        return math.exp(rng.uniform(lo, hi))
    if dist == "log_uniform_values":
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))
    if dist == "q_log_uniform_values":
        v = quantize(math.exp(rng.uniform(math.log(lo), math.log(hi))), q)
        return int(v) if ints else v
    mu, sigma = spec.get("mu", 0.0), spec.get("sigma", 1.0)
    if dist == "normal":
        return rng.gauss(mu, sigma)
    if dist == "q_normal":
        return quantize(rng.gauss(mu, sigma), q)
    if dist == "log_normal":
        return math.exp(rng.gauss(mu, sigma))
    if dist == "beta":
        return rng.betavariate(spec.get("a", 1.0), spec.get("b", 1.0))
    raise SweepError(f"distribution {dist} is not supported by `local`; use create + agent")


def random_trials(cfg: dict, n: int, seed: int = 0) -> list[dict]:
    """`n` parameter sets drawn independently, reproducibly from `seed`."""
    rng = random.Random(seed)
    params = cfg["parameters"]
    dists = {name: spec_distribution(name, spec, "<sweep>") for name, spec in params.items()}
    return [{name: sample_param(params[name], dists[name], rng) for name in params}
            for _ in range(n)]
