"""Bad-input cases: run. See tests/e2e/test_bad_input.py for how a case is run and judged.

The run directory's own files: something in the way of train.log, metrics.jsonl,
samples.jsonl or summary.json is found when the run starts (exit 2), not as a warning and lost
rows later; a metrics.jsonl that is not this trainer's is refused, never silently trimmed."""
from support.bad_input_kit import DIR, Case

_IS_A_DIRECTORY = "is a directory: the run writes its {name} there"
_NOT_OURS = "line {line} is not a row this trainer writes"

CASES = [
    *(Case(f"run-{name.split('.')[0].replace('_', '-')}-is-a-directory", [],
           files={f"out/{name}": DIR},
           expect=("'{d}/out/" + name + "'", _IS_A_DIRECTORY.format(name=name)))
      for name in ("train.log", "metrics.jsonl", "samples.jsonl", "summary.json")),
    Case("run-metrics-rows-not-objects", [], files={"out/metrics.jsonl": "[1, 2]\n"},
         expect=("'{d}/out/metrics.jsonl'", _NOT_OURS.format(line=1))),
    Case("run-metrics-garbage-before-rows", [],
         files={"out/metrics.jsonl": 'hello\n{"step": 1, "train/loss": 3.0}\n'},
         expect=("'{d}/out/metrics.jsonl'", _NOT_OURS.format(line=1))),
    Case("run-metrics-step-not-a-number", [],
         files={"out/metrics.jsonl": '{"step": "one", "train/loss": 3.0}\n'},
         expect=("'{d}/out/metrics.jsonl'", _NOT_OURS.format(line=1))),
    Case("run-samples-rows-not-objects", [], files={"out/samples.jsonl": '"text"\n'},
         expect=("'{d}/out/samples.jsonl'", _NOT_OURS.format(line=1))),
]
