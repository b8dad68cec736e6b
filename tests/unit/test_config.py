"""The config contract: strict keys, types and ranges, CLI overrides, one-line errors."""


import glob
import os

import pytest
import yaml
from support.config_shared import write
from support.runs import ROOT

from fp8train.batch.plan import BatchPlan, manual_plan
from fp8train.config import load as C
from fp8train.config.load import load_config, section
from fp8train.errors import BadInput


def test_unknown_key_suggests_the_right_one(tmp_path):
    path = write(tmp_path, "lerning_rate: 0.1\n")
    with pytest.raises(BadInput) as e:
        load_config(["--config", path])
    assert str(e.value) == f"unknown key 'lerning_rate' in {path} (did you mean 'learning_rate'?)"


def test_unknown_cli_option_suggests_the_right_one():
    with pytest.raises(BadInput, match=r"unknown option '--warmup_step' in the command line "
                                          r"\(did you mean '--warmup_steps'\?\)"):
        load_config(["--warmup_step", "5"])


@pytest.mark.parametrize("text,key", [
    ("learning_rate: fast\n", "learning_rate"),
    ("learning_rate: -0.1\n", "learning_rate"),
    ("seq_len: 1.5\n", "seq_len"),
    ("use_fp8: maybe\n", "use_fp8"),
    ("fp8_backend: cuda\n", "fp8_backend"),
    ("batch_size: 0\n", "batch_size"),
    ("min_lr_ratio: 2\n", "min_lr_ratio"),
    ("batch_size: true\n", "batch_size"),
    ("model: gpt5\n", "model"),
    ("warmup_steps: 100\nmax_steps: 100\n", "warmup_steps"),
    ("penalty_weight: 0.1\n", "penalty_weight"),
    ("max_steps: null\nnum_epochs: null\n", "num_epochs"),
    ("seed: {a: 1}\n", "seed"),
    ("seed: 4294967296\n", "seed"),
])
def test_bad_values_name_file_and_key(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(BadInput) as e:
        load_config(["--config", path])
    msg = str(e.value)
    assert path in msg and f"'{key}'" in msg and "\n" not in msg


def test_float_literals_without_a_dot_are_numbers(tmp_path):
    # PyYAML (YAML 1.1) reads 3e-3 as a string; config files are read as YAML 1.2.
    cfg = load_config(["--config", write(tmp_path, "learning_rate: 3e-3\n")])
    assert cfg.learning_rate == pytest.approx(0.003)


def test_yaml_scalars_mean_what_yaml_1_2_says(tmp_path):
    """The YAML 1.1 surprises PyYAML has by default: on/no/yes are text, 010 is ten, an
    integral float is the integer, -0.0 is 0.0, and a byte-order mark is harmless."""
    path = tmp_path / "x.yaml"
    path.write_bytes("\ufeffuse_wandb: true\nwandb_project: on\nwandb_run_name: no\nseed: 010\n"
                     "max_steps: 1e3\nwarmup_steps: 3.0\ndropout: -0.0\n"
                     "wandb_tags: [2024-01-01, v1]\n".encode("utf-8"))
    cfg = load_config(["--config", str(path)])
    assert (cfg.wandb_project, cfg.wandb_run_name, cfg.seed) == ("on", "no", 10)
    assert (cfg.max_steps, cfg.warmup_steps) == (1000, 3)
    assert isinstance(cfg.max_steps, int) and str(cfg.dropout) == "0.0"
    assert cfg.wandb_tags == ["2024-01-01", "v1"]


def test_duplicate_keys_are_refused_in_any_yaml_the_project_reads(tmp_path):
    with pytest.raises(BadInput, match=r"line 4: key 'values' is given twice \(first on "
                                          r"line 3\)"):
        C.read_yaml(write(tmp_path, "parameters:\n  lr:\n    values: [1]\n    values: [2]\n"))


def test_command_line_spellings_and_last_wins_with_its_origin():
    cfg = load_config(["--seq-len", "64", "--use_fp8", "FALSE", "--seq_len=128",
                       "--max_steps=0x10", "--warmup_steps=2"])
    assert (cfg.seq_len, cfg.use_fp8, cfg.max_steps) == (128, False, 16)
    assert cfg.where("seq_len") == "--seq_len=128"
    assert cfg.where("use_fp8", "seed") == "--use_fp8=FALSE"   # seed: a default
    assert cfg.where("seed") == "<defaults>"


def test_help_shows_each_keys_type_and_default_in_100_columns():
    text = C.help_text()
    long = [line for line in text.splitlines() if len(line) > 100]
    assert not long, long
    assert "  --seq_len INT >= 8  [default: 1024]" in text
    assert "  --learning_rate FLOAT > 0.0  [default: 0.0006]" in text
    assert "  --use_fp8 BOOL  [default: false]" in text
    assert "  --max_steps INT >= 1 (or null)  [default: null]" in text
    assert "  --precision {auto|bf16|fp32|fp16}  [default: auto]" in text
    for key in C.KEYS:     # the key's own lines: its type, default and doc
        own = text.split(f"\n  --{key} ")[1].split("\n  --")[0].split("\n\n")[0]
        assert "[default: " in own and C.KEYS[key].metadata["doc"][:30] in own, key


def test_every_script_ends_through_the_broken_pipe_guard():
    """The others as written: each entry point runs its main through console.run_main."""
    for path in sorted((ROOT / "scripts").glob("*.py")) + [ROOT / "run_sweep.py",
                                                           ROOT / "train_fp8.py"]:
        tail = path.read_text().rsplit('if __name__ == "__main__":', 1)[1]
        assert "run_main(main)" in tail, path.name


def test_cli_overrides_yaml_in_both_spellings(tmp_path):
    path = write(tmp_path, "learning_rate: 0.1\nseq_len: 64\nuse_fp8: true\n")
    cfg = load_config(["--config", path, "--learning_rate=2e-4", "--seq_len", "32", "--no_fp8",
                       "--use_wandb", "--wandb_tags", "a,b", "--resume", "--compile",
                       "--max_steps=null"])
    assert (cfg.learning_rate, cfg.seq_len, cfg.use_fp8) == (2e-4, 32, False)
    assert cfg.wandb_tags == ["a", "b"] and cfg.resume == "auto" and cfg.compile is True
    assert cfg.max_steps is None
    cfg = load_config(["--config", path, "--use_fp8", "false", "--seed", "7"])
    assert cfg.use_fp8 is False and cfg.seed == 7
    # the last occurrence wins, as with any command line
    assert load_config(["--seed", "1", "--seed=2"]).seed == 2


def test_cli_errors():
    with pytest.raises(BadInput, match="'--seq_len' needs a value"):
        load_config(["--seq_len"])
    with pytest.raises(BadInput, match="unexpected argument 'stray'"):
        load_config(["stray"])
    with pytest.raises(BadInput, match="the command line: key 'seq_len'"):
        load_config(["--seq_len=abc"])


def test_defaults_output_dir_from_config_name_and_data_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8TRAIN_DATA_DIR", "/some/data")
    cfg = load_config(["--config", write(tmp_path, "seed: 1\n", name="my_run.yaml")])
    assert cfg.output_dir == os.path.join("runs", "my_run") and cfg.data_dir == "/some/data"
    monkeypatch.delenv("FP8TRAIN_DATA_DIR")
    assert load_config([]).data_dir == "data"


@pytest.mark.parametrize("path", sorted(
    p for p in glob.glob(str(ROOT / "configs" / "**" / "*.yaml"), recursive=True)
    if os.sep + "sweeps" + os.sep not in p))   # sweep files: tests/e2e/test_sweep.py
def test_every_shipped_config_loads_and_validates(path):
    cfg = load_config(["--config", path])
    raw = yaml.safe_load(open(path))
    for key, value in raw.items():  # every value in the file reached the config
        got = getattr(cfg, key)
        if (key, value) == ("tokenizer", "model"):   # the hf: model's own, by its id
            value = cfg.model[len("hf:"):]
        assert got == value or (isinstance(value, float) and got == pytest.approx(value)), key


def test_shipped_configs_cover_the_documented_ones():
    names = {os.path.basename(p) for p in glob.glob(str(ROOT / "configs" / "*.yaml"))}
    assert {"test_fp8.yaml", "fineweb_edu_fp8.yaml", "fineweb_edu_bf16.yaml",
            "openwebtext_adaptive_batch.yaml", "test_auto_batch.yaml"} <= names
    fp8 = load_config(["--config", str(ROOT / "configs" / "fineweb_edu_fp8.yaml")])
    assert (fp8.dataset, fp8.target_effective_batch_size, fp8.max_batch_size) == \
        ("fineweb-edu", 512, 128)
    assert (fp8.learning_rate, fp8.warmup_steps, fp8.num_epochs, fp8.min_lr_ratio) == \
        (3e-3, 2000, 2, 0.0)
    assert (fp8.optimizer, fp8.muon_lr, fp8.lr_schedule, fp8.lr_decay_fraction) == \
        ("muon", 0.02, "wsd", 0.3)
    assert (fp8.use_fp8, fp8.fp8_format, fp8.fp8_margin) == (True, "hybrid", 0)


def test_written_config_loads_back_identically(tmp_path):
    cfg = load_config(["--config", str(ROOT / "configs" / "test_fp8.yaml"), "--use_wandb",
                       "--wandb_tags=x",
                       "--output_dir", str(tmp_path / "run")])
    path = tmp_path / "config.yaml"
    path.write_text(C.dump_yaml(cfg, {"micro_batch_size": 16, "world_size": 1}))
    again = load_config(["--config", str(path)])
    assert C.to_dict(again) == C.to_dict(cfg)


def test_text_that_reads_as_a_number_is_written_quoted_and_loads_back_as_text(tmp_path):
    """YAML 1.2 reads a plain `3e-4` as a number where PyYAML's 1.1 dumper would leave it
    plain: the run's config.yaml must still load as the text it was."""
    given = tmp_path / "given.yaml"
    given.write_text("use_wandb: true\nwandb_run_name: '3e-4'\n"
                     "wandb_tags: [lr, '3e-4', '0o7', 'yes', '10']\n")
    cfg = load_config(["--config", str(given)])
    assert cfg.wandb_run_name == "3e-4" and cfg.wandb_tags == ["lr", "3e-4", "0o7", "yes", "10"]
    path = tmp_path / "config.yaml"
    path.write_text(C.dump_yaml(cfg, {"note": "1e5"}))
    again = load_config(["--config", str(path)])
    assert C.to_dict(again) == C.to_dict(cfg)
    assert yaml.load(path.read_text(), Loader=C.StrictLoader)["derived"]["note"] == "1e5"


def plan_for(world, **kw):
    return manual_plan(section(load_config([f"--{k}={v}" for k, v in kw.items()]), "batch"),
                       world)


def test_manual_batch_plan():
    assert plan_for(1, batch_size=8) == BatchPlan(8, 1, 1)
    assert plan_for(8, batch_size=16, target_effective_batch_size=512) == BatchPlan(16, 4, 8)
    assert plan_for(2, batch_size=4, gradient_accumulation_steps=3,
                    target_effective_batch_size=24).effective == 24
    with pytest.raises(BadInput, match="nearest valid: 384 or 512"):
        plan_for(8, batch_size=16, target_effective_batch_size=500)
    with pytest.raises(BadInput, match="= 32, but target_effective_batch_size is 64"):
        plan_for(1, batch_size=16, gradient_accumulation_steps=2, target_effective_batch_size=64)


def test_config_reference_documents_every_key():
    reference = (ROOT / "docs" / "config.md").read_text()
    missing = [k for k in C.KEYS if f"| `{k}` |" not in reference]
    assert not missing, f"keys missing from docs/config.md's key tables: {missing}"


def test_warmup_longer_than_an_epoch_driven_run_is_shortened():
    from fp8train.train.plan import run_length
    cfg = load_config(["--dataset=synthetic", "--num_epochs=1"])     # warmup: the default 2000
    sched = run_length(cfg, train_tokens=50 * 8 * cfg.seq_len, plan=BatchPlan(8, 1, 1))
    assert (sched.total_steps, sched.lr_steps, sched.warmup_steps) == (50, 50, 5)
    assert sched.warmup_note == ("warmup_steps (2000, the default) is not shorter than the run's "
                                 "50 steps: warming up for 5 steps instead (10% of the schedule)")
    cfg = load_config(["--dataset=synthetic", "--warmup_steps=4"])
    assert run_length(cfg, 50 * 8 * cfg.seq_len, BatchPlan(8, 1, 1)).warmup_note == ""


def test_fp8_recipe_defaults_per_backend_and_is_recorded_resolved(tmp_path):
    """fp8_recipe unset means the backend's own default, and config.yaml records which."""
    from fp8train.config.schema import FP8_RECIPES
    assert {b: C.Config(fp8_backend=b).fp8_recipe for b in FP8_RECIPES} == \
        {"te": "delayed", "torchao": "tensorwise", "native": "delayed"}
    cfg = load_config(["--config", "configs/test_fp8.yaml", f"--output_dir={tmp_path}"])
    assert (cfg.fp8_backend, cfg.fp8_recipe) == ("native", "delayed")
    assert "fp8_recipe: delayed" in C.dump_yaml(cfg).splitlines()


def test_a_saved_config_from_before_recipes_per_backend_resumes_unchanged(tmp_path):
    """config.yaml files written before fp8_recipe covered every backend recorded torchao's
    default 'tensorwise' under te and native too; resuming such a run is no config change, while
    a real recipe change still is."""
    from fp8train.checkpoint.saved_config import changed_on_resume
    from fp8train.config.schema import to_dict
    old = to_dict(C.Config(use_fp8=True, fp8_backend="te"))
    old["fp8_recipe"] = "tensorwise"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    now = to_dict(C.Config(use_fp8=True, fp8_backend="te"))
    assert changed_on_resume(str(tmp_path), now) == []
    now["fp8_recipe"] = "current"
    assert changed_on_resume(str(tmp_path), now) == ["fp8_recipe 'delayed' -> 'current'"]


def test_fp8_until_as_a_step_is_a_whole_number(tmp_path):
    with pytest.raises(BadInput, match=r"key 'fp8_until' \(12.5\) is a step from 1 on, so a "
                                       "whole number"):
        load_config(["--config", str(ROOT / "configs" / "test_fp8.yaml"), "--fp8_until=12.5"])
    assert load_config(["--config", str(ROOT / "configs" / "test_fp8.yaml"),
                        "--fp8_until=0.8"]).fp8_until == 0.8


# --- keys that apply only with others (fp8train/config/requires.py) ---------------------------

# A value of each key that is not its default, where the first that differs would not do.
EXAMPLES = {"fp8_recipe": "current", "fp8_until": 0.5, "fp8_fsdp_all_gather": True,
            "probe_memory_limit_gb": 1.0, "hellaswag_path": "h.jsonl", "n_embd": 256,
            "ffn_hidden_size": 1024}


def example(key):
    """A valid value of `key` other than its default (EXAMPLES, else the next one the key
    allows)."""
    from fp8train.config.schema import base_type, default_of
    from fp8train.config.values import coerce
    if key in EXAMPLES:
        return EXAMPLES[key]
    f = C.KEYS[key]
    d, base = default_of(f), base_type(f)
    if f.metadata.get("choices"):
        return next(c for c in f.metadata["choices"] if c != d)
    candidates = {"bool": lambda: [not d], "str": lambda: ["x"], "list": lambda: [["x"]],
                  "int": lambda: [(d or 0) + 1, (d or 0) + 2],
                  "float": lambda: [d * 2 if d else 0.5, d / 2 if d else 0.25]}[base]()
    for value in candidates:
        try:
            return coerce(f, value, "test")
        except BadInput:
            pass
    raise AssertionError(f"no example value for {key}: add one to EXAMPLES")


def _walk():
    from fp8train.config.requires import RULES
    return [pytest.param(rule, key, id=f"{key}-needs-{'+'.join(rule.on)}")
            for rule in RULES for key in rule.keys]


def _yaml(values) -> str:
    return yaml.safe_dump(values, sort_keys=False)


@pytest.mark.parametrize("rule,key", _walk())
def test_every_key_of_the_table_is_refused_where_it_would_do_nothing(tmp_path, rule, key):
    """Each key of each rule: accepted where its rule holds; refused in one line naming the key
    and the keys it needs when they say otherwise in the same place (a file) or earlier
    (defaults, the file under the key's own command-line option); accepted when they are
    switched off later (the command line over the file), as --no_fp8 is."""
    from fp8train.config.requires import rules_of
    value = example(key)
    holds = {k: v for r in rules_of(key) for k, v in r.when.items()}
    file = write(tmp_path, _yaml({key: value, **holds}))
    assert load_config(["--config", file]) is not None
    # under `off`, what the key's other rules need is left out when this rule covers it too
    # (fp8_max_loss_gap needs fp8_check_interval, which needs use_fp8 as well)
    holds = {k: v for k, v in holds.items() if k not in rule.keys}
    inert = write(tmp_path, _yaml({key: value, **holds, **rule.off}), "inert.yaml")
    with pytest.raises(BadInput) as e:
        load_config(["--config", inert])
    msg = str(e.value)
    assert msg.startswith(f"{inert}: key '{key}' (") and "\n" not in msg, msg
    assert all(k in msg.split("applies only with", 1)[1] for k in rule.on), msg
    later = [f"--{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
             for k, v in rule.off.items()]
    cfg = load_config(["--config", file, *later])
    assert not rule.holds(cfg) and getattr(cfg, key) == value
    earlier = write(tmp_path, _yaml({**holds, **rule.off}), "earlier.yaml")
    typed = f"--{key}={yaml.safe_dump(value, default_flow_style=True).strip()}"
    typed = typed.removesuffix("\n...")
    with pytest.raises(BadInput, match=f"^--{key}=.*key '{key}'"):
        load_config(["--config", earlier, typed])
    with pytest.raises(BadInput, match=f"key '{key}'"):   # one command line: one place
        load_config(["--config", file, typed, *later])


def test_a_backend_switched_later_switches_the_delayed_scaling_keys_with_it(tmp_path):
    """fp8_margin in a TE config under `--fp8_backend=torchao` (whose recipe defaults to
    tensorwise): a deliberate switch, accepted; the same in one file is refused, naming the
    recipe it takes."""
    te = write(tmp_path, _yaml({"use_fp8": True, "fp8_backend": "te", "fp8_margin": 1}))
    cfg = load_config(["--config", te, "--fp8_backend=torchao"])
    assert (cfg.fp8_recipe, cfg.fp8_margin) == ("tensorwise", 1)
    ao = write(tmp_path, _yaml({"use_fp8": True, "fp8_backend": "torchao", "fp8_margin": 1}),
               "ao.yaml")
    with pytest.raises(BadInput, match=r"key 'fp8_margin' \(1\) applies only with delayed "
                                       r"scaling .*but fp8_recipe is 'tensorwise', so it would "
                                       r"do nothing; remove it or change fp8_recipe$"):
        load_config(["--config", ao])


def test_fp8_until_1_in_a_runs_own_config_keeps_its_old_meaning_with_a_warning(tmp_path):
    """A run's config.yaml written when fp8_until: 1 meant step 1 still loads (as a step, said
    in a warning at start); typed or in a config file of the user's, 1 is refused."""
    from fp8train.train.plan import run_length
    values = dict(C.to_dict(load_config(["--config", str(ROOT / "configs" / "test_fp8.yaml")])),
                  fp8_until=1, derived={"world_size": 1})
    own = write(tmp_path, _yaml(values), "config.yaml")
    cfg = load_config(["--config", own])
    assert cfg.fp8_until == 1
    note = run_length(cfg, 10**6, manual_plan(section(cfg, "batch"), 1)).fp8_until_note
    assert note.startswith("key 'fp8_until' is 1 in the run's own config.yaml") and \
        "first step only" in note
    mine = write(tmp_path, _yaml({"use_fp8": True, "fp8_until": 1}), "mine.yaml")
    with pytest.raises(BadInput, match="key 'fp8_until' is 1, which would read as step 1"):
        load_config(["--config", mine])


def test_the_table_covers_whole_families_and_every_key_documented_as_conditional():
    """A new fp8_*, muon_*, wandb_* or hellaswag_* key joins its family's rule by its name; a
    key whose doc opens with the value or key it depends on ("muon: ...", "wsd: ...",
    "fp8_layers auto: ...") must be in a rule too."""
    import re

    from fp8train.config.requires import rules_of
    needs = {"fp8_": "use_fp8", "muon_": "optimizer", "wandb_": "use_wandb",
             "hellaswag_": "hellaswag_interval"}
    for key in C.KEYS:
        for prefix, on in needs.items():
            if key.startswith(prefix) and key != on:
                assert any(on in r.on for r in rules_of(key)), key
    words = set(C.KEYS) | {c for f in C.KEYS.values() for c in f.metadata.get("choices") or ()}
    for key, f in C.KEYS.items():
        m = re.match(r"([\w-]+)[\w ]*: ", f.metadata["doc"])
        if m and m.group(1) in words:
            assert rules_of(key), f"{key}'s doc says it depends on {m.group(1)}: add a rule"


def test_a_runs_own_config_yaml_loads_back_whatever_was_switched_off_on_its_command_line(
        tmp_path):
    """--no_fp8 over an FP8 config is accepted; the run's config.yaml then holds FP8 keys with
    use_fp8: false in one file, and loads back all the same."""
    cfg = load_config(["--config", str(ROOT / "configs" / "fineweb_edu_fp8.yaml"), "--no_fp8"])
    assert (cfg.use_fp8, cfg.fp8_check_interval) == (False, 100)
    path = tmp_path / "config.yaml"
    path.write_text(C.dump_yaml(cfg, {"micro_batch_size": 16}))
    assert C.to_dict(load_config(["--config", str(path)])) == C.to_dict(cfg)
    with pytest.raises(BadInput, match="^--fp8_until=0.5, .*config.yaml: key 'fp8_until'"):
        load_config(["--config", str(path), "--fp8_until=0.5"])


@pytest.mark.parametrize("args,expect", [
    (["--fp8_until=1"], "--fp8_until=1: key 'fp8_until' is 1, which would read as step 1: FP8 "
                        "for one step"),
    (["--fp8_until=500"], "--fp8_until=500, {cfg}: key 'fp8_until' (500) hands FP8 over at "
                          "step 500, but the run ends at step 500 (max_steps)"),
    (["--lr_decay_steps=1000", "--fp8_until=0.6"], "key 'fp8_until' (0.6) hands FP8 over at "
                                                   "step 600 (0.6 of lr_decay_steps 1,000)"),
    (["--no_fp8", "--fp8_until=0.8"], "key 'fp8_until' (0.8) applies only with use_fp8: true"),
    (["--fp8_check_interval=10", "--no_fp8"], "key 'fp8_check_interval' (10) applies only with "
                                              "use_fp8: true, but use_fp8 is false"),
    (["--fp8_gap_action=recover"], "key 'fp8_gap_action' ('recover') applies only with "
                                   "fp8_check_interval above 0"),
    (["--no_fp8", "--fp8_recipe=auto"], "key 'fp8_recipe' ('auto') applies only with use_fp8"),
    (["--optimizer=adamw", "--muon_momentum=0.9"], "key 'muon_momentum' (0.9) applies only "
                                                   "with optimizer: muon"),
    (["--lr_schedule=cosine", "--lr_decay_shape=1-sqrt"], "key 'lr_decay_shape' ('1-sqrt') "
                                                          "applies only with lr_schedule: wsd"),
    (["--hellaswag_path=h.jsonl"], "key 'hellaswag_path' ('h.jsonl') applies only with "
                                   "hellaswag_interval above 0"),
    (["--lr_schedule=wds"], "key 'lr_schedule' must be one of cosine, wsd, linear, got 'wds' "
                            "(did you mean 'wsd'?)"),
    (["--fp8_recipe=curent"], "got 'curent' (did you mean 'current'?)"),
    (["--fp8_backend=torchao", "--fp8_recipe=rowwis"], "did you mean 'rowwise'?"),
    (["--fp8_recipe=rowwise"], "key 'fp8_recipe' is 'rowwise', which fp8_backend 'native' does "
                               "not have; native accepts delayed | current"),
])
def test_the_issues_combinations_are_refused_in_one_line(args, expect):
    cfg = str(ROOT / "configs" / "test_fp8.yaml")
    with pytest.raises(BadInput) as e:
        load_config(["--config", cfg, *args])
    assert expect.format(cfg=cfg) in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_fp8_until_past_a_length_set_by_epochs_is_refused_or_warned_once_the_data_is_known(
        tmp_path):
    from fp8train.train.plan import run_length
    plan, tokens = BatchPlan(8, 1, 1), 50 * 8 * 1024       # 50 steps per epoch
    cfg = load_config(["--dataset=synthetic", "--use_fp8", "--warmup_steps=5", "--fp8_until=60"])
    with pytest.raises(BadInput, match=r"^--fp8_until=60: key 'fp8_until' \(60\) hands FP8 "
                                       r"over at step 60, but the run ends at step 50 "
                                       r"\(num_epochs 1 × 50 steps/epoch\)"):
        run_length(cfg, tokens, plan)
    assert run_length(load_config(["--dataset=synthetic", "--use_fp8", "--warmup_steps=5",
                                   "--fp8_until=40"]), tokens, plan).fp8_until_note == ""
    # A short run of a config with a cool-down: the length set later wins, with a warning.
    path = write(tmp_path, "dataset: synthetic\nuse_fp8: true\nwarmup_steps: 5\nfp8_until: 40\n")
    note = run_length(load_config(["--config", path, "--max_steps=20"]), tokens, plan) \
        .fp8_until_note
    assert note == (f"key 'fp8_until' (40) hands FP8 over at step 40, but the run ends at step "
                    f"20 (max_steps), so FP8 runs to the end ({path} set it before the run's "
                    f"length)")
