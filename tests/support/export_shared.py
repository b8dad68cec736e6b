"""What tests/unit/test_export.py and tests/e2e/test_export.py share."""


import pytest

transformers = pytest.importorskip("transformers")
