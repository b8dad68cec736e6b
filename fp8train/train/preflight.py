"""Preflight: the checks of a loaded config that read the filesystem, run before torch is
imported, so that a wrong path costs a second too.

    cfg = check(config.load.load_config(argv))     # what fp8train/train/cli.py does

`check` resolves `dataset` (a name under data_dir becomes its path, so that config.yaml records
what was read), then refuses, as a one-line BadInput (exit 2) naming the key and where its value
came from: a dataset that is missing or cannot be trained on (fp8train/data/sources.py), a
batch_cache_dir that is not a directory, HellaSwag's examples that cannot be read or are not
HellaSwag's (evaluate/hellaswag_data.py: the file, or the hub's local cache when offline), a
resume path that holds no checkpoint (directory listings only: fp8train/checkpoint/locate.py).
`load_checked(argv)` is both steps: the config exactly as train_fp8.py accepts it, for callers
that check a command line it will run (sweeps). No torch, like the config package: the standard
library, and pyarrow or datasets only to read HellaSwag's parquet or hub copy.
"""
from __future__ import annotations

import dataclasses
import os

from ..checkpoint.locate import path_problem
from ..config import load
from ..config.schema import Config
from ..data.sources import dataset_error, resolved_dataset
from ..errors import BadInput
from ..evaluate.hellaswag_data import load_examples


def check(cfg: Config) -> Config:
    """`cfg` with its dataset resolved, once the paths it names are usable; BadInput if not."""
    def err(msg, *keys):
        raise BadInput(f"{cfg.where(*keys)}: {msg}")

    dataset = resolved_dataset(cfg.dataset, cfg.data_dir)
    if dataset != cfg.dataset:
        cfg = dataclasses.replace(cfg, dataset=dataset)
    bad_dataset = dataset_error(cfg.dataset, cfg.data_dir, cfg.tokenizer)
    if bad_dataset:
        err(bad_dataset, "dataset", "data_dir", "tokenizer")
    if cfg.batch_cache_dir is not None and os.path.exists(cfg.batch_cache_dir) and \
            not os.path.isdir(cfg.batch_cache_dir):
        err(f"key 'batch_cache_dir': '{cfg.batch_cache_dir}' is not a directory",
            "batch_cache_dir")
    if cfg.hellaswag_interval:
        _check_hellaswag(cfg, err)
    if cfg.resume not in ("never", "auto"):
        problem = path_problem(cfg.resume)
        if problem:
            err(f"key 'resume': {problem}"
                + ("; resume is auto, never or a path" if "not found" in problem else ""),
                "resume")
    return cfg


def _check_hellaswag(cfg: Config, err) -> None:
    """HellaSwag's examples read and checked now, before data, model and batch probe: a bad
    file, or no path with the hub out of reach and not cached, costs a second too."""
    path = cfg.hellaswag_path
    if path is not None and not os.path.exists(path):
        err(f"key 'hellaswag_path': '{path}' does not exist", "hellaswag_path")
    try:
        load_examples(path, cfg.hellaswag_examples, option="hellaswag_path")
    except BadInput as e:
        err(f"key 'hellaswag_{'path' if path else 'interval'}': {e}", "hellaswag_path",
            "hellaswag_interval")


def load_checked(argv: list[str]) -> Config:
    """The config of a command line as train_fp8.py accepts it: config.load.load_config, then
    `check`."""
    return check(load.load_config(argv))
