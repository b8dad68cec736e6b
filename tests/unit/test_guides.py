"""In-process tests: The documentation is tested like code. The whole story, and the tests that
start processes: tests/e2e/test_guides.py."""


import re
from pathlib import Path

import pytest

from support.guides_shared import BLOCK, doc_files
from support.runs import ROOT

GUIDES = ("fp8.md", "clusters.md", "lr_schedule.md", "troubleshooting.md")


FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


INLINE_CODE = re.compile(r"(`+)(?:.+?)\1", re.S)


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_every_guide_exists_is_linked_from_the_readme_and_has_cpu_commands():
    """The README links the documentation's index, docs/README.md, and the index links every
    page under docs/ (the records in docs/records/ included)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    index = ROOT / "docs" / "README.md"
    for name in GUIDES:
        assert (ROOT / "docs" / name).is_file(), name
        assert BLOCK.search((ROOT / "docs" / name).read_text(encoding="utf-8")), name
    assert "(docs/README.md)" in readme, "README does not link docs/README.md"
    listed = index.read_text(encoding="utf-8")
    for path in sorted((ROOT / "docs").rglob("*.md")):
        if path != index:
            name = path.relative_to(ROOT / "docs").as_posix()
            assert f"]({name})" in listed, f"docs/README.md does not link {name}"


def _strip_code(text: str) -> str:
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(path: Path) -> set[str]:
    """The heading anchors a markdown renderer (GitHub's rules) gives this file."""
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", path.read_text(encoding="utf-8"))):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))   # [text](url) -> text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_relative_link_points_at_an_existing_file_and_heading():
    broken = []
    for path in doc_files():
        for target in LINK.findall(_strip_code(path.read_text(encoding="utf-8"))):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):     # https:, mailto: ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{_rel(path)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{_rel(path)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_repository_path_the_docs_name_exists():
    """`fp8train/...`, `scripts/...`, `tests/...` and the like, named in code spans: a module
    that moves takes its documentation with it."""
    pattern = re.compile(r"`((?:fp8train|scripts|tests|configs|accelerate_configs|docs)/"
                         r"[\w./-]+)(?:::\w+)?`")
    missing = []
    for path in doc_files():
        for name in sorted(set(pattern.findall(FENCE.sub("", path.read_text(encoding="utf-8"))))):
            if not (ROOT / name).exists():
                missing.append(f"{_rel(path)}: {name}")
    assert not missing, "\n".join(missing)


def test_anchors_follow_githubs_rules(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Plotting a run without W&B\n## Which layers: `fp8_layers`\n"
                    "```bash\n# not a heading\n```\n## Kill -9, twice\n## Notes\n## Notes\n")
    assert anchors(page) == {"plotting-a-run-without-wb", "which-layers-fp8_layers",
                             "kill--9-twice", "notes", "notes-1"}


def test_config_reference_is_generated_from_the_schema():
    from fp8train.config import load as C
    from fp8train.config import reference as config_reference
    page = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert page == config_reference.render(), (
        f"docs/config.md is stale: run `{config_reference.COMMAND}`")
    missing = [k for k in C.KEYS if f"| `{k}` |" not in page]
    assert not missing, f"keys missing from docs/config.md: {missing}"
    for group in C.GROUPS:
        assert f"\n## {group}\n" in page, group


def _quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```bash\n(.*?)^```", section, re.S | re.M)
    return [b.strip() for b in blocks]


def test_readme_quick_start_is_two_commands_that_ci_runs():
    """The quick start is exactly two commands: the demo run and the test suite. CI (.ci/run)
    runs both on a fresh machine without a GPU: the training command verbatim (into a scratch
    run directory), then the test command verbatim."""
    train, tests = _quick_start_commands()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    train_cmd = train.split(" && ")[-1]
    test_cmd = tests.split(" && ")[-1]
    assert train_cmd == "python3 train_fp8.py --config configs/test_fp8.yaml"
    assert any(line.startswith(train_cmd + " ") or line == train_cmd for line in ci), train_cmd
    assert test_cmd in ci, test_cmd
    for install in (train, tests):
        assert install.startswith("pip install torch==2.13.0 && pip install -e ")


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move the depth to docs/"


def test_every_python_block_is_one_the_suite_runs():
    """tests/e2e/test_guides.py runs every ```python block; a block fenced ```py or ```python3
    would escape it."""
    from support.guides_shared import PYTHON
    found = 0
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        fences = re.findall(r"^```(py\w*)", text, re.M)
        assert set(fences) <= {"python"}, (_rel(path), fences)
        found += len(PYTHON.findall(text))
    assert found >= 1


OUTPUT_OPTIONS = ("--out", "--json", "--output_dir", "--output-dir")


def _paths_the_guides_create() -> dict:
    """Relative paths the guides' commands write, with the guide that names each: a file in
    each folder given to --out, --output_dir and export_hf.py's OUT_DIR, and the file given to
    --json."""
    import shlex
    found = {}

    def add(target, option, guide):
        if not target.startswith(("/", "$", "<", "~", "-", "{")) and "$" not in target:
            found[target if option == "--json" else f"{target}/x"] = guide
    for path in doc_files():
        for block in re.findall(r"^```bash[^\n]*\n(.*?)^```", path.read_text(encoding="utf-8"),
                                re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                try:
                    words = shlex.split(line, comments=True)
                except ValueError:
                    continue
                for i, word in enumerate(words):
                    option, _, value = word.partition("=")
                    if value and option in OUTPUT_OPTIONS:
                        add(value, option, _rel(path))
                    elif word in OUTPUT_OPTIONS and i + 1 < len(words):
                        add(words[i + 1], word, _rel(path))
                    elif word.endswith("export_hf.py") and i + 2 < len(words):
                        add(words[i + 2], "OUT_DIR", _rel(path))
    return found


def test_what_the_guides_tell_you_to_create_is_ignored_by_git():
    """Exports (hf/), comparisons, benchmarks and runs written inside the checkout never show
    up as changes to commit."""
    import subprocess
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    created = _paths_the_guides_create()
    assert {"hf/test_fp8/x", "bench/x", "gpu.json"} <= set(created), created
    r = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, text=True,
                       input="\n".join(created), capture_output=True)
    ignored = set(r.stdout.split())
    assert not set(created) - ignored, {p: created[p] for p in set(created) - ignored}
