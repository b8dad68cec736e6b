"""What tests/unit/test_hellaswag.py and tests/e2e/test_hellaswag.py share: a small file in
HellaSwag's standard jsonl format, with four examples whose answers are known by hand."""
import json


def example(ctx, endings, label, **extra):
    return json.dumps({"ind": 0, "activity_label": "x", "ctx_a": ctx, "ctx_b": "", "ctx": ctx,
                       "endings": endings, "label": label, "split": "val", **extra})


# Four examples; the model picks the ending with the most "a"s per byte.
#  1: right (label 0 is all "a"s)        2: wrong (label 2, the model picks 0)
#  3: right: normalised, the long mostly-"a" ending (label 1) beats a short one whose SUM of
#     losses is lower ("b": 2 bytes), so an unnormalised score would pick 3
#  4: right, label given as a string, as the hub's copy has it
LINES = [example("Then", ["aaaa", "bbbb", "cccc", "dddd"], 0),
         example("So", ["aaab", "abbb", "bbbb", "bbba"], 2),
         example("A man", ["bbbbbbbbbbbb", "aaaaaaaaaaab", "bbbbbbbbbbba", "b"], 1),
         example("She", ["xyz", "qq", "aaaa", "zz"], "2")]


def write_hellaswag(folder) -> str:
    """LINES as `folder`/hellaswag_val.jsonl; returns its path."""
    path = folder / "hellaswag_val.jsonl"
    path.write_text("\n".join(LINES) + "\n")
    return str(path)


def datasets_cache(hf_home) -> str:
    """The copy of Rowan/hellaswag's validation split that `datasets` leaves in its cache after
    load_dataset("Rowan/hellaswag") on a machine with the hub (HF_HOME/datasets/
    Rowan___hellaswag/default/0.0.0/<hash>/hellaswag-validation.arrow and its
    dataset_info.json), holding LINES with labels as strings, as the hub has them. Built here
    by datasets' own parquet builder from the hub's parquet columns; run in a process of its
    own, as `datasets` reads its cache location when it is imported. Returns HF_HOME."""
    import os
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent(f"""
        import json, os, shutil
        import datasets, pyarrow as pa, pyarrow.parquet as pq
        rows = [json.loads(line) for line in {LINES!r}]
        for r in rows:
            r["label"] = str(r["label"])
        src = os.path.join({str(hf_home)!r}, "validation-00000-of-00001.parquet")
        os.makedirs({str(hf_home)!r}, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), src)
        b = datasets.load_dataset_builder("parquet", data_files={{"validation": src}},
                                          cache_dir=os.path.join({str(hf_home)!r}, "build"))
        b.download_and_prepare()
        dest = os.path.join({str(hf_home)!r}, "datasets", "Rowan___hellaswag", "default",
                            "0.0.0", os.path.basename(b.cache_dir))
        shutil.copytree(b.cache_dir, dest)
        os.rename(os.path.join(dest, "parquet-validation.arrow"),
                  os.path.join(dest, "hellaswag-validation.arrow"))
        info = json.load(open(os.path.join(dest, "dataset_info.json")))
        info.update(config_name="default", dataset_name="hellaswag")
        json.dump(info, open(os.path.join(dest, "dataset_info.json"), "w"))
        shutil.rmtree(os.path.join({str(hf_home)!r}, "build"))
        os.remove(src)
    """)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120,
                   capture_output=True)
    return str(hf_home)
