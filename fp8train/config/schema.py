"""The config schema: every key with its type, default, bounds, one-line doc, group and whether
a resumed run may change it (`--help` is made from it in help.py; the typed section of each
group in sections.py).

Standard library only: imported before torch, so `--help` and config errors are instant.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field, fields
from typing import Optional

# The groups in the order `--help` and the written config.yaml show them.
# Each group is also the typed section of the config that one component receives
# (`section(cfg, "eval")` for the evaluator, "checkpoint" for the checkpointer, ...).
GROUPS = ("run", "data", "model", "batch", "optimizer", "duration", "loss", "precision",
          "fp8", "logging", "eval", "checkpoint", "reliability", "wandb")

MODEL_PRESETS = ("gpt2-124m", "gpt2-350m", "llama-350m", "llama-1b", "tiny", "tiny-llama")
HF_PREFIX = "hf:"  # model: hf:<hub id or directory> (a transformers model)
KNOWN_DATASETS = ("tinyshakespeare", "fineweb-edu", "openwebtext", "synthetic")

# fp8_backend -> the values of fp8_recipe it accepts; the first is its default. Delayed scaling
# derives each tensor's scale from an amax history (fp8_margin, fp8_amax_*); every other recipe
# scales each tensor, row or block from its own amax at every step.
FP8_RECIPES = {"te": ("delayed", "current", "block"),
               "torchao": ("tensorwise", "rowwise", "rowwise_with_gw_hp"),
               "native": ("delayed", "current")}
DELAYED_SCALING_KEYS = ("fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo")


def _key(default, doc, group, *, choices=None, min=None, max=None, gt=None, resume="locked"):
    """A config key: its default, one-line doc, group, the bounds validation checks, and
    whether a resumed run may change it: "free" (how the run is carried out, not what it
    trains) or "locked" (it changes training: refused unless allow_config_change)."""
    assert resume in ("free", "locked")
    meta = dict(doc=doc, group=group, choices=choices, min=min, max=max, gt=gt, resume=resume)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Config:
    """The validated run config: flat keys (the YAML and command-line contract), frozen once
    validated. Values decided while the run starts (a sweep trial's directory, activation
    checkpointing turned on by the batch probe) live in the run's plan, not here."""
    # --- run ------------------------------------------------------------------------------------
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
    # --- data -----------------------------------------------------------------------------------
    dataset: str = _key(
        "tinyshakespeare", "tinyshakespeare | fineweb-edu | openwebtext (prepared under data_dir) "
        "| a prepared directory | a .txt file | synthetic (benchmarks: no files, GPT-2 vocab)",
        "data")
    data_dir: Optional[str] = _key(
        None, "where datasets are looked up; default $FP8TRAIN_DATA_DIR, else ./data", "data",
                                   resume="free")
    tokenizer: str = _key(
        "byte", "byte (no files needed) | a HF tokenizer name or local directory (AutoTokenizer) "
        "| model (an hf: model's own tokenizer)", "data")
    seq_len: int = _key(1024, "tokens per training sequence (the model's context length)",
                        "data", min=8)
    data_prefetch: int = _key(2, "micro-batches prepared ahead on a background thread (0 = in "
                              "the loop)", "data", min=0, resume="free")
    val_fraction: float = _key(
        0.1, "fraction of a text corpus held out for validation (the end; prepared data has "
        "its own split)", "data", gt=0.0, max=0.5)
    # --- model ----------------------------------------------------------------------------------
    model: str = _key("gpt2-124m", "preset: " + " | ".join(MODEL_PRESETS) + " | hf:<hub id or "
                      "local directory> (any transformers causal LM, built from its config.json)",
                      "model")
    init_from: str = _key(
        "scratch", "an hf: model's starting weights: scratch (fresh, the model's own init: "
        "pretraining) | pretrained (its saved weights: continued pretraining)", "model",
        choices=("scratch", "pretrained"))
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
        "auto_batch_size turns it on when micro-batch 1 does not fit without it", "model",
                                          resume="free")
    compile: bool = _key(False, "torch.compile the model", "model", resume="free")
    compile_mode: str = _key(
        "default", "torch.compile mode: default | reduce-overhead (CUDA graphs: less launch "
        "overhead for small models) | max-autotune | max-autotune-no-cudagraphs", "model",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
                             resume="free")
    compile_scope: str = _key(
        "auto", "what torch.compile compiles: blocks (each transformer block, one graph shared "
        "by all, and the output layer with the loss) | model (the whole model as one graph) | "
        "auto (blocks; model under reduce-overhead and max-autotune, whose CUDA graphs "
        "overwrite the outputs of separately compiled blocks)", "model",
        choices=("auto", "blocks", "model"), resume="free")
    # --- batch ----------------------------------------------------------------------------------
    batch_size: int = _key(8, "micro-batch per device, in sequences", "batch", min=1,
                           resume="free")
    gradient_accumulation_steps: Optional[int] = _key(
        None, "micro-batches per optimizer step; default derived from "
        "target_effective_batch_size, else 1", "batch", min=1, resume="free")
    target_effective_batch_size: Optional[int] = _key(
        None, "sequences per optimizer step = micro x accumulation x world size", "batch", min=1,
                                                      resume="free")
    auto_batch_size: bool = _key(False, "discover the micro-batch at start: the largest that "
                                 "fits, or a smaller one that is timed faster",
                                 "batch", resume="free")
    max_batch_size: int = _key(128, "ceiling for the discovered micro-batch", "batch", min=1,
                               resume="free")
    memory_headroom: float = _key(
        0.1, "fraction of device memory the discovered micro-batch leaves free (fragmentation "
        "on long runs)", "batch", min=0.0, max=0.9, resume="free")
    probe_memory_limit_gb: Optional[float] = _key(
        None, "memory budget per device for batch discovery; default the GPU's memory (CPU: "
        "available RAM)", "batch", gt=0.0, resume="free")
    batch_cache_dir: Optional[str] = _key(
        None, "where discovered micro-batches are cached (batch_probe.json); default output_dir",
        "batch", resume="free")
    batch_timing_budget_s: float = _key(
        30.0, "seconds of timed steps auto_batch_size may spend comparing the micro-batches up "
        "to the fit that divide the target, to take the fastest rather than the largest; each "
        "size's warm-up (its compile under compile: true) is not counted and is reported apart "
        "(0 = the largest, untimed)",
        "batch", min=0.0, resume="free")
    batch_speed_tolerance: float = _key(
        0.03, "a smaller micro-batch is taken only when its tokens/s beat the larger one's by "
        "more than this fraction (timing noise)", "batch", min=0.0, max=0.5, resume="free")
    reprobe: bool = _key(False, "ignore the cached micro-batch (and fp8_layers auto timings) "
                         "and measure again", "batch", resume="free")
    # --- optimizer ------------------------------------------------------------------------------
    optimizer: str = _key(
        "adamw", "adamw | muon (Muon for the matrices inside the blocks, AdamW for embeddings, "
        "head, norms and biases; not under FSDP)", "optimizer", choices=("adamw", "muon"))
    learning_rate: float = _key(6e-4, "peak learning rate (after warmup); with optimizer: muon, "
                                "AdamW's (embeddings, head, norms, biases)", "optimizer", gt=0.0)
    muon_lr: float = _key(0.02, "muon: peak learning rate of the hidden matrices (follows the "
                          "same schedule)", "optimizer", gt=0.0)
    muon_momentum: float = _key(0.95, "muon: Nesterov momentum", "optimizer", min=0.0,
                                max=0.9999)
    muon_weight_decay: float = _key(0.0, "muon: decoupled weight decay of the hidden matrices "
                                    "(x muon_lr per step)", "optimizer", min=0.0)
    muon_split_fused: bool = _key(
        True, "muon: orthogonalise the logical matrices inside fused projections (q, k and v; "
        "SwiGLU's gate and up) each on its own, not the fused matrix whole", "optimizer")
    min_lr_ratio: float = _key(0.1, "final LR as a fraction of learning_rate (reached at the "
                               "last step of the schedule)", "optimizer", min=0.0, max=1.0)
    lr_schedule: str = _key(
        "cosine", "LR after warmup: cosine (half cosine to the end) | wsd (warmup-stable-decay: "
        "the peak held, then lr_decay_fraction decaying) | linear (straight to the end)",
        "optimizer", choices=("cosine", "wsd", "linear"))
    lr_decay_fraction: float = _key(
        0.2, "wsd: the last fraction of the steps after warmup that decay to min_lr_ratio",
        "optimizer", gt=0.0, max=1.0)
    lr_decay_shape: str = _key(
        "linear", "wsd: the decay's shape: linear | 1-sqrt | cosine", "optimizer",
        choices=("linear", "1-sqrt", "cosine"))
    warmup_steps: int = _key(
        2000, "linear warmup steps; one not shorter than the LR schedule is shortened to 10% of "
        "it, with a warning (refused when set in the same place as max_steps or lr_decay_steps, "
        "or after it)", "optimizer", min=0)
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
    # --- duration -------------------------------------------------------------------------------
    num_epochs: Optional[float] = _key(
        1.0, "passes over the training tokens (fractions allowed)", "duration", gt=0.0,
                                       resume="free")
    max_steps: Optional[int] = _key(None, "stop after this many optimizer steps", "duration",
                                    min=1, resume="free")
    max_hours: Optional[float] = _key(
        None, "stop (with a checkpoint) after this much wall-clock time in this invocation",
        "duration", gt=0.0, resume="free")
    # --- loss -----------------------------------------------------------------------------------
    penalty_type: str = _key(
        "none", "none | z_loss (mean logsumexp(logits)^2, PaLM) | logit_l2 (mean logits^2)",
        "loss", choices=("none", "z_loss", "logit_l2"))
    penalty_weight: float = _key(0.0, "weight of the penalty term added to cross-entropy",
                                 "loss", min=0.0)
    # --- precision ------------------------------------------------------------------------------
    precision: str = _key(
        "auto", "auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32 | fp16", "precision",
        choices=("auto", "bf16", "fp32", "fp16"))
    tf32: bool = _key(True, "allow TF32 matmuls on GPU for the fp32 parts", "precision",
                      resume="free")
    # --- fp8 ------------------------------------------------------------------------------------
    use_fp8: bool = _key(False, "train the large Linears in FP8 (H100/H200)", "fp8")
    fp8_backend: str = _key(
        "te", "te | torchao | native | auto (each installed one's recipes timed on the GPU: the "
        "fastest whose numerics pass; native on a CPU)", "fp8",
        choices=("te", "torchao", "native", "auto"))
    fp8_format: str = _key("hybrid", "hybrid (E4M3 forward, E5M2 gradients) | e4m3", "fp8",
                           choices=("hybrid", "e4m3"))
    fp8_margin: int = _key(0, "scale = fp8_max / amax / 2^margin", "fp8", min=0, max=16)
    fp8_amax_history_len: int = _key(1024, "delayed-scaling amax history window", "fp8", min=1)
    fp8_amax_compute_algo: str = _key("max", "max | most_recent", "fp8",
                                      choices=("max", "most_recent"))
    fp8_fallback: str = _key("bf16", "when FP8 cannot run: bf16 (warn) | error (exit 2)", "fp8",
                             choices=("bf16", "error"), resume="free")
    fp8_eval: bool = _key(False, "evaluate in FP8 too (default: bf16)", "fp8", resume="free")
    fp8_until: Optional[float] = _key(
        None, "FP8 up to this point of the run, the base precision after it (the cool-down): "
        "a fraction of the LR schedule (below 1) or the step of the hand-over (2 or more, "
        "before the run's last step)", "fp8", gt=0.0)
    fp8_check_interval: int = _key(
        0, "every N optimizer steps, the step's first micro-batch once more with FP8 off (no "
        "gradients, FP8 state untouched): fp8/loss_gap = FP8 minus high-precision loss (0 = off)",
        "fp8", min=0, resume="free")
    fp8_max_loss_gap: float = _key(0.05, "the largest fp8/loss_gap (nats) that is fine", "fp8",
                                   gt=0.0, resume="free")
    fp8_gap_window: int = _key(3, "checks in a row above fp8_max_loss_gap before it is warned "
                               "about (once) or acted on", "fp8", min=1, resume="free")
    fp8_gap_action: str = _key(
        "warn", "warn | recover (also apply fp8_recovery's remedy; a gap that outlasts a raised "
        "margin turns FP8 off)", "fp8", choices=("warn", "recover"), resume="free")
    fp8_recipe: Optional[str] = _key(
        None, "the scaling recipe, per backend (the first is its default): te delayed | current | "
        "block; torchao tensorwise | rowwise | rowwise_with_gw_hp; native delayed | current; "
        "auto (timed on the GPU: the fastest whose numerics pass; the default on a CPU)", "fp8",
        choices=tuple(dict.fromkeys(r for rs in FP8_RECIPES.values() for r in rs)) + ("auto",))
    fp8_fsdp_all_gather: Optional[bool] = _key(
        None, "FSDP2 with torchao tensorwise: all-gather the weights in FP8 (half the bytes of "
        "bf16); default on there, false gathers in bf16", "fp8", resume="free")
    fp8_layers: str = _key(
        "auto", "which eligible Linears (dims divisible by 16, not in fp8_exclude) go to FP8: "
        "auto (each shape timed on the GPU, FP8 where faster; all on CPU) | all | min_size "
        "(fp8_min_layer_size)", "fp8", choices=("auto", "all", "min_size"))
    fp8_auto_margin: float = _key(
        0.05, "fp8_layers auto: convert a shape only when FP8 is at least this much faster "
        "(0.05: speed-up >= 1.05x)", "fp8", min=0.0)
    fp8_choice_budget_s: float = _key(
        300.0, "fp8_recipe / fp8_backend auto and fp8_layers auto: seconds each rank may spend "
        "timing FP8 at start (compiles included); candidates not reached are listed as not "
        "timed", "fp8", gt=0.0, resume="free")
    fp8_min_layer_size: int = _key(
        0, "fp8_layers min_size: convert only Linears with at least this many weights "
        "(in x out)", "fp8", min=0)
    fp8_exclude: list = _key(["lm_head"], "Linears kept out of FP8 (name patterns, * wildcard; "
                             "an hf: model's by their transformers names)", "fp8")
    fp8_log_layers: bool = _key(True, "log fp8/<layer>/... scales per layer (aggregates always)",
                                "fp8", resume="free")
    # --- logging --------------------------------------------------------------------------------
    log_interval: int = _key(10, "optimizer steps between log lines / metrics.jsonl rows",
                             "logging", min=1, resume="free")
    profile_steps: Optional[tuple] = _key(
        None, "record optimizer steps START to END (1-based, inclusive) with torch.profiler into "
        "<output_dir>/profile/ (a Chrome/Perfetto trace; on CUDA also a memory snapshot); their "
        "tokens/s are left out of the run's throughput", "logging", resume="free")
    # --- eval -----------------------------------------------------------------------------------
    target_val_loss: Optional[float] = _key(
        None, "the val/loss to reach: when an evaluation reaches it, val/time_to_target_s and "
        "val/tokens_to_target are logged and a checkpoint saved", "eval", gt=0.0, resume="free")
    stop_at_target: bool = _key(True, "stop (exit 0) once target_val_loss is reached; false "
                                "trains on to the end", "eval", resume="free")
    eval_interval: Optional[int] = _key(
        None, "optimizer steps between evaluations; default 1000, or 500 when target_val_loss is "
        "set (a target is noticed sooner)", "eval", min=1, resume="free")
    eval_sequences: int = _key(256, "validation sequences per evaluation (a fixed set)",
                               "eval", min=1, resume="free")
    eval_samples: int = _key(2, "text samples generated at each evaluation (samples.jsonl, "
                             "W&B table; 0 = off)", "eval", min=0, max=16, resume="free")
    hellaswag_interval: int = _key(
        0, "HellaSwag accuracies (hellaswag/acc, hellaswag/acc_norm) at the evaluations whose "
        "step is a multiple of this, and at the last (0 = off)", "eval", min=0, resume="free")
    hellaswag_path: Optional[str] = _key(
        None, "HellaSwag's validation split: hellaswag_val.jsonl or the hub's validation "
        "parquet (or its folder); default the hub's Rowan/hellaswag through datasets (its local "
        "cache when offline)", "eval", resume="free")
    hellaswag_examples: Optional[int] = _key(
        None, "HellaSwag examples to score (the first N); default all 10,042", "eval", min=1,
        resume="free")
    sample_tokens: int = _key(64, "tokens generated per sample", "eval", min=1, max=1024,
                              resume="free")
    # --- checkpoint -----------------------------------------------------------------------------
    checkpoint_interval: int = _key(1000, "optimizer steps between checkpoints (also at the end)",
                                    "checkpoint", min=1, resume="free")
    keep_checkpoints: int = _key(3, "checkpoints kept on disk, newest first (0 = keep all)",
                                 "checkpoint", min=0, resume="free")
    allow_config_change: bool = _key(
        False, "resume even though keys that change training (model, data, optimizer, ...) "
        "differ from the checkpoint's", "checkpoint", resume="free")
    checkpoint_required: bool = _key(
        False, "stop (exit 1) when a checkpoint cannot be written, instead of warning and "
        "training on", "checkpoint", resume="free")
    checkpoint_async: bool = _key(
        False, "write periodic checkpoints in a background thread from a copy of the state "
        "taken in host memory at the step (host RAM the size of model + optimizer state; not "
        "under FSDP): the same atomic checkpoint; the next save, a rollback, a stop and the end "
        "wait for it", "checkpoint", resume="free")
    checkpoint_window_s: Optional[float] = _key(
        None, "seconds a stop signal leaves before the kill (the @TIME of SLURM's --signal); a "
        "save taking over half of it is warned about, once; default: the SLURM job's --signal "
        "(none outside SLURM)", "checkpoint", gt=0.0, resume="free")
    # --- reliability ----------------------------------------------------------------------------
    max_bad_steps: int = _key(
        10, "consecutive non-finite steps (each skipped) before the last checkpoint is restored "
        "(0 = skip only, never restore)", "reliability", min=0, resume="free")
    fp8_recovery: str = _key(
        "margin", "remedy applied with that restore in an FP8 run: margin (fp8_margin + 1; "
        "recipes without a margin, all but delayed, go to bf16) | bf16 (FP8 off)", "reliability",
        choices=("margin", "bf16"), resume="free")
    loss_spike_factor: float = _key(
        3.0, "log a loss spike when a step's loss exceeds this many times the running mean "
        "(0 = off)", "reliability", min=0.0, resume="free")
    # --- wandb ----------------------------------------------------------------------------------
    use_wandb: bool = _key(False, "log to Weights & Biases", "wandb", resume="free")
    wandb_project: str = _key("fp8train", "W&B project", "wandb", resume="free")
    wandb_entity: Optional[str] = _key(None, "W&B entity (team or user)", "wandb", resume="free")
    wandb_run_name: Optional[str] = _key(None, "W&B run name (default: output_dir's name)",
                                         "wandb", resume="free")
    wandb_tags: list = _key([], "W&B tags", "wandb", resume="free")
    # WANDB_MODE=offline|disabled and WANDB_API_KEY are read by W&B itself, as usual.

    # Where the values came from, for error messages; not keys. `source`: the config file (or
    # "<defaults>"); `origins`: key -> the file or the command-line option that set it.
    source: str = field(default="<defaults>", repr=False, compare=False,
                        metadata=dict(internal=True))
    origins: dict = field(default_factory=dict, repr=False, compare=False,
                          metadata=dict(internal=True))
    # The config file is a run's own config.yaml (it has a `derived:` section): its values were
    # resolved by that run, so config/requires.py counts them as defaults.
    from_run: bool = field(default=False, repr=False, compare=False,
                           metadata=dict(internal=True))

    def cache_dir(self, run_dir: Optional[str] = None) -> str:
        """Where start-up's measurements are cached (the batch probe, FP8 layer timings):
        batch_cache_dir, else the run's directory (`run_dir`: a sweep trial's own; default
        output_dir)."""
        return self.batch_cache_dir or run_dir or self.output_dir

    def where(self, *keys: str) -> str:
        """Where the values of `keys` came from, for an error about them: the options and files
        that set them (defaults left out), else the config file."""
        return origin_of(self.origins, self.source, keys)

    def __post_init__(self):
        if self.eval_interval is None:   # a target is noticed sooner with more evaluations
            object.__setattr__(self, "eval_interval",
                               500 if self.target_val_loss is not None else 1000)
        if self.fp8_recipe is None:      # the backend's own default recipe
            object.__setattr__(self, "fp8_recipe",
                               FP8_RECIPES.get(self.fp8_backend, ("auto",))[0])


def origin_of(origins: dict, source: str, keys) -> str:
    """The options and files that set `keys` (`origins`: key -> where), else `source`."""
    found = [origins[k] for k in keys if k in origins]
    return ", ".join(dict.fromkeys(found)) or source


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


def base_type(f) -> str:
    t = _type_name(f)
    m = re.match(r"Optional\[(\w+)\]", t)
    return m.group(1) if m else t


def is_optional(f) -> bool:
    return _type_name(f).startswith("Optional[")


def default_of(f):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def bounds(f, ge: str = ">=", le: str = "<=") -> list:
    """The key's numeric bounds as text: ["> 0.0", ">= 1", "<= 16"] (`ge`, `le`: how to write
    the inclusive ones)."""
    m, out = f.metadata, []
    if m.get("gt") is not None:
        out.append(f"> {m['gt']}")
    if m.get("min") is not None:
        out.append(f"{ge} {m['min']}")
    if m.get("max") is not None:
        out.append(f"{le} {m['max']}")
    return out


TYPE_WORDS = {"tuple": "a pair of step numbers [START, END], 1 <= START <= END",
              "int": "an integer", "float": "a number", "bool": "true or false",
              "str": "a string", "list": "a list of strings"}


def describe_accepted(f, types: dict = TYPE_WORDS, choices: str = "one of {}", choice=str,
              join: str = ", ", ge: str = ">=", le: str = "<=", bounds_sep: str = " ",
              optional: str = " (or null)") -> str:
    """What a key accepts, in words: its type (or choices), bounds, and null when optional.
    The arguments say how to write each part (errors and --help use the defaults; the
    generated reference writes Markdown)."""
    m = f.metadata
    text = choices.format(join.join(choice(c) for c in m["choices"])) if m.get("choices") \
        else types[base_type(f)]
    limits = bounds(f, ge, le)
    if limits:
        text += bounds_sep + " and ".join(limits)
    if is_optional(f):
        text += optional
    return text


def to_dict(cfg: Config) -> dict:
    return {f.name: getattr(cfg, f.name) for f in key_fields()}
