"""Data: what `dataset` names, the tokens a run trains on, and the prepared-shard pipeline.

- sources.py     what `dataset` names, decided by the preflight check (standard library
                 only): files that are not plain text refused with the command that prepares them
- catalog.py     the known hub datasets and the local file kinds prepare reads (no imports)
- tokenizers.py  every tokenizer (bytes, tiktoken GPT-2, any HF AutoTokenizer), one interface
- corpus.py      the text file behind a text dataset; tinyshakespeare downloaded and checked
- shards.py      the token-shard format on disk, meta.json, the token-id scan
- loader.py      the run's train and val tokens: prepared shards, a text corpus, synthetic
- windows.py     windows of seq_len + 1 tokens: the training order, validation windows, the
                 prefetching batch stream
- prepare.py     text datasets -> token shards (scripts/prepare_data.py): the pipeline
- documents.py   the documents prepare reads, through `datasets`
- output_dir.py  prepare's output directory: its files, resuming, refusing other arguments
"""
