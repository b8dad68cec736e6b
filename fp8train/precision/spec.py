"""The FP8 spec: what FP8 a run trains with, taken from the config once and frozen.

`build_precision` makes it from the config (`Fp8Spec.of`); from then on the backends, the layer
policy, the timings and fp8 auto read only the spec, never the config. It holds plain values
(the standard library's types), so a plan, a checkpoint's derived values or a test can read it
and write it as they are. fp8 auto's decisions make a new spec (`decided`), never change one:
`decided` says how its backend and recipe came to be."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from ..config.schema import FP8_RECIPES, origin_of

# fp8_recipe / fp8_backend auto: each backend's recipes (the config's table, FP8_RECIPES, its
# default first) but those auto does not weigh: torchao's rowwise_with_gw_hp is rowwise with a
# high-precision weight-gradient GEMM, slower by design and chosen for accuracy, by name. The
# backends in the order fp8_backend auto tries them (on a tie too).
NOT_WEIGHED = ("rowwise_with_gw_hp",)
AUTO_RECIPES = {backend: tuple(r for r in recipes if r not in NOT_WEIGHED)
                for backend, recipes in FP8_RECIPES.items()}
BACKENDS = tuple(FP8_RECIPES)

# The spec's fields that are the config's fp8_<name> keys.
FP8_KEYS = ("backend", "recipe", "format", "margin", "amax_history_len", "amax_compute_algo",
            "fallback", "eval", "fsdp_all_gather", "layers", "auto_margin", "choice_budget_s",
            "min_layer_size", "exclude", "log_layers")


@dataclass(frozen=True)
class Fp8Spec:
    backend: str                  # te, torchao, native; or auto until a provisional one is set
    recipe: str                   # the backend's recipe; or auto
    format: str                   # the fp8_* keys by their names less "fp8_"
    margin: int
    amax_history_len: int
    amax_compute_algo: str
    fallback: str                 # what to do where the backend cannot run
    eval: bool                    # evaluate in FP8 too
    fsdp_all_gather: Optional[bool]
    layers: str                   # auto, all, min_size
    auto_margin: float
    choice_budget_s: float
    min_layer_size: int
    exclude: tuple
    log_layers: bool
    # How the run executes, which FP8's timings (and their cache) depend on.
    compile: bool
    compile_mode: str
    tf32: bool
    reprobe: bool                 # ignore cached timings
    cache_dir: Optional[str]      # where fp8_layers auto and fp8 auto cache their timings
    # The backend and recipe as the config asked for them (auto: fp8 auto chooses), and how
    # `backend` and `recipe` came to be: "config" (as asked), "provisional" (auto, before the
    # choice), "chosen" (timed and checked at start), "default" (auto, nothing timed or
    # nothing passed: the backend's default), "resumed" (the resumed or evaluated run's choice).
    asked: tuple
    decided: str = "config"
    # For error messages: where each key came from (Config.where).
    source: str = "the defaults"
    origins: dict = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, cfg, run_dir: Optional[str] = None) -> "Fp8Spec":
        """The spec of a config (its fp8 keys, and the execution keys the timings depend on);
        `run_dir`: where timings are cached when batch_cache_dir is unset (a sweep trial's own
        directory; default output_dir)."""
        keys = {name: getattr(cfg, f"fp8_{name}") for name in FP8_KEYS}
        keys["exclude"] = tuple(keys["exclude"])
        return cls(**keys, compile=cfg.compile, compile_mode=cfg.compile_mode, tf32=cfg.tf32,
                   reprobe=cfg.reprobe, cache_dir=cfg.cache_dir(run_dir),
                   asked=(cfg.fp8_backend, cfg.fp8_recipe),
                   source=cfg.source, origins=dict(cfg.origins))

    def where(self, *keys: str) -> str:
        """Where the values of `keys` (the config's flat keys) came from, for an error."""
        return origin_of(self.origins, self.source, keys)

    def decide(self, backend: str, recipe: str, how: str) -> "Fp8Spec":
        """This spec with `backend` and `recipe` in place of auto, decided `how`."""
        return dataclasses.replace(self, backend=backend, recipe=recipe, decided=how)

    def provisional(self, runs) -> "Fp8Spec":
        """What a run builds before fp8 auto chooses (the batch probe's, and a CPU run's): the
        first backend of BACKENDS that `runs(name)` here (native otherwise), with its default
        recipe. This spec when neither is auto (as the config names them, or decided already)."""
        if "auto" not in (self.backend, self.recipe):
            return self
        backend = self.backend
        if backend == "auto":
            backend = next((b for b in BACKENDS[:-1] if runs(b)), BACKENDS[-1])
        recipe = AUTO_RECIPES[backend][0] if self.recipe == "auto" else self.recipe
        return self.decide(backend, recipe, "provisional")

    def as_chosen(self, derived: dict) -> "Fp8Spec":
        """A finished run's spec with the backend and recipe fp8 auto chose (its config.yaml's
        derived values) in place of auto: what evaluating or sampling its checkpoint in FP8
        needs. This spec when nothing is auto or nothing was chosen."""
        if "auto" not in self.asked or not derived.get("fp8_backend") or \
                not derived.get("fp8_recipe"):
            return self
        return self.decide(derived["fp8_backend"], derived["fp8_recipe"], "resumed")

    def candidates(self) -> list:
        """fp8 auto's (backend, recipe) pairs, in the order they are tried."""
        backends = BACKENDS if self.asked[0] == "auto" else (self.asked[0],)
        return [(b, r) for b in backends for r in AUTO_RECIPES[b]]
