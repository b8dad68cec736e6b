"""What tests/unit/test_guides.py and tests/e2e/test_guides.py share."""


import re
from pathlib import Path

from support.runs import ROOT

BLOCK = re.compile(r"^```bash cpu\n(.*?)^```", re.S | re.M)
PYTHON = re.compile(r"^```python\n(.*?)^```", re.S | re.M)   # every one runs, on the demo's export


def doc_files() -> list[Path]:
    """README.md and every page under docs/, the records in docs/records/ included."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
