"""Checkpoints: writing, verifying, finding and resuming them. Nothing is imported here:
importing one module loads only the modules it uses (torch only host_copy.py, at import).

- files.py: the files of a checkpoint directory: names (step_N/, `latest`, manifest.json, ...),
  the format number, the manifest read back, checksums, fsync, file modes, sizes on disk.
- manager.py: `CheckpointManager`: save (atomic, in phases; also in the background), restore,
  rotation (keep_checkpoints), listing, setting a damaged one aside; `CheckpointWriteError`.
- background.py: `BackgroundSave`, a checkpoint written by a thread while training goes on.
- host_copy.py: host-memory copies of the state dicts a background save writes.
- write_stall.py: what a background write costs training (`StallWatch`), and whether the
  installed safetensors writes without holding the GIL.
- verify.py: whether a checkpoint can be used: complete, matching its manifest, safe to load
  (`verify`), of a format this version resumes (`resume_refusal`); its counters read back.
- safe_load.py: the allowlists for what loading a checkpoint may unpickle (`unsafe_content`).
- locate.py: finding the checkpoint to use (`resolve_resume`, `find_checkpoint`), and why a
  path holds none, with the did-you-mean of paths (`path_problem`).
- saved_config.py: the config stored with a checkpoint against the run's: `config_hash`,
  `changed_on_resume`, `saved_derived`.
- resume.py: resuming a run: which checkpoint (on rank 0), whether the config may continue
  it, the batch plan it used, the LR-schedule warning.
- checkpointer.py: when the run saves, synchronously or in the background, what a failed save
  means, each save's metrics row and the preemption-window warning.
- stop_window.py: the preemption window (`checkpoint_window_s`, or the SLURM job's --signal).
- train_state.py: the run's counters (`TrainState`), stored as train_state.json.
"""
