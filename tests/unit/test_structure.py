"""The package's shape, read from the source: arrows point one way (no import circle; algorithms/
imports nothing of the project; rollout/ no Megatron and nothing of models/), no module reaches
another's ``_private`` names, reading a recipe imports no Megatron, and no function is too long
to read at once (docs/design.md, ../shared/STYLE.md items 11-12)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vapo_megatron"
MAX_FUNCTION_LINES = 80


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_level_imports(tree: ast.Module):
    """Import nodes run when the module is imported: top level, and inside top-level
    try/if blocks, but not under ``if TYPE_CHECKING:`` nor inside functions or classes."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                stack.extend(node.body)
            stack.extend(node.orelse)
        elif isinstance(node, ast.Try):
            stack.extend(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                stack.extend(handler.body)


def all_imports(tree: ast.Module):
    """Every import node, function-level and TYPE_CHECKING ones included."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def imported_names(node: ast.Import | ast.ImportFrom, importer: str) -> list[str]:
    """Absolute dotted names an import statement reaches (``from a import b`` gives ``a.b`` as
    well as ``a``: ``b`` may be a submodule)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = importer.split(".")
        if MODULES.get(importer, Path()).name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def project_targets(node, importer: str) -> set[str]:
    """The project modules an import statement loads (each a key of MODULES)."""
    out = set()
    for name in imported_names(node, importer):
        if name in MODULES:
            out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for name, tree in TREES.items():
        targets = set()
        for node in module_level_imports(tree):
            targets |= project_targets(node, name)
        # importing a.b.c runs a/__init__ and a/b/__init__ too; those are cheap docstrings
        # here, so only the named modules count as edges
        graph[name] = targets - {name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circle():
    cycles = find_cycles(import_graph())
    assert not cycles, "module-level import circles (move the shared part down):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_cycle_finder_finds_a_circle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def _package_imports(prefix: str, *, module_level_only: bool):
    for name, tree in TREES.items():
        if name != prefix and not name.startswith(prefix + "."):
            continue
        nodes = module_level_imports(tree) if module_level_only else all_imports(tree)
        for node in nodes:
            for target in imported_names(node, name):
                yield name, node.lineno, target


def test_algorithms_import_nothing_of_the_project():
    bad = sorted(
        f"{name}:{line} imports {target}"
        for name, line, target in _package_imports(
            "vapo_megatron.algorithms", module_level_only=False
        )
        if target.startswith("vapo_megatron") and not target.startswith("vapo_megatron.algorithms")
    )
    assert not bad, "algorithms/ is plain torch math:\n" + "\n".join(bad)


def test_rollout_imports_no_megatron_and_no_models():
    bad = sorted(
        f"{name}:{line} imports {target}"
        for name, line, target in _package_imports("vapo_megatron.rollout", module_level_only=True)
        if target.split(".")[0] == "megatron" or target.startswith("vapo_megatron.models")
    )
    assert not bad, "rollout/ meets the models only through weights/:\n" + "\n".join(bad)


def test_no_private_names_across_modules():
    bad = []
    for name, tree in TREES.items():
        for node in all_imports(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = imported_names(node, name)[0]
            if not source.startswith("vapo_megatron") or source == name:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    bad.append(f"{name}:{node.lineno} imports {source}.{alias.name}")
        # module attributes reached through an imported module: ckpt._helper(...)
        aliases = {
            alias.asname or alias.name: f"{imported_names(node, name)[0]}.{alias.name}"
            for node in all_imports(tree)
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
            if f"{imported_names(node, name)[0]}.{alias.name}" in MODULES
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and aliases[node.value.id] != name
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                bad.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not bad, "make the helper public where it is shared:\n" + "\n".join(sorted(bad))


def long_functions(max_lines: int = MAX_FUNCTION_LINES) -> list[str]:
    out = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - first + 1
                if length > max_lines:
                    out.append(f"{name}.{node.name} ({MODULES[name].name}:{node.lineno}): {length}")
    return sorted(out)


def test_no_function_longer_than_80_lines():
    offenders = long_functions()
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)


RECIPE_PROBE = """
import sys
from pathlib import Path
from vapo_megatron.config.recipe import load_recipe
import yaml
for path in sorted(Path(sys.argv[1]).glob("*.yaml")):
    if "model" in (yaml.safe_load(path.read_text()) or {}):  # the base recipe is only extended
        load_recipe(path)
heavy = sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))
print("\\n".join(heavy))
"""


def test_loading_every_recipe_imports_no_megatron():
    result = subprocess.run(
        [sys.executable, "-c", RECIPE_PROBE, str(ROOT / "recipes")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = result.stdout.split()
    assert not loaded, f"reading a recipe imported {len(loaded)} megatron modules: {loaded[:10]}"


SCRIPT_PROBE = """
import runpy, sys
script = sys.argv[1]
sys.argv = sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit:
    pass
heavy = sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))
print("MEGATRON", len(heavy), heavy[:5])
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["tools/plan.py", "--recipe", "recipes/vapo_qwen2.5_32b.yaml", "--model", "qwen2.5-32b",
         "--nodes", "16"],
        ["slurm/check_inputs.py", "recipes/vapo_qwen2.5_32b.yaml"],
        ["tools/ablate.py", "--help"],
    ],
    ids=["plan", "check_inputs", "ablate"],
)  # fmt: skip
def test_recipe_readers_import_no_megatron(argv):
    """The planner, the inputs check and the ablation driver read recipes (and, for the
    planner, plan them) without paying for Megatron."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tools")}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT_PROBE, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    line = [x for x in result.stdout.splitlines() if x.startswith("MEGATRON")]
    assert line, result.stdout[-2000:] + result.stderr[-2000:]
    assert line[-1].startswith("MEGATRON 0 "), f"{argv[0]} imported megatron: {line[-1]}"
