"""Bad-input cases: config. See tests/test_bad_input.py for how a case is run and judged."""
from bad_input_kit import DIR, Case, prepared, yaml_case  # noqa: F401

CASES = [
]
