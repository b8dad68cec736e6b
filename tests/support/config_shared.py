"""What tests/unit/test_config.py and tests/e2e/test_config.py share."""


import textwrap


def write(tmp_path, text, name="x.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)
