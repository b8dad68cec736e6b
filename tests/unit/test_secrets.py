"""In-process tests: Secrets in the environment never reach the run's files, the console or W&B:
the rule for what counts as a secret, redaction, and a real training run with W&B offline whose
every ... The whole story, and the tests that start processes: tests/e2e/test_secrets.py."""


import dataclasses
import secrets as stdlib_secrets
from collections import namedtuple

import pytest

from fp8train import errors as S
from fp8train.config.load import dump_yaml, load_config


@pytest.fixture
def fresh_secrets():
    """secret_values() is read once per process: re-read it for a test, and after it."""
    S.secret_values.cache_clear()
    yield
    S.secret_values.cache_clear()


def test_which_environment_variables_are_secrets():
    env = {
        "WANDB_API_KEY": "k" * 40, "HF_TOKEN": "hf_abcdefghijkl",
        "HUGGING_FACE_HUB_TOKEN": "hf_mnopqrstuvwx", "AWS_SECRET_ACCESS_KEY": "aws/secret+123",
        "AWS_SESSION_TOKEN": "session-token-1", "MY_SERVICE_TOKEN": "svc-token-0001",
        "DB_PASSWORD": "hunter2hunter2", "STRIPE_KEY": "sk_live_12345", "OpenAI_Api_Key": "sk-lower-case",
        "GITHUB_TOKEN": "short",                       # under 8 characters: ignored
        "HF_TOKEN_PATH": "/home/u/.cache/huggingface/token",   # where a secret is, not one
        "TOKENIZERS_PARALLELISM": "false-but-long",    # not a secret
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEID01",        # an identifier, not a secret
        "HOME": "/home/someone", "PATH": "/usr/bin:/bin", "WANDB_PROJECT": "my-project",
        "DATABASE_URL": "postgres://u:pw@host/db",
        "FP8TRAIN_SECRET_VARS": " database_url ,",     # ... unless named here
    }
    values = S.find_secret_values(env)
    assert set(values) == {"k" * 40, "hf_abcdefghijkl", "hf_mnopqrstuvwx", "aws/secret+123",
                           "session-token-1", "svc-token-0001", "hunter2hunter2",
                           "sk_live_12345", "sk-lower-case", "postgres://u:pw@host/db"}
    assert [len(v) for v in values] == sorted((len(v) for v in values), reverse=True)
    assert S.is_secret_name("wandb_api_key") and not S.is_secret_name("WANDB_MODE")


def test_redact_strings_and_nested_configs():
    values = ("abcdefgh12345678", "abcdefgh")   # longest first, as find_secret_values gives
    Point = namedtuple("Point", "x y")
    obj = {"name": "run-abcdefgh12345678-x", "tags": ["ci", "abcdefgh"],
           "nested": {"deep": [("t", "pre abcdefgh post")], "n": 3, "f": 1.5, "none": None},
           "abcdefgh": True, "point": Point("abcdefgh", 2)}
    out = S.redact(obj, values)
    assert out == {"name": "run-***-x", "tags": ["ci", "***"],
                   "nested": {"deep": [("t", "pre *** post")], "n": 3, "f": 1.5, "none": None},
                   "***": True, "point": Point("***", 2)}
    assert isinstance(out["point"], Point) and isinstance(out["nested"]["deep"][0], tuple)
    assert obj["name"] == "run-abcdefgh12345678-x"             # the original is not changed
    assert S.redact("abcdefgh12345678abcdefgh", values) == "******"
    assert S.redact(obj, ()) is obj                             # nothing to redact: no copy
    assert S.redact("nothing secret here", values) == "nothing secret here"


def test_secret_values_are_read_from_the_environment_once(monkeypatch, fresh_secrets):
    monkeypatch.setenv("MY_SERVICE_TOKEN", "first-value-123")
    assert "first-value-123" in S.secret_values()
    monkeypatch.setenv("MY_SERVICE_TOKEN", "second-value-456")
    assert "first-value-123" in S.secret_values()   # cached: computed once per process
    assert S.redact("x first-value-123 y") == "x *** y"


def test_config_yaml_redacts_values_yaml_would_quote(monkeypatch, fresh_secrets, tmp_path):
    token = 'tok"en: #with \\ yaml-special ' + stdlib_secrets.token_hex(8)
    monkeypatch.setenv("MY_SERVICE_TOKEN", token)
    cfg = load_config(["--config=configs/test_fp8.yaml", f"--output_dir={tmp_path}",
                       "--use_wandb", "--wandb_run_name=placeholder"])
    cfg = dataclasses.replace(cfg, wandb_run_name=f"run {token}", wandb_tags=["ci", token])
    text = dump_yaml(cfg, {"note": f"long text that YAML folds at eighty columns {token} " * 3})
    assert token not in text and "\\" not in text
    assert "wandb_run_name: run ***" in text
