"""The checks that involve more than one key, run once the config is read (each single key's
type and bounds are checked as its value is read: values.py). They look at the values alone;
what needs the filesystem (the dataset, batch_cache_dir, a resume path) is checked by
fp8train/train/preflight.py."""
from __future__ import annotations

from ..errors import BadInput
from .schema import DELAYED_SCALING_KEYS, FP8_RECIPES, Config


def origin_layer(cfg: Config, key: str) -> int:
    """How late the key's value was set: 0 default, 1 config file, 2 command line."""
    origin = cfg.origins.get(key)
    return 0 if origin is None else 2 if origin.startswith("--") else 1


def validate(cfg: Config) -> None:
    """Checks that involve more than one key. Single-key types and bounds are checked when a
    value is read."""
    def err(msg, *keys):
        raise BadInput(f"{cfg.where(*keys)}: {msg}")

    if cfg.num_epochs is None and cfg.max_steps is None:
        err("keys 'num_epochs' and 'max_steps' are both null; set one (max_hours alone gives "
            "the LR schedule no length)", "num_epochs", "max_steps")
    # A warmup not shorter than the schedule is shortened once the run's length is known
    # (batch/decide.py's run_length): a short run of a longer config means that. Only a length
    # set in the same place as the warmup, or before it, contradicts it.
    which = "lr_decay_steps" if cfg.lr_decay_steps else "max_steps" if cfg.max_steps else None
    if which and cfg.warmup_steps >= getattr(cfg, which) and \
            origin_layer(cfg, "warmup_steps") >= origin_layer(cfg, which):
        err(f"key 'warmup_steps' ({cfg.warmup_steps}) must be smaller than {which} "
            f"({getattr(cfg, which)}): the LR would never decay", "warmup_steps", which)
    if cfg.penalty_weight > 0 and cfg.penalty_type == "none":
        err(f"key 'penalty_weight' is {cfg.penalty_weight} but penalty_type is 'none'; "
            f"choose z_loss or logit_l2", "penalty_weight", "penalty_type")
    if cfg.auto_batch_size and cfg.target_effective_batch_size is None:
        err("key 'auto_batch_size' needs target_effective_batch_size", "auto_batch_size")
    if cfg.auto_batch_size and cfg.gradient_accumulation_steps is not None:
        err("key 'gradient_accumulation_steps' is derived when auto_batch_size is true; remove "
            "it (or set auto_batch_size: false)", "gradient_accumulation_steps",
            "auto_batch_size")
    if cfg.lr_scaling != "none" and cfg.lr_reference_batch_size is None:
        err(f"key 'lr_scaling' is '{cfg.lr_scaling}' but lr_reference_batch_size is not set",
            "lr_scaling")
    if cfg.n_kv_head is not None and cfg.n_head is not None and cfg.n_head % cfg.n_kv_head:
        err(f"key 'n_kv_head' ({cfg.n_kv_head}) must divide n_head ({cfg.n_head})",
            "n_kv_head", "n_head")
    if cfg.n_embd is not None and cfg.n_head is not None and cfg.n_embd % cfg.n_head:
        err(f"key 'n_embd' ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})",
            "n_embd", "n_head")
    if cfg.use_fp8 and cfg.seq_len % 16:
        err(f"key 'seq_len' ({cfg.seq_len}) must be a multiple of 16 with use_fp8: FP8 GEMMs "
            "need the token dimension divisible by 16", "seq_len", "use_fp8")
    if cfg.use_fp8:
        _check_fp8_recipe(cfg, err)
    if cfg.fp8_until is not None and cfg.fp8_until >= 1 and cfg.fp8_until != int(cfg.fp8_until):
        err(f"key 'fp8_until' ({cfg.fp8_until:g}) is a step from 1 on, so a whole number (or "
            "a fraction of the schedule below 1)", "fp8_until")
    if cfg.compile_scope == "blocks" and cfg.compile_mode in ("reduce-overhead", "max-autotune"):
        err(f"key 'compile_scope' is 'blocks' with compile_mode '{cfg.compile_mode}', whose CUDA "
            "graphs of separately compiled blocks overwrite each other's outputs (pytorch "
            "issue 152887); use compile_scope: auto or model with this mode, or "
            "compile_mode: default or max-autotune-no-cudagraphs per block", "compile_scope",
            "compile_mode")
    if cfg.fp8_min_layer_size and cfg.fp8_layers != "min_size":
        err(f"key 'fp8_min_layer_size' ({cfg.fp8_min_layer_size}) applies only with fp8_layers: "
            f"min_size, but fp8_layers is '{cfg.fp8_layers}'; set fp8_layers: min_size or "
            "remove fp8_min_layer_size", "fp8_min_layer_size", "fp8_layers")


def _check_fp8_recipe(cfg: Config, err) -> None:
    backend, recipe = cfg.fp8_backend, cfg.fp8_recipe
    if backend == "auto" and recipe != "auto":
        err(f"key 'fp8_recipe' is '{recipe}', but fp8_backend is 'auto', which chooses the "
            "recipe too; remove fp8_recipe (or name the backend)", "fp8_recipe", "fp8_backend")
    if cfg.fp8_fsdp_all_gather and recipe == "auto":
        err("key 'fp8_fsdp_all_gather' needs fp8_backend torchao with fp8_recipe tensorwise, "
            "named (not auto); remove it", "fp8_fsdp_all_gather", "fp8_recipe")
    if recipe == "auto":   # the delayed-scaling keys apply to the delayed recipes it times
        return
    accepted = FP8_RECIPES[backend]
    if recipe not in accepted:
        legacy = " (a config.yaml written by an older fp8train recorded torchao's default " \
            "here, where it meant delayed scaling: remove the line)" \
            if recipe == "tensorwise" else ""
        err(f"key 'fp8_recipe' is '{recipe}', which fp8_backend '{backend}' does not have; "
            f"{backend} accepts {' | '.join(accepted)}{legacy}", "fp8_recipe", "fp8_backend")
    if recipe in ("current", "block"):
        for key in DELAYED_SCALING_KEYS:
            if key in cfg.origins:
                err(f"key '{key}' applies to delayed scaling only, but fp8_recipe is '{recipe}' "
                    "(each tensor scaled from its own amax at every step: no margin, no "
                    "history); remove it", key, "fp8_recipe")
    if cfg.fp8_fsdp_all_gather and (backend, recipe) != ("torchao", "tensorwise"):
        err(f"key 'fp8_fsdp_all_gather' needs fp8_backend torchao with fp8_recipe tensorwise "
            f"(here {backend} / {recipe}); remove it", "fp8_fsdp_all_gather", "fp8_backend",
            "fp8_recipe")
