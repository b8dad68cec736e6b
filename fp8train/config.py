"""The run config: one typed schema, read from YAML, overridden from the command line,
validated once at start.

Only the standard library and PyYAML are imported here, so `--help` and every config error
come back instantly, before torch is loaded.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import yaml

from .errors import ConfigError  # noqa: F401  (raised here, imported from here by many)
from .redaction import redact


# The groups in the order `--help` and the written config.yaml show them.
GROUPS = ("run", "data", "model", "batch", "optimizer", "duration", "loss", "precision",
          "fp8", "logging", "reliability", "wandb")

MODEL_PRESETS = ("gpt2-124m", "gpt2-350m", "llama-350m", "llama-1b", "tiny", "tiny-llama")
KNOWN_DATASETS = ("tinyshakespeare", "fineweb-edu", "openwebtext", "synthetic")


def _key(default, doc, group, *, choices=None, min=None, max=None, gt=None, resume="locked"):
    """A config key: its default, one-line doc, group, the bounds validation checks, and
    whether a resumed run may change it: "free" (how the run is carried out, not what it
    trains) or "locked" (it changes training: refused unless allow_config_change)."""
    assert resume in ("free", "locked")
    meta = dict(doc=doc, group=group, choices=choices, min=min, max=max, gt=gt, resume=resume)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Config:
    # --- run -------------------------------------------------------------------------------
    output_dir: Optional[str] = _key(
        None, "run directory (config.yaml, metrics.jsonl, train.log, checkpoints/); "
        "default runs/<config file name>", "run", resume="free")
    resume: str = _key(
        "never", "never | auto (latest complete checkpoint in output_dir) | a checkpoint path; "
        "a bare --resume means auto", "run", resume="free")
    plan_only: bool = _key(False, "print the batch plan (probing if needed) and exit; also "
                           "--plan-only / --dry_run", "run", resume="free")
    seed: int = _key(1337, "seed for init, data order and dropout", "run", min=0,
                     max=2**31 - 1)
    # --- data ------------------------------------------------------------------------------
    dataset: str = _key(
        "tinyshakespeare", "tinyshakespeare | fineweb-edu | openwebtext (prepared under data_dir) "
        "| a prepared directory | a .txt file | synthetic (benchmarks: no files, GPT-2 vocab)",
        "data")
    data_dir: Optional[str] = _key(
        None, "where datasets are looked up; default $FP8TRAIN_DATA_DIR, else ./data", "data", resume="free")
    tokenizer: str = _key(
        "byte", "byte (no files needed) | a HF tokenizer name or local directory (AutoTokenizer)",
        "data")
    seq_len: int = _key(1024, "tokens per training sequence (the model's context length)",
                        "data", min=8)
    data_prefetch: int = _key(2, "micro-batches prepared ahead on a background thread (0 = in "
                              "the loop)", "data", min=0, resume="free")
    val_fraction: float = _key(
        0.1, "fraction of a text corpus held out for validation (the end; prepared data has "
        "its own split)", "data", gt=0.0, max=0.5)
    # --- model -----------------------------------------------------------------------------
    model: str = _key("gpt2-124m", "preset: " + " | ".join(MODEL_PRESETS), "model",
                      choices=MODEL_PRESETS)
    n_layer: Optional[int] = _key(None, "override the preset's number of layers", "model", min=1)
    n_head: Optional[int] = _key(None, "override the preset's attention heads", "model", min=1)
    n_kv_head: Optional[int] = _key(None, "override key/value heads (grouped-query attention)",
                                    "model", min=1)
    n_embd: Optional[int] = _key(None, "override the preset's model width", "model", min=8)
    ffn_hidden_size: Optional[int] = _key(None, "override the MLP hidden size", "model", min=8)
    dropout: float = _key(0.0, "dropout probability (0 for pretraining)", "model", min=0.0,
                          max=0.99)
    pad_vocab_multiple: int = _key(128, "pad the vocabulary to a multiple of this (fast GEMMs)",
                                   "model", min=1)
    activation_checkpointing: bool = _key(
        False, "recompute each block's activations in backward (less memory, ~30% more compute); "
        "auto_batch_size turns it on when micro-batch 1 does not fit without it", "model", resume="free")
    compile: bool = _key(False, "torch.compile the model", "model", resume="free")
    compile_mode: str = _key(
        "default", "torch.compile mode: default | reduce-overhead (CUDA graphs: less launch "
        "overhead for small models) | max-autotune | max-autotune-no-cudagraphs", "model",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"), resume="free")
    # --- batch -----------------------------------------------------------------------------
    batch_size: int = _key(8, "micro-batch per device, in sequences", "batch", min=1, resume="free")
    gradient_accumulation_steps: Optional[int] = _key(
        None, "micro-batches per optimizer step; default derived from "
        "target_effective_batch_size, else 1", "batch", min=1, resume="free")
    target_effective_batch_size: Optional[int] = _key(
        None, "sequences per optimizer step = micro x accumulation x world size", "batch", min=1, resume="free")
    auto_batch_size: bool = _key(False, "discover the largest micro-batch that fits at start",
                                 "batch", resume="free")
    max_batch_size: int = _key(128, "ceiling for the discovered micro-batch", "batch", min=1, resume="free")
    memory_headroom: float = _key(
        0.1, "fraction of device memory the discovered micro-batch leaves free (fragmentation "
        "on long runs)", "batch", min=0.0, max=0.9, resume="free")
    probe_memory_limit_gb: Optional[float] = _key(
        None, "memory budget per device for batch discovery; default the GPU's memory (CPU: "
        "available RAM)", "batch", gt=0.0, resume="free")
    batch_cache_dir: Optional[str] = _key(
        None, "where discovered micro-batches are cached (batch_probe.json); default output_dir",
        "batch", resume="free")
    reprobe: bool = _key(False, "ignore the cached micro-batch (and fp8_layers auto timings) "
                         "and measure again", "batch", resume="free")
    # --- optimizer -------------------------------------------------------------------------
    learning_rate: float = _key(6e-4, "peak learning rate (after warmup)", "optimizer", gt=0.0)
    min_lr_ratio: float = _key(0.1, "final LR as a fraction of learning_rate (cosine decay)",
                               "optimizer", min=0.0, max=1.0)
    warmup_steps: int = _key(2000, "linear warmup steps", "optimizer", min=0)
    lr_decay_steps: Optional[int] = _key(
        None, "length of the LR schedule in optimizer steps; default the run's total steps",
        "optimizer", min=1)
    weight_decay: float = _key(0.1, "AdamW weight decay (matrices and embeddings only)",
                               "optimizer", min=0.0)
    beta1: float = _key(0.9, "AdamW beta1", "optimizer", min=0.0, max=0.9999)
    beta2: float = _key(0.95, "AdamW beta2", "optimizer", min=0.0, max=0.99999)
    adam_eps: float = _key(1e-8, "AdamW epsilon", "optimizer", gt=0.0)
    lr_scaling: str = _key(
        "none", "scale learning_rate with the effective batch: none | sqrt | linear "
        "(x (effective / lr_reference_batch_size)^0.5 or ^1)", "optimizer",
        choices=("none", "sqrt", "linear"))
    lr_reference_batch_size: Optional[int] = _key(
        None, "the effective batch (sequences) learning_rate was tuned for", "optimizer", min=1)
    grad_clip: float = _key(1.0, "clip the global gradient norm to this (0 = off)",
                            "optimizer", min=0.0)
    # --- duration --------------------------------------------------------------------------
    num_epochs: Optional[float] = _key(
        1.0, "passes over the training tokens (fractions allowed)", "duration", gt=0.0, resume="free")
    max_steps: Optional[int] = _key(None, "stop after this many optimizer steps", "duration",
                                    min=1, resume="free")
    max_hours: Optional[float] = _key(
        None, "stop (with a checkpoint) after this much wall-clock time in this invocation",
        "duration", gt=0.0, resume="free")
    target_val_loss: Optional[float] = _key(
        None, "the val/loss to reach: when an evaluation reaches it, val/time_to_target_s and "
        "val/tokens_to_target are logged and a checkpoint saved", "duration", gt=0.0, resume="free")
    stop_at_target: bool = _key(True, "stop (exit 0) once target_val_loss is reached; false "
                                "trains on to the end", "duration", resume="free")
    # --- loss ------------------------------------------------------------------------------
    penalty_type: str = _key(
        "none", "none | z_loss (mean logsumexp(logits)^2, PaLM) | logit_l2 (mean logits^2)",
        "loss", choices=("none", "z_loss", "logit_l2"))
    penalty_weight: float = _key(0.0, "weight of the penalty term added to cross-entropy",
                                 "loss", min=0.0)
    # --- precision -------------------------------------------------------------------------
    precision: str = _key(
        "auto", "auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32 | fp16", "precision",
        choices=("auto", "bf16", "fp32", "fp16"))
    tf32: bool = _key(True, "allow TF32 matmuls on GPU for the fp32 parts", "precision", resume="free")
    # --- fp8 -------------------------------------------------------------------------------
    use_fp8: bool = _key(False, "train the large Linears in FP8 (H100/H200)", "fp8")
    fp8_backend: str = _key("te", "te | torchao | native", "fp8",
                            choices=("te", "torchao", "native"))
    fp8_format: str = _key("hybrid", "hybrid (E4M3 forward, E5M2 gradients) | e4m3", "fp8",
                           choices=("hybrid", "e4m3"))
    fp8_margin: int = _key(0, "scale = fp8_max / amax / 2^margin", "fp8", min=0, max=16)
    fp8_amax_history_len: int = _key(1024, "delayed-scaling amax history window", "fp8", min=1)
    fp8_amax_compute_algo: str = _key("max", "max | most_recent", "fp8",
                                      choices=("max", "most_recent"))
    fp8_fallback: str = _key("bf16", "when FP8 cannot run: bf16 (warn) | error (exit 2)", "fp8",
                             choices=("bf16", "error"), resume="free")
    fp8_eval: bool = _key(False, "evaluate in FP8 too (default: bf16)", "fp8", resume="free")
    fp8_recipe: str = _key(
        "tensorwise", "torchao scaling recipe: tensorwise | rowwise | rowwise_with_gw_hp", "fp8",
        choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"))
    fp8_layers: str = _key(
        "auto", "which eligible Linears (dims divisible by 16, not in fp8_exclude) go to FP8: "
        "auto (each shape timed on the GPU, FP8 where faster; all on CPU) | all | min_size "
        "(fp8_min_layer_size)", "fp8", choices=("auto", "all", "min_size"))
    fp8_auto_margin: float = _key(
        0.05, "fp8_layers auto: convert a shape only when FP8 is at least this much faster "
        "(0.05: speed-up >= 1.05x)", "fp8", min=0.0)
    fp8_min_layer_size: int = _key(
        0, "fp8_layers min_size: convert only Linears with at least this many weights "
        "(in x out)", "fp8", min=0)
    fp8_exclude: list = _key(["lm_head"], "Linears kept out of FP8 (name patterns, * wildcard)",
                             "fp8")
    fp8_log_layers: bool = _key(True, "log fp8/<layer>/... scales per layer (aggregates always)",
                                "fp8", resume="free")
    # --- logging ---------------------------------------------------------------------------
    log_interval: int = _key(10, "optimizer steps between log lines / metrics.jsonl rows",
                             "logging", min=1, resume="free")
    eval_interval: Optional[int] = _key(
        None, "optimizer steps between evaluations; default 1000, or 500 when target_val_loss is "
        "set (a target is noticed sooner)", "logging", min=1, resume="free")
    eval_sequences: int = _key(256, "validation sequences per evaluation (a fixed set)",
                               "logging", min=1, resume="free")
    checkpoint_interval: int = _key(1000, "optimizer steps between checkpoints (also at the end)",
                                    "logging", min=1, resume="free")
    keep_checkpoints: int = _key(3, "checkpoints kept on disk, newest first (0 = keep all)",
                                 "logging", min=0, resume="free")
    eval_samples: int = _key(2, "text samples generated at each evaluation (samples.jsonl, "
                             "W&B table; 0 = off)", "logging", min=0, max=16, resume="free")
    sample_tokens: int = _key(64, "tokens generated per sample", "logging", min=1, max=1024, resume="free")
    # --- reliability -----------------------------------------------------------------------
    allow_config_change: bool = _key(
        False, "resume even though keys that change training (model, data, optimizer, ...) "
        "differ from the checkpoint's", "reliability", resume="free")
    checkpoint_required: bool = _key(
        False, "stop (exit 1) when a checkpoint cannot be written, instead of warning and "
        "training on", "reliability", resume="free")
    max_bad_steps: int = _key(
        10, "consecutive non-finite steps (each skipped) before the last checkpoint is restored "
        "(0 = skip only, never restore)", "reliability", min=0, resume="free")
    fp8_recovery: str = _key(
        "margin", "remedy applied with that restore in an FP8 run: margin (fp8_margin + 1; "
        "torchao, which has none, goes to bf16) | bf16 (FP8 off)", "reliability",
        choices=("margin", "bf16"), resume="free")
    loss_spike_factor: float = _key(
        3.0, "log a loss spike when a step's loss exceeds this many times the running mean "
        "(0 = off)", "reliability", min=0.0, resume="free")
    # --- wandb -----------------------------------------------------------------------------
    use_wandb: bool = _key(False, "log to Weights & Biases", "wandb", resume="free")
    wandb_project: str = _key("fp8train", "W&B project", "wandb", resume="free")
    wandb_entity: Optional[str] = _key(None, "W&B entity (team or user)", "wandb", resume="free")
    wandb_run_name: Optional[str] = _key(None, "W&B run name (default: output_dir's name)",
                                         "wandb", resume="free")
    wandb_tags: list = _key([], "W&B tags", "wandb", resume="free")
    # WANDB_MODE=offline|disabled and WANDB_API_KEY are read by W&B itself, as usual.

    # Where the values came from, for error messages; not a key.
    source: str = field(default="<defaults>", repr=False, compare=False,
                        metadata=dict(internal=True))

    def __post_init__(self):
        if self.eval_interval is None:   # a target is noticed sooner with more evaluations
            self.eval_interval = 500 if self.target_val_loss is not None else 1000


# Keys a later part of the pipeline writes into config.yaml; accepted (and ignored) on load so
# that a run's config.yaml can be fed back with --config.
DERIVED_SECTION = "derived"


def key_fields():
    return [f for f in fields(Config) if not f.metadata.get("internal")]


KEYS = {f.name: f for f in key_fields()}
# Keys a resumed run may change (metadata on each key: `resume="free"`); the others change what
# is trained and are compared with the checkpoint's.
RESUME_FREE = frozenset(name for name, f in KEYS.items() if f.metadata["resume"] == "free")


def _type_name(f) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return t


def _base_type(f) -> str:
    t = _type_name(f)
    m = re.match(r"Optional\[(\w+)\]", t)
    return m.group(1) if m else t


def _is_optional(f) -> bool:
    return _type_name(f).startswith("Optional[")


def _describe(f) -> str:
    base = {"int": "an integer", "float": "a number", "bool": "true or false",
            "str": "a string", "list": "a list of strings"}[_base_type(f)]
    m = f.metadata
    if m.get("choices"):
        base = "one of " + ", ".join(m["choices"])
    bounds = []
    if m.get("gt") is not None:
        bounds.append(f"> {m['gt']}")
    if m.get("min") is not None:
        bounds.append(f">= {m['min']}")
    if m.get("max") is not None:
        bounds.append(f"<= {m['max']}")
    if bounds:
        base += " " + " and ".join(bounds)
    if _is_optional(f):
        base += " (or null)"
    return base


_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def coerce(f, value: Any, source: str) -> Any:
    """Check one value against its key's type and bounds; return it in canonical form."""
    name, base = f.name, _base_type(f)

    def bad(why=None):
        got = repr(value) if not isinstance(value, str) else f"'{value}'"
        raise ConfigError(f"{source}: key '{name}' must be {_describe(f)}, got {got}"
                          + (f" ({why})" if why else ""))

    if value is None:
        if _is_optional(f):
            return None
        bad()
    if base == "bool":
        if not isinstance(value, bool):
            bad()
    elif base == "int":
        if isinstance(value, bool):
            bad()
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            bad()
    elif base == "float":
        # PyYAML reads 3e-3 (no dot) as a string; accept any plain float literal.
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            bad()
        value = float(value)
        if not math.isfinite(value):
            bad()
    elif base == "str":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value:
            bad()
    elif base == "list":
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            bad()
        value = [str(v) for v in value]
    m = f.metadata
    if m.get("choices") and value not in m["choices"]:
        bad()
    if base in ("int", "float"):
        if m.get("gt") is not None and not value > m["gt"]:
            bad()
        if m.get("min") is not None and value < m["min"]:
            bad()
        if m.get("max") is not None and value > m["max"]:
            bad()
    return value


def _unknown_key(key: str, source: str, prefix: str = "") -> ConfigError:
    close = difflib.get_close_matches(key, list(KEYS), n=1, cutoff=0.6)
    hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
    what = "option" if prefix else "key"
    return ConfigError(f"unknown {what} '{prefix}{key}' in {source}{hint}")


def read_yaml(path: str, what: str = "config file",
              expected: str = "a mapping of key: value") -> dict:
    """Read a YAML mapping from `path`, with one-line errors for every way a file can be
    wrong. `what` and `expected` name the kind of file in those errors."""
    if not os.path.exists(path):
        raise ConfigError(f"{what} '{path}' not found")
    if os.path.isdir(path):
        raise ConfigError(f"{what} '{path}' is a directory, expected a YAML file")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {what} '{path}': {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    if data is None:
        raise ConfigError(f"{path}: file is empty, expected {expected}")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected {expected}, got a {type(data).__name__}")
    return data


def apply_mapping(values: dict, data: dict, source: str) -> None:
    for key, value in data.items():
        if key == DERIVED_SECTION:
            continue
        if not isinstance(key, str) or key not in KEYS:
            raise _unknown_key(str(key), source)
        if isinstance(value, dict):
            raise ConfigError(f"{source}: key '{key}' must be {_describe(KEYS[key])}, got a "
                              f"mapping (keys are flat: no nesting)")
        values[key] = coerce(KEYS[key], value, source)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

# Friendly spellings the documentation shows; each maps to (key, value).
FLAG_ALIASES = {"no_fp8": ("use_fp8", False), "no_wandb": ("use_wandb", False),
                "dry_run": ("plan_only", True)}
# Keys that may be given as a bare flag, and the value a bare flag means.
BARE_FLAG_VALUE = {"resume": "auto"}
_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False,
               "on": True, "off": False}


class HelpRequested(Exception):
    pass


def parse_cli(argv: list[str]) -> tuple[Optional[str], list[tuple[str, Any]]]:
    """Split argv into (config path, [(key, raw value), ...]) in order of appearance."""
    config_path, overrides, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            raise HelpRequested()
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument '{arg}' on the command line "
                              f"(options look like --key=value or --key value)")
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        takes_next = not eq and nxt is not None and not nxt.startswith("--")
        if name == "config":
            if not eq:
                if not takes_next:
                    raise ConfigError("option '--config' needs a file path")
                value, i = nxt, i + 1
            config_path = value
        elif name in FLAG_ALIASES and not eq:
            overrides.append(FLAG_ALIASES[name])
        elif name.startswith("no_") and name[3:] in KEYS and _base_type(KEYS[name[3:]]) == "bool" \
                and not eq:
            overrides.append((name[3:], False))
        elif name in KEYS:
            f = KEYS[name]
            if eq:
                overrides.append((name, _cli_value(f, value)))
            elif _base_type(f) == "bool":
                if takes_next and nxt.lower() in _BOOL_WORDS:
                    overrides.append((name, _BOOL_WORDS[nxt.lower()]))
                    i += 1
                else:
                    overrides.append((name, True))
            elif takes_next:
                overrides.append((name, _cli_value(f, nxt)))
                i += 1
            elif name in BARE_FLAG_VALUE:
                overrides.append((name, BARE_FLAG_VALUE[name]))
            else:
                raise ConfigError(f"option '--{name}' needs a value ({_describe(f)})")
        else:
            raise _unknown_key(name, "the command line", prefix="--")
        i += 1
    return config_path, overrides


def _cli_value(f, text: str) -> Any:
    """Command-line values are text; read them as YAML scalars so that '3e-4', 'null', 'true'
    and '[a, b]' mean what they mean in a config file."""
    if _base_type(f) == "str":
        return None if text.lower() in ("null", "none") and _is_optional(f) else text
    if _base_type(f) == "bool" and text.lower() in _BOOL_WORDS:
        return _BOOL_WORDS[text.lower()]
    try:
        return yaml.safe_load(text) if text != "" else None
    except yaml.YAMLError:
        return text


def load_config(argv: list[str]) -> Config:
    """Defaults, then the YAML file, then command-line overrides; then validate."""
    config_path, overrides = parse_cli(argv)
    values: dict[str, Any] = {}
    source = "<defaults>"
    if config_path is not None:
        apply_mapping(values, read_yaml(config_path), config_path)
        source = config_path
    for key, value in overrides:
        values[key] = coerce(KEYS[key], value, "the command line")
    cfg = Config(**values, source=source)
    if cfg.output_dir is None:
        stem = os.path.splitext(os.path.basename(config_path))[0] if config_path else "default"
        cfg.output_dir = os.path.join("runs", stem)
    if cfg.data_dir is None:
        cfg.data_dir = os.environ.get("FP8TRAIN_DATA_DIR") or "data"
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Checks that involve more than one key. Single-key types and bounds are checked when a
    value is read."""
    src = cfg.source

    def err(msg):
        raise ConfigError(f"{src}: {msg}")

    if cfg.num_epochs is None and cfg.max_steps is None:
        err("keys 'num_epochs' and 'max_steps' are both null; set one (max_hours alone gives "
            "the LR schedule no length)")
    schedule = cfg.lr_decay_steps or cfg.max_steps
    if schedule is not None and cfg.warmup_steps >= schedule:
        which = "lr_decay_steps" if cfg.lr_decay_steps else "max_steps"
        err(f"key 'warmup_steps' ({cfg.warmup_steps}) must be smaller than {which} "
            f"({schedule}): the LR would never decay")
    if cfg.penalty_weight > 0 and cfg.penalty_type == "none":
        err(f"key 'penalty_weight' is {cfg.penalty_weight} but penalty_type is 'none'; "
            f"choose z_loss or logit_l2")
    if cfg.auto_batch_size and cfg.target_effective_batch_size is None:
        err("key 'auto_batch_size' needs target_effective_batch_size")
    if cfg.auto_batch_size and cfg.gradient_accumulation_steps is not None:
        err("key 'gradient_accumulation_steps' is derived when auto_batch_size is true; remove "
            "it (or set auto_batch_size: false)")
    if cfg.lr_scaling != "none" and cfg.lr_reference_batch_size is None:
        err(f"key 'lr_scaling' is '{cfg.lr_scaling}' but lr_reference_batch_size is not set")
    if cfg.n_kv_head is not None and cfg.n_head is not None and cfg.n_head % cfg.n_kv_head:
        err(f"key 'n_kv_head' ({cfg.n_kv_head}) must divide n_head ({cfg.n_head})")
    if cfg.n_embd is not None and cfg.n_head is not None and cfg.n_embd % cfg.n_head:
        err(f"key 'n_embd' ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
    if os.path.isdir(cfg.dataset):
        if not os.path.isfile(os.path.join(cfg.dataset, "meta.json")):
            err(f"key 'dataset': directory '{cfg.dataset}' has no meta.json: not a dataset "
                "prepared with scripts/prepare_data.py (or its preparation did not finish)")
    elif cfg.dataset not in KNOWN_DATASETS and not os.path.isfile(cfg.dataset):
        looks_like_path = cfg.dataset.endswith(".txt") or os.path.sep in cfg.dataset
        err(f"key 'dataset': file '{cfg.dataset}' not found" if looks_like_path else
            f"key 'dataset': '{cfg.dataset}' is neither a known dataset "
            f"({', '.join(KNOWN_DATASETS)}) nor a path to a .txt file")
    if cfg.use_fp8 and cfg.seq_len % 16:
        err(f"key 'seq_len' ({cfg.seq_len}) must be a multiple of 16 with use_fp8: FP8 GEMMs "
            "need the token dimension divisible by 16")
    if cfg.fp8_min_layer_size and cfg.fp8_layers != "min_size":
        err(f"key 'fp8_min_layer_size' ({cfg.fp8_min_layer_size}) applies only with fp8_layers: "
            f"min_size, but fp8_layers is '{cfg.fp8_layers}'; set fp8_layers: min_size or "
            "remove fp8_min_layer_size")
    if cfg.batch_cache_dir is not None and os.path.exists(cfg.batch_cache_dir) and \
            not os.path.isdir(cfg.batch_cache_dir):
        err(f"key 'batch_cache_dir': '{cfg.batch_cache_dir}' is not a directory")
    if cfg.resume not in ("never", "auto") and not os.path.exists(cfg.resume):
        err(f"key 'resume': checkpoint '{cfg.resume}' not found (use auto, never or a path)")


def to_dict(cfg: Config) -> dict:
    return {f.name: getattr(cfg, f.name) for f in key_fields()}


def dump_yaml(cfg: Config, derived: Optional[dict] = None) -> str:
    """The resolved config as YAML, grouped as in --help, with derived values at the end.
    Secret values from the environment (fp8train/secrets.py) are "***" in it: they are
    replaced before YAML quotes or folds them, and once more in the text."""
    lines = [f"# resolved config (from {redact(cfg.source)}); feed it back with --config"]
    by_group = {g: [f for f in key_fields() if f.metadata["group"] == g] for g in GROUPS}
    for group, fs in by_group.items():
        lines.append(f"# {group}")
        for f in fs:
            lines.append(yaml.safe_dump({f.name: redact(getattr(cfg, f.name))},
                                        default_flow_style=True, width=1000).strip()
                         .removeprefix("{").removesuffix("}"))
    text = "\n".join(lines) + "\n"
    if derived:
        text += "# written by the trainer; ignored when this file is loaded\n"
        text += yaml.safe_dump({DERIVED_SECTION: redact(derived)}, sort_keys=False)
    return redact(text)


def help_text() -> str:
    out = ["usage: train_fp8.py --config FILE [--key=value | --key value ...]",
           "",
           "Train a GPT-style model. Every config key below can be set in the YAML file or",
           "overridden on the command line (the command line wins). Booleans also take a bare",
           "--key (true) or --no_key (false); --no_fp8 = --use_fp8=false; bare --resume = auto.",
           "Exit codes: 0 done, 2 bad config or input, 3 stopped by a signal (resumable), 1 other."]
    for group in GROUPS:
        out.append("")
        out.append(f"{group}:")
        for f in key_fields():
            if f.metadata["group"] != group:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = "null" if default is None else (str(default).lower()
                                                     if isinstance(default, bool) else default)
            out.append(f"  --{f.name:<30} {f.metadata['doc']} [default: {shown}]")
    return "\n".join(out)
