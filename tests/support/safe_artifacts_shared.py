"""What tests/unit/test_safe_artifacts.py and tests/e2e/test_safe_artifacts.py share."""


import os

from fp8train.checkpoint.safe_load import TE_EXTRA_STATE_GLOBALS, _check_pickle, _Unsafe


class RunsCommand:
    """Unpickling this runs a shell command (os.system)."""

    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


class OpensFile:
    """Unpickling this creates a file (open, pickled as io.open)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _payloads(marker):
    """What a crafted file holds, and the global its refusal names. custom_checkpoint_0.pkl was
    the training state of format 1 (Accelerate unpickled it with weights_only=False); a stray
    pickle like it in a checkpoint is checked like the checkpoint's own files."""
    return {"random_states_0.pkl": ({"random_state": RunsCommand(f"touch '{marker}'")},
                                    "posix.system"),
            "optimizer.bin": ({"state": {0: {"exp_avg": RunsCommand(f"touch '{marker}'")}},
                               "param_groups": []}, "posix.system"),
            "model.safetensors": (RunsCommand(f"touch '{marker}'"), "posix.system"),
            "custom_checkpoint_0.pkl": (OpensFile(str(marker)), "io.open")}


def _why(data, allowed=TE_EXTRA_STATE_GLOBALS):
    try:
        _check_pickle(data, allowed)
    except _Unsafe as e:
        return str(e)
    return None
