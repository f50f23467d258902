"""The packages' layer order, read from the source (docs/design.md "Where things live",
../shared/STYLE.md items 12-13): no import circle between packages, and every import goes
down the layer order below, counting every import a module holds: at module level, inside a
function and under ``if TYPE_CHECKING:`` alike (a type-only import still ties the packages).

A node is a package, the first name under ``vapo_megatron/`` (``step``, ``weights``, ...);
a top-level module (``train.py``, ``evaluate.py``, ``run_log.py``) is a node of its own."""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.unit.test_structure import find_cycles  # one Tarjan for modules and packages

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vapo_megatron"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("train", "evaluate"),  # the console scripts: read a recipe, launch, hand over
    ("planning",),  # the planner and the dry run, which builds what the run builds
    ("trainer",),  # the run: loop, session, evaluation, metrics, preemption
    ("step", "tiny"),  # one training step; the tiny CPU task, its models and builders
    ("engine",),  # the model engine, training-state offload, host arena
    ("weights",),  # Megatron <-> HF: record, gather, stream, files, conversion, export
    ("checkpoint",),  # the model-checkpoint format and the training checkpoint
    ("models", "rollout", "data"),  # Megatron models; the vLLM engine; datasets and packing
    ("parallel",),  # process groups, collectives, context parallelism, devices
    ("config",),  # settings dataclasses and the recipe loader
    ("algorithms", "rewards", "launch", "run_log"),  # pure math, verifiers, launcher, logs
)
"""Top to bottom. A node may import only nodes of a layer below its own; nodes of one layer
import none of each other."""

ALLOWED: tuple[tuple[str, str, str], ...] = ()
"""(importing module, imported module, why), dotted ("vapo_megatron.step.run"), for the few
imports against the layer order, each also justified in docs/design.md. At most two."""
MAX_ALLOWED = 2


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def node_of(module: str) -> str | None:
    """The package (or top-level module) ``module`` belongs to; None for the root package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_with_kind(tree: ast.AST, kind: str = "module-level"):
    """(import node, kind) for every import in ``tree``: "module-level" (runs on import, a
    class body and top-level try/if included), "in-function" or "type-only" (under ``if
    TYPE_CHECKING:``, at any depth)."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, kind
        elif isinstance(child, ast.If) and _is_type_checking(child):
            for inner in child.body:
                yield from imports_with_kind(ast.Module(body=[inner], type_ignores=[]), "type-only")
            for inner in child.orelse:
                yield from imports_with_kind(ast.Module(body=[inner], type_ignores=[]), kind)
        else:
            in_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from imports_with_kind(
                child, "in-function" if kind == "module-level" and in_function else kind
            )


def imported_modules(
    node: ast.Import | ast.ImportFrom, importer: str, is_package: bool
) -> set[str]:
    """The project modules (keys of MODULES) an import statement names, relative imports
    resolved: ``from a import b`` gives ``a.b`` where that is a module, else ``a``."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in MODULES}
    base = node.module or ""
    if node.level:
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    submodules = {f"{base}.{alias.name}" for alias in node.names} & MODULES.keys()
    plain = [alias.name for alias in node.names if f"{base}.{alias.name}" not in MODULES]
    return submodules | ({base} if plain and base in MODULES else set())


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    kind: str

    @property
    def edge(self) -> tuple[str, str]:
        return node_of(self.importer), node_of(self.imported)

    def __str__(self) -> str:
        where = f"{MODULES[self.importer].relative_to(ROOT)}:{self.line}"
        return f"{where} imports {self.imported} ({self.kind})"


def cross_node_imports(modules: dict[str, Path] = MODULES) -> list[Import]:
    """Every import of one node's module by another node's, in file order."""
    out = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node, kind in imports_with_kind(tree):
            for target in sorted(imported_modules(node, name, path.name == "__init__.py")):
                here, there = node_of(name), node_of(target)
                if None not in (here, there) and here != there:
                    out.append(Import(name, target, node.lineno, kind))
    return out


def layer_of(node: str) -> int | None:
    return next((i for i, layer in enumerate(LAYERS) if node in layer), None)


def against_the_layers(imports: list[Import]) -> list[Import]:
    """The imports whose target is not in a layer below the importer's (unknown nodes too)."""
    bad = []
    for imp in imports:
        here, there = (layer_of(n) for n in imp.edge)
        if here is None or there is None or there <= here:
            bad.append(imp)
    return bad


IMPORTS = cross_node_imports()


def test_layers_name_each_node_once():
    named = [n for layer in LAYERS for n in layer]
    assert len(named) == len(set(named)), f"a node in two layers: {named}"
    assert len(ALLOWED) <= MAX_ALLOWED, f"at most {MAX_ALLOWED} imports against the layers"


def test_every_node_has_a_layer():
    nodes = {node_of(m) for m in MODULES} - {None}
    missing = sorted(n for n in nodes if layer_of(n) is None)
    assert not missing, f"put each package in LAYERS (tests/unit/test_layers.py): {missing}"


def test_no_package_circle():
    graph: dict[str, set[str]] = {}
    for imp in IMPORTS:
        graph.setdefault(imp.edge[0], set()).add(imp.edge[1])
    cycles = find_cycles(graph)
    report = []
    for cycle in cycles:
        report.append("circle of " + ", ".join(cycle) + "; its edges, fewest imports first:")
        edges: dict[tuple[str, str], list[Import]] = {}
        for imp in IMPORTS:
            if set(imp.edge) <= set(cycle):
                edges.setdefault(imp.edge, []).append(imp)
        for (a, b), imps in sorted(edges.items(), key=lambda e: (len(e[1]), e[0])):
            report.append(f"  {a} -> {b} ({len(imps)}): " + "; ".join(map(str, imps)))
    assert not cycles, "package circles (move the shared part down):\n" + "\n".join(report)


def test_imports_go_down_the_layers():
    allowed = {(importer, imported) for importer, imported, _ in ALLOWED}
    against = against_the_layers(IMPORTS)
    bad = [imp for imp in against if (imp.importer, imp.imported) not in allowed]
    used = {(imp.importer, imp.imported) for imp in against}
    stale = sorted(allowed - used)
    assert not bad and not stale, (
        f"imports against the layer order {[list(layer) for layer in LAYERS]}:\n"
        + "\n".join(str(imp) for imp in bad)
        + ("\nALLOWED entries no import needs: " + str(stale) if stale else "")
    )


def test_the_cycle_finder_finds_a_circle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_every_kind_of_import_counts(tmp_path, monkeypatch):
    """Module-level, in-function and type-only imports are all edges; relative ones resolve."""
    pkg = tmp_path / "vapo_megatron"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("X = 1\n")
    (pkg / "low" / "b.py").write_text("from .a import X\n")
    (pkg / "high" / "c.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from ..low import a\n"
        "if TYPE_CHECKING:\n"
        "    from vapo_megatron.low.b import X\n"
        "def f():\n"
        "    import vapo_megatron.low.a\n"
    )
    modules = {
        "vapo_megatron.low.a": pkg / "low" / "a.py",
        "vapo_megatron.low.b": pkg / "low" / "b.py",
        "vapo_megatron.high.c": pkg / "high" / "c.py",
        "vapo_megatron.low": pkg / "low" / "__init__.py",
        "vapo_megatron.high": pkg / "high" / "__init__.py",
    }
    monkeypatch.setattr(sys.modules[__name__], "MODULES", modules)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = [(i.imported, i.line, i.kind) for i in cross_node_imports(modules)]
    assert found == [
        ("vapo_megatron.low.a", 2, "module-level"),
        ("vapo_megatron.low.b", 4, "type-only"),
        ("vapo_megatron.low.a", 6, "in-function"),
    ]
