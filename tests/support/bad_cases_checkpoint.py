"""Bad-input cases: checkpoint. See tests/e2e/test_bad_input.py for how a case is run and judged."""
import json

from support.bad_input_kit import DIR, Case

# A run directory with one checkpoint, as far as the config check can tell (it reads directory
# listings only): the neighbour that a mistyped path is pointed to.
RUN = {"runs/test_fp8/checkpoints/step_0000001/model.safetensors": b"x",
       "runs/test_fp8/config.yaml": "model: tiny\n"}
CK = "{d}/runs/test_fp8/checkpoints"


def newer_format(d):
    """The tiny run's newest checkpoint, intact, as a newer fp8train would mark it."""
    path = d / "trained" / "checkpoints" / "step_0000002" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "format": 3}))


CASES = [
    # --resume=PATH that names no checkpoint: what was looked for, and the neighbour that is one
    Case("resume-path-typo-did-you-mean", ["--resume={d}/runs/tst_fp8"], files=RUN,
         expect="key 'resume': checkpoint '{d}/runs/tst_fp8' not found (did you mean "
                "'{d}/runs/test_fp8'?); resume is auto, never or a path"),
    Case("resume-checkpoints-folder", [f"--resume={CK}"], files=RUN,
         expect=f"key 'resume': '{CK}' is not a checkpoint directory: it holds checkpoints "
                "(did you mean the run directory '{d}/runs/test_fp8'"),
    Case("resume-file-inside-a-checkpoint", [f"--resume={CK}/step_0000001/model.safetensors"],
         files=RUN, expect=f"is a file; name a checkpoint directory (checkpoints/step_N) or a "
                           f"run directory (did you mean its directory '{CK}/step_0000001'?)"),
    Case("resume-pruned-step", [f"--resume={CK}/step_0000005"], files=RUN,
         expect=f"checkpoint '{CK}/step_0000005' not found (did you mean "
                f"'{CK}/step_0000001'?)"),
    Case("resume-parent-of-runs", ["--resume={d}/runs"], files=RUN,
         expect="'{d}/runs' is not a checkpoint directory (nor a run directory with "
                "checkpoints/): it has no model.safetensors and no checkpoints/ (did you mean "
                "'{d}/runs/test_fp8'?)"),
    Case("resume-empty-directory", ["--resume={d}/empty"], files={"empty": DIR},
         expect="'{d}/empty' is not a checkpoint directory (nor a run directory with "
                "checkpoints/): it is empty"),
    Case("resume-run-that-saved-no-checkpoint", ["--resume={d}/crashed"],
         files={"crashed/train.log": "", "crashed/config.yaml": "model: tiny\n"},
         expect="key 'resume': run directory '{d}/crashed' holds no checkpoint (no checkpoints/ "
                "in it: the run saved none)"),
    Case("resume-checkpoint-without-model", ["--resume={d}/ck"],
         files={"ck/manifest.json": "{}\n", "ck/train_state.json": "{}\n"},
         expect="key 'resume': checkpoint '{d}/ck' has no model state"),
    Case("resume-keyword-typo", ["--resume=latest"],
         expect="key 'resume': checkpoint 'latest' not found; resume is auto, never or a path"),
    # found once the run starts
    Case("checkpoints-path-is-a-file", ["--resume"], files={"out/checkpoints": "x\n"},
         expect="'{d}/out/checkpoints' is a file"),
    # an intact checkpoint this version cannot resume is refused, named or found by auto
    Case("resume-checkpoint-of-a-newer-format",
         ["--output_dir={d}/new", "--resume={run}/checkpoints/step_0000002"], needs_run=True,
         setup=newer_format,
         expect="key 'resume': cannot resume from '{run}/checkpoints/step_0000002': it was "
                "written by a newer fp8train (checkpoint format 3"),
    Case("resume-auto-newest-of-a-newer-format", ["--output_dir={run}", "--resume"],
         needs_run=True, setup=newer_format,
         expect="cannot resume from '{run}/checkpoints/step_0000002': it was written by a "
                "newer fp8train (checkpoint format 3"),
]
