"""What tests/unit/test_fp8_policy.py and tests/e2e/test_fp8_policy.py share."""


import torch

CPU = torch.device("cpu")


WINS = (64, 128, True)       # FP8 2x faster
