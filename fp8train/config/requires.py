"""Which keys apply only with which others: the one table of such rules (`RULES`), and the check
that walks it (`unmet`).

A key that applies only with another's value (`fp8_check_interval` with `use_fp8: true`,
`muon_lr` with `optimizer: muon`) and is given a value of its own while that other key says
otherwise would be silently inert: the run is refused instead, in one line naming both keys
and where they were set. Unless the other key was set *later*: a config file's FP8 keys under
`--no_fp8` on the command line, or a sweep's `--optimizer=adamw` over a Muon config, are a
deliberate switch, not a contradiction. Two options of one command line are set in the same
place: a sweep's parameters check their combinations when the sweep is read
(sweep/spec.py), so that no trial is refused once the sweep runs. A run's own config.yaml (fed back with `--config`)
counts as defaults here: its values were resolved by the run that accepted them.

A key is "given a value of its own" when its value is not its default (`in_effect`). Whole
families are covered by their prefix, so that a new key joins its family's rule by its name
alone: every `fp8_*` key needs `use_fp8: true`, every `muon_*` key `optimizer: muon`, every
`wandb_*` key `use_wandb: true`, every `hellaswag_*` key a `hellaswag_interval`. The reference
page (docs/config.md) prints each key's rules, and a test walks the table: each key of each rule
refused under the rule's `off` values, accepted under its `on` values or when `off` comes later.

Standard library only (the schema), like the rest of the config package.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

from .schema import DELAYED_SCALING_KEYS, FP8_RECIPES, HF_PREFIX, KEYS, Config, default_of


def origin_layer(cfg: Config, key: str) -> int:
    """How late the key's value was set: 0 default (or a run's own config.yaml), 1 config
    file, 2 command line."""
    origin = cfg.origins.get(key)
    if origin is None:
        return 0
    if origin.startswith("--"):
        return 2
    return 0 if cfg.from_run else 1


def set_with_or_after(cfg: Config, key: str, *others: str) -> bool:
    """Whether `key` was set by the user (not a default) in the same place as `others`, or
    later: then a contradiction between them is the user's, not a deliberate override."""
    layer = origin_layer(cfg, key)
    return layer > 0 and all(layer >= origin_layer(cfg, o) for o in others)


# A preset's shape keys: an hf: model's shape, vocabulary and dropout are its config.json's.
PRESET_KEYS = ("n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden_size", "dropout",
               "pad_vocab_multiple")


def family(prefix: str, *but: str) -> tuple:
    """Every key whose name starts with `prefix` (but `but`), in schema order."""
    return tuple(k for k in KEYS if k.startswith(prefix) and k not in but)


@dataclass(frozen=True)
class Rule:
    """`keys` apply only when `holds(cfg)`, which reads the keys `on`. `said`: what they apply
    with, in words ("use_fp8: true"). `off` / `when`: values of the `on` keys under which the
    rule does not / does hold (for the test that walks the table)."""
    keys: tuple
    on: tuple
    holds: Callable[[Config], bool]
    said: str
    off: dict
    when: dict
    in_effect: dict = field(default_factory=dict)   # key -> cfg -> bool, where not "not default"
    switched_by: tuple = ()   # keys that change what `holds` reads (a backend, its recipe's
                              # default): set later than the key, a switch too


def _default_recipe(cfg: Config) -> str:
    return FP8_RECIPES.get(cfg.fp8_backend, ("auto",))[0]


RULES = (
    Rule(family("fp8_"), ("use_fp8",), lambda c: c.use_fp8, "use_fp8: true",
         off={"use_fp8": False}, when={"use_fp8": True},
         in_effect={"fp8_recipe": lambda c: c.fp8_recipe != _default_recipe(c),
                    "fp8_fsdp_all_gather": lambda c: bool(c.fp8_fsdp_all_gather)}),
    Rule(("fp8_recipe",), ("fp8_backend",),
         lambda c: c.fp8_backend != "auto", "a named fp8_backend (auto chooses the recipe too)",
         off={"fp8_backend": "auto"}, when={"fp8_backend": "native"},
         in_effect={"fp8_recipe": lambda c: c.fp8_recipe != _default_recipe(c)}),
    # The recipe's default follows the backend (torchao's is tensorwise): a backend switched
    # later switches the recipe with it.
    Rule(DELAYED_SCALING_KEYS, ("fp8_recipe",),
         lambda c: c.fp8_recipe in ("delayed", "auto"),
         "delayed scaling (fp8_recipe: delayed, or auto, which times it)",
         off={"fp8_recipe": "current"}, when={"fp8_recipe": "delayed"},
         switched_by=("fp8_backend",)),
    Rule(("fp8_fsdp_all_gather",), ("fp8_backend", "fp8_recipe"),
         lambda c: (c.fp8_backend, c.fp8_recipe) == ("torchao", "tensorwise"),
         "fp8_backend: torchao and fp8_recipe: tensorwise",
         off={"fp8_backend": "native"}, when={"fp8_backend": "torchao"},
         in_effect={"fp8_fsdp_all_gather": lambda c: bool(c.fp8_fsdp_all_gather)}),
    Rule(("fp8_auto_margin",), ("fp8_layers",), lambda c: c.fp8_layers == "auto",
         "fp8_layers: auto", off={"fp8_layers": "all"}, when={"fp8_layers": "auto"}),
    Rule(("fp8_min_layer_size",), ("fp8_layers",), lambda c: c.fp8_layers == "min_size",
         "fp8_layers: min_size", off={"fp8_layers": "all"}, when={"fp8_layers": "min_size"}),
    Rule(("fp8_max_loss_gap", "fp8_gap_window", "fp8_gap_action"), ("fp8_check_interval",),
         lambda c: c.fp8_check_interval > 0, "fp8_check_interval above 0 (the loss-gap checks)",
         off={"fp8_check_interval": 0}, when={"fp8_check_interval": 10}),
    Rule(family("muon_"), ("optimizer",), lambda c: c.optimizer == "muon", "optimizer: muon",
         off={"optimizer": "adamw"}, when={"optimizer": "muon"}),
    Rule(("lr_decay_fraction", "lr_decay_shape"), ("lr_schedule",),
         lambda c: c.lr_schedule == "wsd", "lr_schedule: wsd",
         off={"lr_schedule": "cosine"}, when={"lr_schedule": "wsd"}),
    Rule(("lr_reference_batch_size",), ("lr_scaling",), lambda c: c.lr_scaling != "none",
         "lr_scaling: sqrt or linear", off={"lr_scaling": "none"}, when={"lr_scaling": "sqrt"}),
    Rule(("lr_scaling",), ("lr_reference_batch_size",),
         lambda c: c.lr_reference_batch_size is not None, "lr_reference_batch_size set",
         off={"lr_reference_batch_size": None}, when={"lr_reference_batch_size": 64}),
    Rule(("penalty_weight",), ("penalty_type",), lambda c: c.penalty_type != "none",
         "penalty_type: z_loss or logit_l2", off={"penalty_type": "none"},
         when={"penalty_type": "z_loss"}),
    Rule(("compile_mode", "compile_scope"), ("compile",), lambda c: c.compile, "compile: true",
         off={"compile": False}, when={"compile": True}),
    Rule(("auto_batch_size",), ("target_effective_batch_size",),
         lambda c: c.target_effective_batch_size is not None, "target_effective_batch_size set",
         off={"target_effective_batch_size": None}, when={"target_effective_batch_size": 64}),
    Rule(("max_batch_size", "memory_headroom", "probe_memory_limit_gb", "batch_timing_budget_s",
          "batch_speed_tolerance"), ("auto_batch_size",), lambda c: c.auto_batch_size,
         "auto_batch_size: true", off={"auto_batch_size": False},
         when={"auto_batch_size": True, "target_effective_batch_size": 64}),
    Rule(("gradient_accumulation_steps",), ("auto_batch_size",), lambda c: not c.auto_batch_size,
         "auto_batch_size: false (with auto_batch_size it is derived)",
         off={"auto_batch_size": True, "target_effective_batch_size": 64},
         when={"auto_batch_size": False}),
    Rule(("stop_at_target",), ("target_val_loss",), lambda c: c.target_val_loss is not None,
         "target_val_loss set", off={"target_val_loss": None}, when={"target_val_loss": 1.5}),
    Rule(("sample_tokens",), ("eval_samples",), lambda c: c.eval_samples > 0,
         "eval_samples above 0", off={"eval_samples": 0}, when={"eval_samples": 2}),
    Rule(family("hellaswag_", "hellaswag_interval"), ("hellaswag_interval",),
         lambda c: c.hellaswag_interval > 0,
         "hellaswag_interval above 0 (scripts/evaluate.py takes --hellaswag PATH instead)",
         off={"hellaswag_interval": 0}, when={"hellaswag_interval": 100}),
    Rule(PRESET_KEYS, ("model",), lambda c: not c.model.startswith(HF_PREFIX),
         "a preset model (an hf: model's shape, vocabulary and dropout are its config.json's)",
         off={"model": "hf:some/model"}, when={"model": "tiny"}),
    Rule(("init_from",), ("model",), lambda c: c.model.startswith(HF_PREFIX),
         "an hf: model (a preset always starts from fresh weights; to continue a run, resume "
         "it)", off={"model": "tiny"}, when={"model": "hf:some/model"}),
    Rule(family("wandb_"), ("use_wandb",), lambda c: c.use_wandb, "use_wandb: true",
         off={"use_wandb": False}, when={"use_wandb": True}),
)


def in_effect(cfg: Config, rule: Rule, key: str) -> bool:
    """Whether `key` has a value of its own under `rule`: not its default, unless the rule
    says otherwise."""
    test = rule.in_effect.get(key)
    if test is not None:
        return test(cfg)
    return getattr(cfg, key) != default_of(KEYS[key])


def inert_keys(values: dict) -> set:
    """The keys whose rules do not hold for `values` (a config as a {key: value} mapping, e.g.
    a saved config.yaml; missing keys at their defaults): whatever their values, they change
    nothing in that run."""
    known = {k: default_of(f) for k, f in KEYS.items()}
    known.update((k, v) for k, v in values.items() if k in KEYS)
    cfg = SimpleNamespace(**known)
    return {k for rule in RULES if not rule.holds(cfg) for k in rule.keys}


def rules_of(key: str) -> list:
    return [r for r in RULES if key in r.keys]


def show(value) -> str:
    """A value as YAML writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def unmet(cfg: Config) -> "tuple[str, tuple] | None":
    """The first key of the table whose value is inert (its rule does not hold, and was not
    switched off later than the key was set): (the one-line message, the keys it names)."""
    for rule in RULES:
        if rule.holds(cfg):
            continue
        for key in rule.keys:
            if in_effect(cfg, rule, key) and set_with_or_after(cfg, key, *rule.on) and \
                    set_with_or_after(cfg, key, *rule.switched_by):
                state = ", ".join(f"{o} is {show(getattr(cfg, o))}" for o in rule.on)
                return (f"key '{key}' ({show(getattr(cfg, key))}) applies only with "
                        f"{rule.said}, but {state}, so it would do nothing; remove it or "
                        f"change {' and '.join(rule.on)}", (key, *rule.on))
    return None
