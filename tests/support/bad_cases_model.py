"""Bad-input cases: an hf: model (docs/hf_models.md). See tests/e2e/test_bad_input.py for how a
case is run and judged.

A model that cannot be loaded offline, a vocabulary that cannot hold the data's ids, a context
longer than the model was built for, and FP8 on projections that are not nn.Linear (transformers'
GPT-2 computes them in Conv1D): each one line, exit 2, before step 1. (The preset keys and
init_from refused with the wrong kind of model: the table in config/requires.py, walked by
tests/unit/test_config.py.)"""
import json

from support.bad_input_kit import OFFLINE_TOKENIZERS, Case

# A seconds-long run on the corpus file; no preset keys (they are refused with an hf: model).
HF_RUN = ["--dataset={corpus}", "--seq_len=32", "--batch_size=2", "--max_steps=2",
          "--warmup_steps=0", "--eval_sequences=4", "--eval_samples=0", "--output_dir={d}/out"]


def _config(**kw) -> str:
    """A tiny config.json of transformers' family `model_type`."""
    return json.dumps(dict(kw, bos_token_id=0, eos_token_id=0))


GPT2 = _config(model_type="gpt2", vocab_size=320, n_embd=64, n_layer=1, n_head=4,
               n_positions=64)
SMALL_VOCAB = _config(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=64)
SHORT = _config(model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=128,
                num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=16)

CASES = [
    Case("hf-model-not-downloaded", ["--model=hf:some-org/not-downloaded", *HF_RUN],
         prefix="bare", env=OFFLINE_TOKENIZERS,
         expect=("cannot load model config 'some-org/not-downloaded'",
                 "offline mode is set (HF_HUB_OFFLINE=1)")),
    Case("hf-model-directory-without-config", ["--model=hf:{d}/empty", *HF_RUN], prefix="bare",
         files={"empty/README.md": "no config here\n"},
         expect="cannot load model config '{d}/empty'"),
    Case("hf-model-vocabulary-too-small", ["--model=hf:{d}/m", *HF_RUN], prefix="bare",
         files={"m/config.json": SMALL_VOCAB},
         expect="model 'hf:{d}/m' has 128 token ids, but the data's tokenizer 'byte' has 256"),
    Case("hf-model-context-too-short", ["--model=hf:{d}/m", *HF_RUN], prefix="bare",
         files={"m/config.json": SHORT},
         expect="seq_len 32 is longer than model 'hf:{d}/m' was built for "
                "(max_position_embeddings 16)"),
    Case("hf-model-fp8-on-conv1d", ["--model=hf:{d}/m", "--use_fp8", "--fp8_backend=native",
                                    *HF_RUN], prefix="bare", files={"m/config.json": GPT2},
         expect=("computes its projections in layers that are not nn.Linear",
                 "0.attn.c_attn (Conv1D)")),
]
