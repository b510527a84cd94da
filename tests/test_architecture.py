"""The package's structure, checked from its source: layers import only downward, the MPI ranks
and the hardware models stay free of jax, and modules and functions stay small.

Imports are read with ``ast`` (every ``import`` statement, at any depth), so a function-local
import cannot hide an upward edge. One dynamic check imports the rank-side modules in a fresh
interpreter and asserts that jax was not loaded.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "partir_emu"

# Which partir_emu packages each layer may import (besides itself). ``app`` and the top-level
# modules (``api``, ``__init__``) are the only layer that may import everything and ``scenarios``.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "core": {"errors"},
    "primitives": {"core", "errors"},
    "collectives": {"core", "errors"},
    "compiler": {"core", "primitives", "errors"},
    "runtime": {"core", "primitives", "collectives", "errors"},
    "hwmodels": {"core", "primitives", "collectives", "errors"},
}
TOP = {"app", "api", "interop", "mpi", "__init__"}
NO_JAX = {"core", "primitives", "collectives", "runtime", "hwmodels", "errors"}
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_LOCAL_IMPORTS = 15


@dataclass(frozen=True)
class Import:
    module: str        # the importing module, dotted
    target: str        # the imported module, dotted
    line: int
    local: bool        # inside a function
    reason: str        # the comment on the import line or the line above


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if ".venv" not in p.parts)


def _dotted(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(dotted: str) -> str:
    parts = dotted.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def _comment(lines: list[str], lineno: int) -> str:
    here = lines[lineno - 1]
    if "#" in here:
        return here.split("#", 1)[1].strip()
    above = lines[lineno - 2].strip() if lineno >= 2 else ""
    return above[1:].strip() if above.startswith("#") else ""


def _imports(path: Path) -> list[Import]:
    src = path.read_text()
    lines = src.splitlines()
    tree = ast.parse(src)
    me = _dotted(path)
    out: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            fn = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                for a in child.names:
                    out.append(Import(me, a.name, child.lineno, in_function, _comment(lines, child.lineno)))
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                out.append(Import(me, child.module, child.lineno, in_function, _comment(lines, child.lineno)))
            elif isinstance(child, ast.ImportFrom) and child.level:
                raise AssertionError(f"{me}:{child.lineno}: relative import; write the absolute path")
            visit(child, fn)

    visit(tree, False)
    return out


ALL_IMPORTS = [imp for p in _modules() for imp in _imports(p)]


def _is_type_checking_block(path: Path, lineno: int) -> bool:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            if node.lineno <= lineno <= (node.end_lineno or node.lineno):
                return True
    return False


def test_layers_import_only_downward():
    bad = []
    for imp in ALL_IMPORTS:
        src = _layer(imp.module)
        if src in TOP:
            continue
        if src not in ALLOWED:
            bad.append(f"{imp.module} belongs to no layer: move it into one (or into app/)")
            continue
        if imp.target.split(".")[0] == "scenarios":
            bad.append(f"{imp.module}:{imp.line} imports scenarios (only the app layer may)")
            continue
        if not imp.target.startswith("partir_emu"):
            continue
        dst = _layer(imp.target) if imp.target != "partir_emu" else "__init__"
        if dst != src and dst not in ALLOWED[src]:
            bad.append(f"{imp.module}:{imp.line} ({src}) imports {imp.target} ({dst})")
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def test_no_package_cycles():
    edges: dict[str, set[str]] = {}
    for imp in ALL_IMPORTS:
        if imp.target.startswith("partir_emu."):
            a, b = _layer(imp.module), _layer(imp.target)
            if a != b:
                edges.setdefault(a, set()).add(b)
    # depth-first search for a back edge
    state: dict[str, int] = {}
    cycle: list[str] = []

    def dfs(n: str, path: list[str]) -> bool:
        state[n] = 1
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                cycle.extend(path + [n, m])
                return True
            if m not in state and dfs(m, path + [n]):
                return True
        state[n] = 2
        return False

    for n in sorted(edges):
        if n not in state and dfs(n, []):
            break
    assert not cycle, f"package cycle: {' -> '.join(cycle)}"


@pytest.mark.slow
def test_no_module_cycles_inside_packages():
    """Within one package too (the DES once had model <-> collective <-> device)."""
    edges: dict[str, set[str]] = {}
    for p in _modules():
        for imp in _imports(p):
            if imp.target.startswith("partir_emu.") and not _is_type_checking_block(p, imp.line):
                edges.setdefault(imp.module, set()).add(imp.target)
    modules = {_dotted(p) for p in _modules()}
    edges = {a: {b for b in bs if b in modules and b != a} for a, bs in edges.items()}
    state: dict[str, int] = {}
    found: list[str] = []

    def dfs(n: str, path: list[str]) -> None:
        if found:
            return
        state[n] = 1
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1 and not m.startswith(n + ".") and not n.startswith(m + "."):
                # a package __init__ importing its own submodules is not a cycle of concepts
                found.extend(path + [n, m])
                return
            if m not in state:
                dfs(m, path + [n])
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            dfs(n, [])
    assert not found, f"module cycle: {' -> '.join(found)}"


@pytest.mark.parametrize("layer", sorted(NO_JAX))
def test_lower_layers_never_import_jax(layer):
    bad = [f"{i.module}:{i.line} imports {i.target}" for i in ALL_IMPORTS
           if _layer(i.module) == layer and i.target.split(".")[0] in ("jax", "jaxlib", "flax", "optax")]
    assert not bad, "\n".join(bad)


def test_hwmodels_never_import_mpi4py_or_the_app():
    bad = [f"{i.module}:{i.line} imports {i.target}" for i in ALL_IMPORTS
           if _layer(i.module) == "hwmodels"
           and (i.target.startswith("mpi4py") or i.target.startswith("partir_emu.app")
                or i.target.split(".")[0] == "scenarios")]
    assert not bad, "\n".join(bad)


def test_function_local_imports_are_few_and_explained():
    local = [i for i in ALL_IMPORTS if i.local]
    unexplained = [f"{i.module}:{i.line} {i.target}" for i in local if not i.reason]
    assert not unexplained, "function-local imports need a one-line reason:\n" + "\n".join(unexplained)
    assert len(local) < MAX_LOCAL_IMPORTS, "too many function-local imports:\n" + "\n".join(
        f"{i.module}:{i.line} {i.target}  # {i.reason}" for i in local)


def test_modules_and_functions_stay_small():
    big_files, big_functions = [], []
    for p in _modules():
        src = p.read_text()
        n = src.count("\n") + 1
        if n > MAX_FILE_LINES:
            big_files.append(f"{p.relative_to(ROOT)} ({n} lines)")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    big_functions.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert not big_files, "modules over the limit:\n" + "\n".join(big_files)
    assert not big_functions, "functions over the limit:\n" + "\n".join(big_functions)


def test_every_module_has_a_docstring():
    missing = [str(p.relative_to(ROOT)) for p in _modules()
               if p.read_text().strip() and ast.get_docstring(ast.parse(p.read_text())) is None]
    assert not missing, "modules without a docstring:\n" + "\n".join(missing)


RANK_SIDE = ["partir_emu", "partir_emu.core.spmd", "partir_emu.primitives", "partir_emu.runtime.worker",
             "partir_emu.runtime.mpi_mesh", "partir_emu.runtime.local_mesh", "partir_emu.collectives.mpi",
             "partir_emu.hwmodels.analytical", "partir_emu.hwmodels.des.model"]


def test_rank_side_modules_load_without_jax():
    """What an MPI rank or a hardware-model run imports, imported for real in a fresh interpreter."""
    code = ("import importlib, sys\n"
            f"for m in {RANK_SIDE!r}: importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib'))\n"
            "print(','.join(bad[:5]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"jax was imported: {out.stdout.strip()}"
