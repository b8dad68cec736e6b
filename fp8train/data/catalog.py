"""The datasets and file kinds the data code knows by name, in one place that every data module
(sources.py while the config is validated, the loader, the prepare pipeline) imports without
importing another: no imports at all."""

KNOWN = {  # name -> (hub path, config, split, text field): prepared from the hub
    "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", "text"),
    "openwebtext": ("Skylion007/openwebtext", None, "train", "text"),
}
PREPARED = tuple(KNOWN)   # known datasets that exist only as prepared shards
# The local files scripts/prepare_data.py reads: extension -> the `datasets` builder.
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
