"""train_fp8.py with the faults named in FP8TRAIN_FAULTS installed first (support/faults.py): the
tests run this instead of train_fp8.py when they inject a fault."""
import os
import sys

# tests/, for support.faults
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from support.faults import Faults, install  # noqa: E402

install(Faults.from_env(int(os.environ.get("RANK", "0"))))

from fp8train.train.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
