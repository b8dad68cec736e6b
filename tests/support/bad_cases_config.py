"""Bad-input cases: config. See tests/e2e/test_bad_input.py for how a case is run and judged.

Every way a config file or a command line can slip that PyYAML or a lenient parser would let
through: each one is refused before torch loads, in one line naming the file (and line) or the
option as typed."""
from support.bad_input_kit import Case, yaml_case

CASES = [
    # profile_steps: a pair of steps, the first not after the second ---------------------------
    Case("cli-profile-steps-reversed", ["--profile_steps=[5,3]"],
         expect="--profile_steps=[5,3] on the command line: key 'profile_steps' must be a pair "
                "of step numbers [START, END], 1 <= START <= END (or null), got [5, 3]"),
    yaml_case("config-profile-steps-from-zero", "profile_steps: [0, 2]\n",
              expect="{d}/x.yaml: key 'profile_steps' must be a pair of step numbers [START, "
                     "END], 1 <= START <= END (or null), got [0, 2]"),
    # FP8 recipes: each backend accepts its own; delayed-scaling keys only under delayed ------
    Case("cli-fp8-recipe-of-another-backend", ["--use_fp8", "--fp8_backend=te",
                                               "--fp8_recipe=rowwise"],
         expect="--fp8_recipe=rowwise, --fp8_backend=te: key 'fp8_recipe' is 'rowwise', which "
                "fp8_backend 'te' does not have; te accepts delayed | current | block"),
    yaml_case("config-fp8-recipe-tensorwise-under-te",
              "use_fp8: true\nfp8_backend: te\nfp8_recipe: tensorwise\n",
              expect=("{d}/x.yaml: key 'fp8_recipe' is 'tensorwise'",
                      "recorded torchao's default here, where it meant delayed scaling: remove "
                      "the line")),
    Case("cli-fp8-margin-under-current-scaling", ["--use_fp8", "--fp8_backend=native",
                                                  "--fp8_recipe=current", "--fp8_margin=1"],
         expect="--fp8_margin=1, --fp8_recipe=current: key 'fp8_margin' (1) applies only "
                "with delayed scaling (fp8_recipe: delayed, or auto, which times it), but "
                "fp8_recipe is 'current'"),
    yaml_case("config-fp8-history-under-block-scaling",
              "use_fp8: true\nfp8_recipe: block\nfp8_amax_history_len: 16\n",
              expect="{d}/x.yaml: key 'fp8_amax_history_len' (16) applies only with delayed "
                     "scaling (fp8_recipe: delayed, or auto, which times it), but fp8_recipe "
                     "is 'block'"),
    Case("cli-fp8-fsdp-all-gather-without-torchao", ["--use_fp8", "--fp8_backend=native",
                                                     "--fp8_fsdp_all_gather"],
         expect="key 'fp8_fsdp_all_gather' (true) applies only with fp8_backend: torchao "
                "and fp8_recipe: tensorwise, but fp8_backend is 'native', fp8_recipe is "
                "'delayed'"),
    # YAML that PyYAML reads without a word ----------------------------------------------------
    yaml_case("config-duplicate-key", "seq_len: 64\nbatch_size: 4\nseq_len: 128\n",
              expect="{d}/x.yaml: line 3: key 'seq_len' is given twice (first on line 1)"),
    yaml_case("config-merge-key", "base: &b {seq_len: 64}\n<<: *b\n",
              expect="{d}/x.yaml: line 2: merge keys (<<) are not supported"),
    yaml_case("config-explicit-tag-that-cannot-hold-the-value", "seq_len: !!int abc\n",
              expect="{d}/x.yaml: not valid YAML: invalid literal for int()"),
    Case("cli-explicit-tag-that-cannot-hold-the-value", ["--seq_len=!!int abc"],
         expect="--seq_len"),
    yaml_case("config-yes-for-bool", "use_fp8: yes\n",
              expect="{d}/x.yaml: key 'use_fp8' must be true or false, got 'yes'"),
    yaml_case("config-one-for-bool", "use_fp8: 1\n",
              expect="{d}/x.yaml: key 'use_fp8' must be true or false, got 1"),
    yaml_case("config-number-for-text", "wandb_run_name: 1e3\n",
              expect=("{d}/x.yaml: key 'wandb_run_name' must be a string",
                      "quote it to mean text")),
    yaml_case("config-sexagesimal-hours", "max_hours: 1:30\n",
              expect="{d}/x.yaml: key 'max_hours' must be a number > 0.0 (or null), got '1:30'"),
    yaml_case("config-fraction-for-int", "max_steps: 100.5\n",
              expect="{d}/x.yaml: key 'max_steps' must be an integer >= 1 (or null), got 100.5 "
                     "(not a whole number)"),
    yaml_case("config-quoted-number", 'learning_rate: "3e-3"\n',
              expect="{d}/x.yaml: key 'learning_rate' must be a number > 0.0, got '3e-3'"),
    yaml_case("config-inf", "learning_rate: .inf\n",
              expect="{d}/x.yaml: key 'learning_rate' must be a number > 0.0, got inf"),
    yaml_case("config-nan", "dropout: .nan\n",
              expect="{d}/x.yaml: key 'dropout' must be a number >= 0.0 and <= 0.99, got nan"),
    yaml_case("config-huge-int-as-float", "max_steps: 1e400\n",
              expect="{d}/x.yaml: key 'max_steps' must be an integer >= 1 (or null), got inf"),
    yaml_case("config-list-for-scalar", "seq_len: [64]\n",
              expect="{d}/x.yaml: key 'seq_len' must be an integer >= 8, got [64]"),
    yaml_case("config-tilde-for-required", "seq_len: ~\n",
              expect="{d}/x.yaml: key 'seq_len' must be an integer >= 8, got None"),
    yaml_case("config-empty-value-for-required", "seq_len:\n",
              expect="{d}/x.yaml: key 'seq_len' must be an integer >= 8, got None"),
    yaml_case("config-bool-in-list", "fp8_exclude: [lm_head, true]\n",
              expect="{d}/x.yaml: key 'fp8_exclude' must be a list of strings, got "
                     "['lm_head', True]"),
    yaml_case("config-text-with-trailing-space", 'tokenizer: "byte "\n',
              expect="{d}/x.yaml: key 'tokenizer' must be a string, got 'byte ' (leading or "
                     "trailing whitespace)"),
    yaml_case("config-python-tag", "seq_len: !!python/object:os.system {}\n",
              expect="{d}/x.yaml: not valid YAML (line 1, column 10): could not determine a "
                     "constructor"),
    yaml_case("config-tab-indent", "seq_len: 64\nfp8_exclude:\n\t- lm_head\n",
              expect=("{d}/x.yaml: not valid YAML (line 3, column 1)", "never tabs")),
    yaml_case("config-two-documents", "seq_len: 64\n---\nseq_len: 128\n",
              expect="{d}/x.yaml: not valid YAML (line 2, column 1): expected a single document"),
    yaml_case("config-dashed-key", "seq-len: 64\n",
              expect="unknown key 'seq-len' in {d}/x.yaml (did you mean 'seq_len'?)"),
    yaml_case("config-wrong-case-key", "Use_FP8: true\n",
              expect="unknown key 'Use_FP8' in {d}/x.yaml (did you mean 'use_fp8'?)"),
    yaml_case("config-utf16", "seq_len: 64\n".encode("utf-16"),
              expect="cannot read config file '{d}/x.yaml': not UTF-8 text (byte 0xff at "
                     "offset 0)"),
    yaml_case("config-warmup-and-length-in-one-file", "max_steps: 20\nwarmup_steps: 30\n",
              expect="{d}/x.yaml: key 'warmup_steps' (30) must be smaller than max_steps (20)"),

    # the command line ---------------------------------------------------------------------------
    Case("cli-config-given-twice", ["--config", "{d}/x.yaml"], files={"x.yaml": "seed: 1\n"},
         expect="option '--config' is given twice ('configs/test_fp8.yaml', then '{d}/x.yaml')"),
    Case("cli-config-empty", ["--config="], prefix="bare",
         expect="option '--config' needs a file path"),
    Case("cli-config-file-without-option", ["configs/test_fp8.yaml"], prefix="bare",
         expect="unexpected argument 'configs/test_fp8.yaml' on the command line (did you mean "
                "--config configs/test_fp8.yaml?)"),
    Case("cli-no-flag-with-value", ["--no_fp8=false"],
         expect="option '--no_fp8' takes no value; use --use_fp8=true or --use_fp8=false"),
    Case("cli-no-prefix-with-value", ["--no_compile=true"],
         expect="option '--no_compile' takes no value; use --compile=true or --compile=false"),
    Case("cli-no-prefix-on-non-bool", ["--no_seq_len"],
         expect="option '--no_seq_len': 'seq_len' is not a boolean key"),
    Case("cli-alias-with-value", ["--dry_run=false"],
         expect="option '--dry_run' takes no value; use --plan_only=true"),
    Case("cli-yes-for-bool", ["--use_fp8=yes"],
         expect="--use_fp8=yes on the command line: key 'use_fp8' must be true or false, "
                "got 'yes'"),
    Case("cli-bare-bool-then-word", ["--compile", "on"],
         expect="unexpected argument 'on' on the command line (--compile takes no value"),
    Case("cli-empty-value", ["--seq_len="],
         expect="option '--seq_len=' has an empty value (an integer >= 8)"),
    Case("cli-empty-value-optional", ["--max_steps="],
         expect="option '--max_steps=' has an empty value (--max_steps=null unsets it)"),
    Case("cli-fraction-for-int", ["--max_steps=2.5"],
         expect="--max_steps=2.5 on the command line: key 'max_steps' must be an integer >= 1 "
                "(or null), got 2.5"),
    Case("cli-inf", ["--learning_rate=inf"],
         expect="--learning_rate=inf on the command line: key 'learning_rate' must be a number"),
    Case("cli-nan", ["--learning_rate", ".nan"],
         expect="--learning_rate=.nan on the command line: key 'learning_rate' must be a number"),
    Case("cli-list-for-scalar", ["--seq_len=[64]"],
         expect="--seq_len=[64] on the command line: key 'seq_len' must be an integer >= 8, "
                "got [64]"),
    Case("cli-wrong-case", ["--Seq_Len=64"],
         expect="unknown option '--Seq_Len' in the command line (did you mean '--seq_len'?)"),
    Case("cli-value-with-trailing-space", ["--tokenizer=byte "],
         expect="--tokenizer=byte  on the command line: key 'tokenizer' must be a string, got "
                "'byte ' (leading or trailing whitespace)"),

    # errors name the option that set a value, not the config file underneath -------------------
    Case("cli-error-names-the-flag", ["--config", "configs/test_fp8.yaml", "--seq_len=7"],
         prefix="bare", expect="error: --seq_len=7 on the command line: key 'seq_len'"),
    Case("cli-cross-key-names-flag-and-file",
         ["--config", "configs/test_fp8.yaml", "--seq_len=24"], prefix="bare",
         expect="error: --seq_len=24, configs/test_fp8.yaml: key 'seq_len' (24) must be a "
                "multiple of 16 with use_fp8"),
    Case("cli-cross-key-names-both-flags", ["--seq_len=24", "--use_fp8"],
         expect="error: --seq_len=24, --use_fp8: key 'seq_len' (24)"),
    Case("cli-warmup-set-after-the-length",
         ["--config", "configs/test_fp8.yaml", "--warmup_steps=500"], prefix="bare",
         expect="error: --warmup_steps=500, configs/test_fp8.yaml: key 'warmup_steps' (500) "
                "must be smaller than max_steps (500)"),
]
