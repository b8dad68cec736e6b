"""fp8train: YAML config -> GPT pretraining on Accelerate, in bf16 or FP8."""
__version__ = "0.1.0"
