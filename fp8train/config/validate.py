"""The checks that involve more than one key, run once the config is read (each single key's
type and bounds are checked as its value is read: values.py). They look at the values alone;
what needs the filesystem (the dataset, batch_cache_dir, a resume path) is checked by
fp8train/train/preflight.py."""
from __future__ import annotations

from ..errors import BadInput
from .requires import origin_layer, set_with_or_after, unmet
from ..errors import did_you_mean
from .schema import FP8_RECIPES, HF_PREFIX, MODEL_PRESETS, Config

__all__ = ["origin_layer", "set_with_or_after", "validate"]


def validate(cfg: Config) -> None:
    """Checks that involve more than one key. Single-key types and bounds are checked when a
    value is read."""
    def err(msg, *keys):
        raise BadInput(f"{cfg.where(*keys)}: {msg}")

    _check_model(cfg, err)
    if cfg.num_epochs is None and cfg.max_steps is None:
        err("keys 'num_epochs' and 'max_steps' are both null; set one (max_hours alone gives "
            "the LR schedule no length)", "num_epochs", "max_steps")
    # A warmup not shorter than the schedule is shortened once the run's length is known
    # (batch/decide.py's run_length): a short run of a longer config means that. Only a length
    # set in the same place as the warmup, or before it, contradicts it.
    which = "lr_decay_steps" if cfg.lr_decay_steps else "max_steps" if cfg.max_steps else None
    if which and cfg.warmup_steps >= getattr(cfg, which) and \
            set_with_or_after(cfg, "warmup_steps", which):
        err(f"key 'warmup_steps' ({cfg.warmup_steps}) must be smaller than {which} "
            f"({getattr(cfg, which)}): the LR would never decay", "warmup_steps", which)
    if cfg.n_kv_head is not None and cfg.n_head is not None and cfg.n_head % cfg.n_kv_head:
        err(f"key 'n_kv_head' ({cfg.n_kv_head}) must divide n_head ({cfg.n_head})",
            "n_kv_head", "n_head")
    if cfg.n_embd is not None and cfg.n_head is not None and cfg.n_embd % cfg.n_head:
        err(f"key 'n_embd' ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})",
            "n_embd", "n_head")
    if cfg.use_fp8 and cfg.seq_len % 16:
        err(f"key 'seq_len' ({cfg.seq_len}) must be a multiple of 16 with use_fp8: FP8 GEMMs "
            "need the token dimension divisible by 16", "seq_len", "use_fp8")
    # Keys that apply only with others (config/requires.py's table).
    inert = unmet(cfg)
    if inert:
        err(inert[0], *inert[1])
    if cfg.use_fp8:
        _check_fp8_recipe(cfg, err)
        _check_fp8_until(cfg, err)
    if cfg.compile_scope == "blocks" and cfg.compile_mode in ("reduce-overhead", "max-autotune"):
        err(f"key 'compile_scope' is 'blocks' with compile_mode '{cfg.compile_mode}', whose CUDA "
            "graphs of separately compiled blocks overwrite each other's outputs (pytorch "
            "issue 152887); use compile_scope: auto or model with this mode, or "
            "compile_mode: default or max-autotune-no-cudagraphs per block", "compile_scope",
            "compile_mode")


def _check_model(cfg: Config, err) -> None:
    if cfg.model.startswith(HF_PREFIX):
        if not cfg.model[len(HF_PREFIX):].strip():
            err("key 'model' is 'hf:' with nothing after it: name a hub id (hf:Qwen/Qwen3-0.6B) "
                "or a local directory holding config.json (hf:/models/my-llama)", "model")
    elif cfg.model not in MODEL_PRESETS:
        close = did_you_mean(cfg.model, MODEL_PRESETS)
        err(f"key 'model': unknown model '{cfg.model}'"
            + (f" (did you mean '{close}'?)" if close else "")
            + f"; a preset ({', '.join(MODEL_PRESETS)}) or hf:<hub id or directory>", "model")
    if cfg.tokenizer == "model" and not cfg.model.startswith(HF_PREFIX):
        err(f"key 'tokenizer' is 'model', which needs an hf: model to take the tokenizer from "
            f"(model is '{cfg.model}')", "tokenizer", "model")


def _check_fp8_recipe(cfg: Config, err) -> None:
    backend, recipe = cfg.fp8_backend, cfg.fp8_recipe
    if recipe == "auto" or backend == "auto":  # a named recipe under auto: requires.py
        return
    accepted = FP8_RECIPES[backend]
    if recipe not in accepted:
        legacy = " (a config.yaml written by an older fp8train recorded torchao's default " \
            "here, where it meant delayed scaling: remove the line)" \
            if recipe == "tensorwise" else ""
        err(f"key 'fp8_recipe' is '{recipe}', which fp8_backend '{backend}' does not have; "
            f"{backend} accepts {' | '.join(accepted)}{legacy}", "fp8_recipe", "fp8_backend")


def _check_fp8_until(cfg: Config, err) -> None:
    """fp8_until: a fraction of the schedule below 1, or a step from 2 on, before the run's
    last step when that is known from the config (batch/decide.py checks a length set by
    num_epochs once the data is read)."""
    until = cfg.fp8_until
    if until is None:
        return
    if until == 1 and origin_layer(cfg, "fp8_until") == 0:
        return   # a run's own config.yaml, written when 1 meant step 1: kept (batch/decide.py)
    if until == 1:
        err("key 'fp8_until' is 1, which would read as step 1: FP8 for one step, then the "
            "base precision for the whole run; for FP8 to the end remove fp8_until, for a "
            "cool-down write a fraction of the schedule below 1 (0.8: the last 20% in the "
            "base precision) or the step of the hand-over (2 or more)", "fp8_until")
    if until > 1 and until != int(until):
        err(f"key 'fp8_until' ({until:g}) is a step from 1 on, so a whole number (or "
            "a fraction of the schedule below 1)", "fp8_until")
    if cfg.max_steps is None:
        return
    if until > 1:
        step, length = int(until), "max_steps"
    elif cfg.lr_decay_steps:
        step, length = max(1, round(until * cfg.lr_decay_steps)), "lr_decay_steps"
    else:
        return
    if step >= cfg.max_steps and set_with_or_after(cfg, "fp8_until", "max_steps", length):
        where = "" if length == "max_steps" else \
            f" ({until:g} of lr_decay_steps {cfg.lr_decay_steps:,})"
        err(f"key 'fp8_until' ({until:g}) hands FP8 over at step {step:,}{where}, but the "
            f"run ends at step {cfg.max_steps:,} (max_steps), so FP8 would run to the end; "
            f"remove fp8_until, or give a step below {cfg.max_steps:,} or a fraction below 1",
            "fp8_until", "max_steps", length)
