"""What tests/unit/test_guides.py and tests/e2e/test_guides.py share."""


import re
from pathlib import Path

from support.runs import ROOT

BLOCK = re.compile(r"^```bash cpu\n(.*?)^```", re.S | re.M)
PYTHON = re.compile(r"^```python\n(.*?)^```", re.S | re.M)   # every one runs, on the demo's export


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
