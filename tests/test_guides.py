"""Every command the guides in docs/ mark as runnable on a CPU (fenced ```bash cpu blocks) runs
here as a reader would run it: from the repository root, with bash, its run directories
(`runs/...`) moved into a temporary folder. A guide whose command broke fails this test."""
import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import DATA_DIR, ROOT

GUIDES = ("fp8.md", "clusters.md", "lr_schedule.md", "troubleshooting.md")
BLOCK = re.compile(r"^```bash cpu\n(.*?)^```", re.S | re.M)


def _blocks():
    found = []
    for name in GUIDES:
        text = (ROOT / "docs" / name).read_text(encoding="utf-8")
        for i, m in enumerate(BLOCK.finditer(text), 1):
            found.append(pytest.param(m.group(1), id=f"{name[:-3]}-{i}"))
    return found


def test_every_guide_exists_is_linked_from_the_readme_and_has_cpu_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in GUIDES:
        assert (ROOT / "docs" / name).is_file(), name
        assert f"(docs/{name})" in readme, f"README does not link docs/{name}"
        assert BLOCK.search((ROOT / "docs" / name).read_text(encoding="utf-8")), name


@pytest.mark.parametrize("block", _blocks())
def test_guide_command_runs_on_cpu(block, tmp_path):
    script = block.replace("runs/", f"{tmp_path}/runs/")
    env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR, FP8TRAIN_OFFLINE="1",
               WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    r = subprocess.run(["bash", "-o", "pipefail", "-c", script], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert not any(Path(ROOT, "runs", p).exists() for p in ("guide-fp8", "guide-health")), \
        "a guide command wrote into the repository's runs/"
