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


def import_target(node: ast.ImportFrom, package: str) -> str:
    """The module a `from ... import` names, its dots resolved against `package`."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    return ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))


def imports_of(name: str, path: Path) -> set:
    """The package modules `name` imports anywhere in its file (top level or in a function)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = import_target(node, package)
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
    {"config", "ranks", "hub"},
    {"data", "model", "optim", "observe"},
    {"checkpoint", "precision", "hf_model"},
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


def names_taken_from(folder: str, graph_modules: dict) -> dict:
    """{(importing module, the module it names): [names]} of every `from ... import` in a
    module outside fp8train/<folder>/ that reaches into it."""
    inside = f"fp8train.{folder}"
    found = {}
    for name, path in graph_modules.items():
        if name == inside or name.startswith(inside + "."):
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = import_target(node, package)
            if target == inside or target.startswith(inside + "."):
                found.setdefault((name, target), []).extend(a.name for a in node.names)
    return found


# The FP8 boundary: what the rest of the package may take from precision/ (its __init__'s
# __all__), at most this many names. Everything else goes through a Precision's verbs.
MAX_PRECISION_NAMES = 10


def test_the_rest_of_the_package_takes_only_precisions_public_face():
    """Outside precision/, every import from it names the package itself (not one of its
    modules) and only names in its __all__, of which there are at most MAX_PRECISION_NAMES."""
    import fp8train.precision as precision
    taken = names_taken_from("precision", MODULES)
    assert {target for _, target in taken} == {"fp8train.precision"}, taken
    used = {n for names in taken.values() for n in names}
    assert used <= set(precision.__all__), used - set(precision.__all__)
    assert len(precision.__all__) <= MAX_PRECISION_NAMES
    print(f"names of precision/ imported outside it: {len(used)} ({', '.join(sorted(used))})")


def test_the_boundary_check_sees_an_import_from_a_module_inside(tmp_path):
    (tmp_path / "a.py").write_text("from ..precision.ao import TorchAO\n")
    (tmp_path / "b.py").write_text("def f():\n    from ..precision import choose\n")
    found = names_taken_from("precision", {"fp8train.train.a": tmp_path / "a.py",
                                           "fp8train.train.b": tmp_path / "b.py"})
    assert found == {("fp8train.train.a", "fp8train.precision.ao"): ["TorchAO"],
                     ("fp8train.train.b", "fp8train.precision"): ["choose"]}


def config_handovers(modules: dict) -> list:
    """Calls from one folder to a function of another that hand it the whole config (an
    argument named `cfg`, `*_cfg` or `config`, or `<x>.cfg`) or one section of it
    (`section(cfg, "<group>")`): (calling module, line, callee's folder, "config" or the group).
    Calls into config/ and errors.py do not count: they are where the config comes from."""
    found = []
    for name, path in modules.items():
        here = unit_of(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = import_target(node, package)
                if target.startswith("fp8train"):
                    imported.update({a.asname or a.name: target for a in node.names})
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            head = node.func
            while isinstance(head, ast.Attribute):
                head = head.value
            there = unit_of(imported.get(getattr(head, "id", None), "fp8train"))
            if there in (here, "", "config", "errors"):
                continue
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                what = _config_argument(arg)
                if what:
                    found.append((name, node.lineno, there, what))
    return found


def _config_argument(arg) -> "str | None":
    if isinstance(arg, ast.Name) and ((arg.id.endswith("cfg") and arg.id != "mcfg") or
                                      arg.id == "config"):
        return "config"
    if isinstance(arg, ast.Attribute) and arg.attr == "cfg":
        return "config"
    if isinstance(arg, ast.Call) and getattr(arg.func, "id", None) == "section" and \
            len(arg.args) == 2 and isinstance(arg.args[1], ast.Constant):
        return arg.args[1].value
    return None


# Folder crossings of a key at start-up: the whole config, or the key's section, handed from
# one folder to another. Measured with config_handovers: 20 whole-config handovers before the
# run plan and the sections (fp8_recipe crossed 20 times, batch_size 20); now fp8_recipe 7,
# batch_size 8.
MAX_CROSSINGS = {"fp8_recipe": 10, "batch_size": 10}


def test_fp8_recipe_and_batch_size_cross_few_folders():
    from fp8train.config.schema import key_fields
    group = {f.name: f.metadata["group"] for f in key_fields()}
    handovers = config_handovers(MODULES)
    for key, most in MAX_CROSSINGS.items():
        crossing = [h for h in handovers if h[3] in ("config", group[key])]
        print(f"{key} crosses folders {len(crossing)} times: " +
              ", ".join(f"{m.split('.', 1)[1]}:{line} -> {there}" for m, line, there, _ in crossing))
        assert len(crossing) <= most, crossing


def test_the_crossing_count_sees_the_config_and_its_sections(tmp_path):
    (tmp_path / "a.py").write_text(
        "from ..batch.decide import written_plan\nfrom ..config.load import section\n"
        "def f(cfg, trial_cfg):\n    written_plan(cfg, 1)\n    written_plan(trial_cfg)\n"
        "    written_plan(section(cfg, 'batch'))\n    section(cfg, 'eval')\n")
    assert config_handovers({"fp8train.train.a": tmp_path / "a.py"}) == [
        ("fp8train.train.a", 4, "batch", "config"), ("fp8train.train.a", 5, "batch", "config"),
        ("fp8train.train.a", 6, "batch", "batch")]


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
