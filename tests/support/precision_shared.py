"""What tests/unit/test_precision.py and tests/e2e/test_precision.py share."""


import torch

from fp8train.model import GPT, model_config_from

CPU = torch.device("cpu")


def tiny_model(**kw):
    return GPT(model_config_from("tiny", 256, 64, **kw))
