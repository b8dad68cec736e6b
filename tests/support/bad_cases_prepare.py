"""Bad-input cases: prepare. See tests/e2e/test_bad_input.py for how a case is run and judged.
The bad inputs of scripts/prepare_data.py itself are in tests/e2e/test_prepare.py."""
from support.bad_input_kit import DEAD_PROXY, Case

# An empty HuggingFace cache of the case's own: a tokenizer cached elsewhere cannot make a
# case pass.
EMPTY_HF_CACHE = {"HF_HOME": "{d}/hf", "HF_HUB_CACHE": "{d}/hf/hub"}

CASES = [
    # Offline, or with the hub unreachable, a tokenizer that is not cached fails at once in one
    # line: not a minute of retries, a line each.
    Case("tokenizer-gpt2-offline", ["--tokenizer=gpt2"],
         env={"FP8TRAIN_OFFLINE": "1", **EMPTY_HF_CACHE},
         expect="key 'tokenizer': cannot load tokenizer 'gpt2' (not in the local HuggingFace "
                "cache, and offline mode is set (FP8TRAIN_OFFLINE=1)"),
    Case("tokenizer-gpt2-transformers-offline", ["--tokenizer=gpt2"],
         env={"TRANSFORMERS_OFFLINE": "1", **EMPTY_HF_CACHE},
         expect="offline mode is set (TRANSFORMERS_OFFLINE=1)"),
    Case("tokenizer-gpt2-hub-unreachable", ["--tokenizer=gpt2"],
         env={**DEAD_PROXY, **EMPTY_HF_CACHE},
         expect="key 'tokenizer': cannot load tokenizer 'gpt2' (not in the local HuggingFace "
                "cache, and the hub cannot be reached: https://huggingface.co: "),
    Case("tokenizer-path-missing", ["--tokenizer={d}/no/such/tokenizer"], env=DEAD_PROXY,
         expect="key 'tokenizer': cannot load tokenizer '{d}/no/such/tokenizer' (no such "
                "directory)"),
]
