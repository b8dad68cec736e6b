"""In-process tests: The package's shape, checked from its source: no import cycle (function-level
imports included), no folder importing a folder above it (LAYERS), config depends on nothing of
the package but errors, no module over 450 lines, and ... The whole story, and the tests that start processes: tests/e2e/test_layout.py."""


import ast
import re
import sys
from pathlib import Path

import pytest

from support.runs import ROOT

PACKAGE = ROOT / "fp8train"


MAX_LINES = 450


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path) -> set:
    """The package modules `name` imports anywhere in its file (top level or in a function)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:   # `from pkg import module` depends on the module only
                sub = f"{target}.{a.name}"
                found.add(sub if sub in MODULES else target)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def cycles(graph: dict) -> list:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_anywhere_in_the_package():
    assert cycles(GRAPH) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The package's layers, lowest first: a folder (or a top-level module) imports only from layers
# below its own, so no folder imports a folder above it and folders cannot form a cycle. A new
# folder or top-level module joins a layer here.
LAYERS = (
    {"errors", "io", "compile", "memory", "loss"},
    {"config", "ranks"},
    {"data", "model", "optim", "observe"},
    {"checkpoint", "precision"},
    {"batch"},
    {"evaluate"},
    {"train"},
    {"sweep", "diagnose", "analysis"},
)


def unit_of(name: str) -> str:
    """The folder under fp8train/ a module is in, or the top-level module's own name."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_arrows(graph: dict, layers=LAYERS) -> list:
    """Imports from one folder to another in the same layer or a higher one: (from, to)."""
    layer = {u: i for i, units in enumerate(layers) for u in units}
    bad = []
    for name, deps in graph.items():
        src = unit_of(name)
        for dep in deps:
            dst = unit_of(dep)
            if src and dst and src != dst and layer[dst] >= layer[src]:
                bad.append((name, dep))
    return sorted(bad)


def test_every_folder_and_top_level_module_has_a_layer():
    units = {unit_of(n) for n in GRAPH} - {""}
    assert units <= set().union(*LAYERS), f"add to LAYERS: {units - set().union(*LAYERS)}"


def test_no_folder_imports_a_folder_of_its_own_layer_or_above():
    assert upward_arrows(GRAPH) == []


def test_the_layer_check_finds_an_upward_arrow():
    graph = {"fp8train.model": {"fp8train.train.loop"}, "fp8train.train.loop": {"fp8train.model"},
             "fp8train.data.a": {"fp8train.observe.b"}}
    assert upward_arrows(graph) == [("fp8train.data.a", "fp8train.observe.b"),
                                    ("fp8train.model", "fp8train.train.loop")]


def private_imports(paths) -> list:
    """`from <a package module> import _name` in `paths`: (file, name)."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(
                    "fp8train")):
                found += [(path.name, a.name) for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_modules_import_only_each_others_public_names():
    """What crosses a module boundary has a public name: a `_name` is the module's own."""
    assert private_imports(PACKAGE.rglob("*.py")) == []


def test_config_imports_nothing_of_the_package_but_errors():
    for name, deps in GRAPH.items():
        if name.startswith("fp8train.config"):
            outside = {d for d in deps if not d.startswith("fp8train.config")}
            assert outside <= {"fp8train.errors", "fp8train"}, (name, outside)


def test_no_module_is_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


# Import names of the distributions pyproject.toml names, where they differ.
IMPORT_NAMES = {"pyyaml": "yaml", "transformer-engine": "transformer_engine"}
# Imported, not declared: what a declared dependency installs itself.
VIA = {"huggingface_hub": "transformers", "tokenizers": "transformers", "pyarrow": "datasets"}
# Imported only where installed (each import guarded, the feature said to need it).
OPTIONAL = {"transformer_engine": "te", "torchao": "torchao", "tiktoken": "gpt2 speed-up"}


def _requirement_names(entries) -> set:
    return {IMPORT_NAMES.get(n, n) for n in
            (re.split(r"[<>=\[; ]", e.strip())[0].lower() for e in entries)}


def test_everything_the_package_and_scripts_import_is_installed_by_pip_install():
    """`pip install -e .` (the quick start's install) brings every library fp8train and its
    scripts import, plotting included: plots are a core output (scripts/plot_run.py,
    compare_runs.py). Only the FP8 backends' own libraries are extras."""
    tomllib = pytest.importorskip("tomllib")     # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    default = _requirement_names(project["dependencies"])
    assert "matplotlib" in default
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "scripts").glob("*.py"), ROOT / "train_fp8.py",
             ROOT / "run_sweep.py"]
    missing = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("fp8train", "__future__"):
                    continue
                if top not in default and VIA.get(top) not in default and top not in OPTIONAL:
                    missing.setdefault(top, str(path.relative_to(ROOT)))
    assert missing == {}, f"imported but not installed by `pip install -e .`: {missing}"
