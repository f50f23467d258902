"""``rollout/`` imports no Megatron and nothing of ``models/`` (docs/design.md: models and
rollout meet only through the HF name map, which the weights package owns).

Two checks: the import graph read from the source (every import of a rollout module, even
inside a function, and what the project modules it reaches import at module level, followed
to the end), and a fresh interpreter that imports every rollout module that does not load
vLLM at import time and finds no ``megatron`` in ``sys.modules``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[3]
FORBIDDEN = ("megatron", "vapo_megatron.models")


def _is_forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


def _module_file(root: Path, module: str) -> Path | None:
    """The source file of project module ``module`` under ``root`` (None: not the project's)."""
    parts = module.split(".")
    if parts[0] != "vapo_megatron":
        return None
    base = root.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _is_type_checking(node: ast.stmt) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _import_nodes(tree: ast.Module, *, everywhere: bool) -> list[ast.stmt]:
    """Import statements run when the module runs (``everywhere``: also inside functions);
    never those under ``if TYPE_CHECKING:``."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if _is_type_checking(node):
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif everywhere or not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            todo.extend(ast.iter_child_nodes(node))
    return found


def imported_modules(root: Path, module: str, *, everywhere: bool) -> set[str]:
    """The modules ``module`` (a project module under ``root``) imports, with the parent
    packages of each (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``)."""
    tree = ast.parse(_module_file(root, module).read_text())
    out = set()
    for node in _import_nodes(tree, everywhere=everywhere):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from the module's package
                is_package = _module_file(root, module).name == "__init__.py"
                anchor = (
                    module.rsplit(".", node.level - is_package)[0]
                    if node.level - is_package
                    else module
                )
                base = f"{anchor}.{base}" if base else anchor
            names = [base]
            names += [
                f"{base}.{a.name}" for a in node.names if _module_file(root, f"{base}.{a.name}")
            ]
        for name in names:
            parts = name.split(".")
            out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


def rollout_modules(root: Path) -> list[str]:
    return sorted(
        "vapo_megatron.rollout" + ("" if p.stem == "__init__" else "." + p.stem)
        for p in (root / "vapo_megatron/rollout").glob("*.py")
    )


def forbidden_imports(root: Path) -> list[str]:
    """Each way a module of ``root/vapo_megatron/rollout`` reaches a forbidden module, as an
    import chain."""
    rollout = rollout_modules(root)
    chains = {m: [m] for m in rollout}
    todo = list(rollout)
    problems = []
    while todo:
        module = todo.pop(0)
        everywhere = module.startswith("vapo_megatron.rollout")
        for name in sorted(imported_modules(root, module, everywhere=everywhere)):
            if name in chains:
                continue
            chains[name] = [*chains[module], name]
            if _is_forbidden(name):
                problems.append(" -> ".join(chains[name]))
            elif _module_file(root, name) is not None:
                todo.append(name)
    return problems


def test_rollout_reaches_no_megatron_in_source():
    problems = forbidden_imports(REPO_ROOT)
    assert not problems, (
        "rollout/ must not import megatron or vapo_megatron.models (directly or through a "
        "project module at module level); move the code to vapo_megatron/weights/ or the "
        "trainer, or import it under TYPE_CHECKING:\n" + "\n".join(problems)
    )


def test_rollout_modules_load_no_megatron():
    """What the interpreter loads: every rollout module without vLLM at import time (those
    with it load in vLLM's workers and are held by the source check above)."""
    modules = [
        module
        for module in rollout_modules(REPO_ROOT)
        if "vllm" not in imported_modules(REPO_ROOT, module, everywhere=False)
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m in ('megatron', 'vapo_megatron.models')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {modules} loaded {out.stdout.strip()}"
