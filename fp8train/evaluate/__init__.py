"""A model's quality, during training and after it, and a trained run put to use. Nothing is
imported here: importing one module loads only the modules it uses.

- evaluation.py  the validation loss over batches (every rank its share).
- evaluator.py   the training loop's component: when to evaluate, the target, samples.
- samples.py     text samples, during training (`TextSampler`) and after it.
- hellaswag.py   HellaSwag's acc and acc_norm (summed and per-token completion loss), during
                 training and after it.
- hellaswag_data.py  HellaSwag's examples read and checked without torch (the preflight's): the
                 jsonl, the hub's parquet, or the hub through datasets (its cache offline).
- trained.py     a finished run or checkpoint loaded for evaluation, sampling and export.
- hf_export.py   export to a HuggingFace transformers model, checked against ours.
"""
