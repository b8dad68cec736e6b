"""train_fp8.py that writes, once the first training step is done, what torch.compile built so
far (dynamo's own counters: frames and graphs) to the JSON file named by $FP8TRAIN_GRAPHS_JSON,
installed from outside the package: the tests of `compile: true` see that the run's steps ran
compiled, not silently eager."""
import json
import os
import sys

ENV = "FP8TRAIN_GRAPHS_JSON"


def install(path: str) -> None:
    from fp8train.train.loop import Trainer
    first_step = Trainer.first_step

    def counted(self, started, logged):
        import torch
        counters = torch._dynamo.utils.counters
        with open(path, "w") as fh:
            json.dump({"frames": counters["frames"]["ok"],
                       "graphs": counters["stats"]["unique_graphs"]}, fh)
        return first_step(self, started, logged)

    Trainer.first_step = counted


if __name__ == "__main__":
    install(os.environ[ENV])
    from fp8train.train.cli import main
    sys.exit(main())
