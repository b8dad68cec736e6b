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
