"""Weights & Biases through Accelerate's tracker, on the main process only, and never at the
cost of the run: any W&B failure becomes one warning, then offline logging (syncable later with
`wandb sync`), then none. metrics.jsonl is written either way.

Rows, samples and the summary reach it through the run's logger (logger.py), which redacts
secret values from the environment first; the run's config, name, tags and the command line W&B
records in the run's metadata are redacted here with the logger's `clean`. W&B itself reads
WANDB_API_KEY to authenticate and records no environment variables."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import secrets
import string
import subprocess
import sys
from typing import Optional

import torch

from ..errors import one_line

RUN_ID_FILE = "wandb_run_id"


def sweep_run_id() -> Optional[str]:
    """The W&B run id when this process is a trial started by a sweep agent."""
    if os.environ.get("WANDB_SWEEP_ID") and os.environ.get("WANDB_RUN_ID"):
        return os.environ["WANDB_RUN_ID"]
    return None


def environment(num_processes: int) -> dict:
    """What produced the numbers: code revision, library versions, hardware. No environment
    variables: nothing here can hold a secret."""
    env = {"git_commit": _git_commit()}
    for dist in ("torch", "accelerate", "transformer-engine", "torchao", "transformers",
                 "datasets", "wandb", "numpy"):
        try:
            env[f"{dist.replace('-', '_')}_version"] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        env["gpu_name"] = torch.cuda.get_device_name()
        env["gpus_per_node"] = torch.cuda.device_count()
        env["cuda_version"] = torch.version.cuda
    else:
        env["gpu_name"] = None
    env["gpu_count"] = num_processes if torch.cuda.is_available() else 0
    return env


def _git_commit() -> str:
    """The project's commit, with '-dirty' when files differ from it; 'unknown' outside git."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10)
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def wandb_installed() -> bool:
    return importlib.util.find_spec("wandb") is not None


class Tracker:
    """W&B for one run. `accelerator` must have been built with log_with="wandb" (see
    `log_with`). All methods are no-ops on other ranks and after W&B has been given up."""

    def __init__(self, accelerator, log):
        """`log`: the run's logger (its warn, msg and clean)."""
        self.acc, self.warn, self.info, self._redact = accelerator, log.warn, log.msg, log.clean
        self.active = False
        self.run = None

    @staticmethod
    def log_with(cfg) -> Optional[str]:
        return "wandb" if cfg.enabled and wandb_installed() else None

    def start(self, cfg, run_dir: str, config: dict, resuming: bool) -> None:
        """`cfg`: the config's wandb section; `run_dir`: the run's directory."""
        if not cfg.enabled:
            return
        if not wandb_installed():
            self.warn("use_wandb: the wandb package is not installed (pip install wandb); "
                      "logging to metrics.jsonl only")
            return
        if not self.acc.is_main_process:
            return
        # The free-text fields a secret could be typed into by mistake are redacted; entity,
        # project and dir say where the run goes and are left as they are.
        init = dict(tags=self._redact(list(cfg.tags)) or None, dir=run_dir,
                    resume="allow")
        if not sweep_run_id():  # a sweep's agent names the run and fixes its id and entity
            init.update(entity=cfg.entity, name=self._redact(
                cfg.run_name or os.path.basename(os.path.normpath(run_dir))))
        config = self._redact(config)
        # W&B records sys.argv in the run's metadata (its "args"): redact it in place. The
        # config has been parsed from it already; nothing reads it again.
        argv = self._redact(sys.argv)
        if argv != sys.argv:
            sys.argv[:] = argv
        try:
            init["id"] = self._run_id(run_dir, resuming)
            if not _has_credentials():
                raise RuntimeError("no W&B API key (run `wandb login` or set WANDB_API_KEY)")
            self._init(cfg, config, init)
        except Exception as e:  # no key, no network, server error: W&B must not stop training
            self.acc.trackers = []
            _finish_any_run()   # else wandb.init would hand back the half-started run
            try:
                self._init(cfg, config, dict(init, mode="offline"))
            except Exception as e2:
                self.acc.trackers = []
                self.warn(f"W&B: {one_line(e)}; offline logging failed too ({one_line(e2)}); "
                          "logging to metrics.jsonl only")
                return
            self.warn(f"W&B: {one_line(e)}; continuing offline (sync later with `wandb sync "
                      f"{self.run.settings.sync_dir}`)")
            said_sync = True
        else:
            said_sync = False
        self.active = True
        mode = self.run.settings.mode
        # run.url is read online only: offline, reading it makes W&B print a warning
        where = self.run.url if mode == "online" else \
            self.run.settings.sync_dir if mode == "offline" else None
        hint = f" (sync it with `wandb sync {where}`)" if mode == "offline" and not said_sync \
            else ""
        self.info(f"W&B: run {self.run.id} ({mode})" + (f": {where}" if where else "") + hint)

    def _init(self, cfg, config: dict, init: dict) -> None:
        import wandb

        # W&B's own console output (its banner, and at the end the run's history and summary,
        # some 50 lines) is left out: start()'s one "W&B: run ..." line says where the run is
        # and how to sync it. Online, W&B's errors and warnings still show.
        offline = init.get("mode") == "offline" or \
            os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun")
        init = dict(init, settings=wandb.Settings(quiet=True, silent=offline))
        self.acc.init_trackers(cfg.project, config=config, init_kwargs={"wandb": init})
        self.run = self.acc.get_tracker("wandb", unwrap=True)
        # Our `step` is the x-axis, not W&B's own counter: a resumed run re-logs the steps
        # after its checkpoint, which W&B's monotonic step would silently drop.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    @staticmethod
    def _run_id(output_dir: str, resuming: bool) -> str:
        """A sweep trial's id comes from the agent; otherwise one id per run directory, kept
        in it, so that a resumed run continues the same W&B run."""
        from_sweep = sweep_run_id()
        if from_sweep:
            return from_sweep
        path = os.path.join(output_dir, RUN_ID_FILE)
        if resuming and os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                saved = fh.read().strip()
            if saved:
                return saved
        run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits)
                         for _ in range(8))   # W&B's own id format
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(run_id + "\n")
        return run_id

    def log(self, row: dict) -> None:
        if self.active:
            self._guard(lambda: self.acc.log(row))

    def log_samples(self, step: int, samples: list) -> None:
        if self.active and samples:
            def log():
                import wandb
                table = wandb.Table(columns=["step", "prompt", "sample"],
                                    data=[[step, s["prompt"], s["sample"]] for s in samples])
                self.acc.log({"step": step, "samples/text": table})
            self._guard(log)

    def _guard(self, fn) -> None:
        try:
            fn()
        except Exception as e:
            self.active = False
            self.warn(f"W&B logging failed ({one_line(e)}); continuing with metrics.jsonl only")

    def summary(self, values: dict) -> None:
        """The end-of-run report as the W&B run's summary (what the runs table shows)."""
        if self.active:
            self._guard(lambda: self.run.summary.update(
                {f"summary/{k}": v for k, v in values.items() if not isinstance(v, dict)}
                | {f"summary/{k}/{kk}": vv for k, v in values.items() if isinstance(v, dict)
                   for kk, vv in v.items()}))

    def save_file(self, path: str, folder: str = "profile") -> None:
        """A file of the run directory (a profiler trace) attached to the W&B run: copied into
        the run's files directory (`run.dir`), which W&B uploads with the run (wandb.save
        would link it instead, and warn on the console that later changes need another save)."""
        if self.active:
            def copy():
                import shutil
                dest = os.path.join(self.run.dir, folder)
                os.makedirs(dest, exist_ok=True)
                shutil.copyfile(path, os.path.join(dest, os.path.basename(path)))
            self._guard(copy)

    def preempting(self) -> None:
        """Tell W&B the run is stopping to be resumed (sweeps treat it as preempted, not
        failed)."""
        if self.active:
            self._guard(lambda: self.run.mark_preempting())

    def finish(self, failed: bool = False) -> None:
        """Close the W&B run, marked failed when training raised. Not
        accelerator.end_training(): that also destroys the process group."""
        if self.active:
            self.active = False
            try:
                self.run.finish(exit_code=1 if failed else 0)
            except Exception as e:
                self.warn(f"W&B: finishing the run failed ({one_line(e)})")


def _has_credentials() -> bool:
    """Whether online W&B can start without asking: on a terminal, wandb.init would otherwise
    wait for a key to be typed while the other ranks wait for rank 0."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return True
    import wandb
    return bool(wandb.login(prompt=False, verify=False))


def _finish_any_run() -> None:
    try:
        import wandb
        if wandb.run is not None:
            wandb.run.finish(exit_code=1)
    except Exception:
        pass

