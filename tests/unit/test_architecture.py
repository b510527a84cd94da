"""The package's structure, checked from its source: layers import only downward, the MPI ranks
and the hardware models stay free of jax, mpi4py stays inside ``partir_emu/mpi``, no two modules
import each other (not even for annotations), folders and modules stay small, and no module
reaches for another's private names.

Every file of ``partir_emu`` and ``scenarios`` is read and parsed once (:data:`SOURCES`). Imports
are read with ``ast`` at any depth, ``if TYPE_CHECKING:`` blocks included: an import for
annotations is still a dependency a reader must follow, and a cycle hidden there is a cycle. One
dynamic check imports the rank-side modules in a fresh interpreter and asserts that jax was not
loaded.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("partir_emu", "scenarios")

# Which partir_emu packages each layer may import (besides itself). ``app``, ``testing`` (the claims
# plugin, a user of the app's predictions) and the top-level modules (``api``, ``interop``, ``__init__``)
# are the only layers that may import everything and ``scenarios``.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "limits": {"errors"},             # bounded reading of user files: under everything that reads one
    "core": {"errors", "limits"},
    "primitives": {"core", "errors", "limits"},
    "collectives": {"core", "errors", "limits"},
    "compiler": {"core", "primitives", "errors", "limits"},
    "runtime": {"core", "primitives", "collectives", "errors", "limits"},
    "mpi": {"core", "primitives", "collectives", "runtime", "errors", "limits"},
    "hwmodels": {"core", "primitives", "collectives", "errors", "limits"},
}
TOP = {"app", "testing", "api", "interop", "__init__"}
NO_JAX = {"core", "primitives", "collectives", "runtime", "mpi", "hwmodels", "errors", "limits"}
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
MAX_LOCAL_IMPORTS = 15
MAX_MODULES_PER_FOLDER = 10        # ``.py`` files besides the folder's ``__init__.py``


@dataclass(frozen=True)
class Source:
    path: Path
    dotted: str
    text: str
    lines: list[str]
    tree: ast.Module


@dataclass(frozen=True)
class Import:
    module: str        # the importing module, dotted
    target: str        # the imported module, dotted (``from a import b``: ``a.b`` when that is a module)
    names: tuple[str, ...]   # the names a ``from`` import takes
    line: int
    local: bool        # inside a function
    reason: str        # the comment on the import line or the line above


def _dotted(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _read(path: Path) -> Source:
    text = path.read_text()
    return Source(path, _dotted(path), text, text.splitlines(), ast.parse(text))


SOURCES: list[Source] = [_read(p) for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
MODULES = {s.dotted for s in SOURCES}


def _layer(dotted: str) -> str:
    parts = dotted.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _comment(lines: list[str], lineno: int) -> str:
    here = lines[lineno - 1]
    if "#" in here:
        return here.split("#", 1)[1].strip()
    above = lines[lineno - 2].strip() if lineno >= 2 else ""
    return above[1:].strip() if above.startswith("#") else ""


def _imports(src: Source) -> list[Import]:
    out: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            fn = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            why = _comment(src.lines, getattr(child, "lineno", 1))
            if isinstance(child, ast.Import):
                for a in child.names:
                    out.append(Import(src.dotted, a.name, (), child.lineno, in_function, why))
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                subs = [a.name for a in child.names if f"{child.module}.{a.name}" in MODULES]
                names = tuple(a.name for a in child.names if a.name not in subs)
                if names or not subs:
                    out.append(Import(src.dotted, child.module, names, child.lineno, in_function, why))
                out.extend(Import(src.dotted, f"{child.module}.{s}", (), child.lineno, in_function, why) for s in subs)
            elif isinstance(child, ast.ImportFrom) and child.level:
                raise AssertionError(f"{src.dotted}:{child.lineno}: relative import; write the absolute path")
            visit(child, fn)

    visit(src.tree, False)
    return out


ALL_IMPORTS = [imp for s in SOURCES for imp in _imports(s)]
PACKAGE_IMPORTS = [i for i in ALL_IMPORTS if i.module.startswith("partir_emu")]


def test_layers_import_only_downward():
    bad = []
    for imp in PACKAGE_IMPORTS:
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


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    """One cycle of ``edges`` (a depth-first search for a back edge), or []."""
    state: dict[str, int] = {}
    found: list[str] = []

    def dfs(n: str, path: list[str]) -> None:
        state[n] = 1
        for m in sorted(edges.get(n, ())):
            if found:
                return
            if state.get(m) == 1:
                found.extend(path[path.index(m):] + [n, m] if m in path else [n, m])
                return
            if m not in state:
                dfs(m, path + [n])
        state[n] = 2

    for n in sorted(edges):
        if n not in state and not found:
            dfs(n, [])
    return found


def test_no_package_cycles():
    edges: dict[str, set[str]] = {}
    for imp in PACKAGE_IMPORTS:
        if imp.target.startswith("partir_emu."):
            a, b = _layer(imp.module), _layer(imp.target)
            if a != b:
                edges.setdefault(a, set()).add(b)
    cycle = _cycle(edges)
    assert not cycle, f"package cycle: {' -> '.join(cycle)}"


def _module_edges() -> dict[str, set[str]]:
    """Module -> the modules it imports, ``TYPE_CHECKING`` blocks included. A package's
    ``__init__`` re-exporting its own submodules is not an edge of concepts (it is the package's
    table of contents), so edges from a package into its own subtree are left out."""
    edges: dict[str, set[str]] = {}
    for imp in ALL_IMPORTS:
        t = imp.target
        while t and t not in MODULES:          # ``import a.b.c`` of a name inside a module
            t = t.rpartition(".")[0]
        if t and t != imp.module and not t.startswith(imp.module + "."):
            edges.setdefault(imp.module, set()).add(t)
    return edges


def test_no_module_cycles_not_even_for_annotations():
    """No two modules depend on each other, directly or around a loop, ``TYPE_CHECKING`` included
    (the DES once had model <-> collective <-> device; lower <-> lower_loops shared a private class)."""
    cycle = _cycle(_module_edges())
    assert not cycle, f"module cycle: {' -> '.join(cycle)}"


def test_the_cycle_finder_finds_a_cycle_hidden_under_type_checking():
    """The check above on a made-up pair: ``a`` imports ``b``, ``b`` imports ``a`` for annotations."""
    a = ast.parse("from pkg.b import g\n")
    b = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n")
    edges = {"pkg.a": set(), "pkg.b": set()}
    for name, tree in (("pkg.a", a), ("pkg.b", b)):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in edges:
                edges[name].add(node.module)
    assert _cycle(edges) in (["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.a", "pkg.b"])


def test_no_private_name_is_imported_across_modules():
    """``from m import _x`` or ``m._x`` from another module: the name is private to ``m`` for a
    reason (make it public with a docstring, or move the code that needs it next to it)."""
    bad = [f"{i.module}:{i.line} imports {n} from {i.target}" for i in ALL_IMPORTS
           if i.target.split(".")[0] in PACKAGES for n in i.names if n.startswith("_") and not n.startswith("__")]
    for s in SOURCES:
        aliases = {}
        for node in ast.walk(s.tree):
            if isinstance(node, ast.Import):
                aliases.update({(a.asname or a.name): a.name for a in node.names if a.name.split(".")[0] in PACKAGES})
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                aliases.update({(a.asname or a.name): f"{node.module}.{a.name}" for a in node.names
                                if f"{node.module}.{a.name}" in MODULES})
        for node in ast.walk(s.tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{s.dotted}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("layer", sorted(NO_JAX))
def test_lower_layers_never_import_jax(layer):
    bad = [f"{i.module}:{i.line} imports {i.target}" for i in PACKAGE_IMPORTS
           if _layer(i.module) == layer and i.target.split(".")[0] in ("jax", "jaxlib", "flax", "optax")]
    assert not bad, "\n".join(bad)


def test_hwmodels_never_import_mpi4py_or_the_app():
    bad = [f"{i.module}:{i.line} imports {i.target}" for i in PACKAGE_IMPORTS
           if _layer(i.module) == "hwmodels"
           and (i.target.startswith("mpi4py") or i.target.startswith("partir_emu.app")
                or i.target.split(".")[0] == "scenarios")]
    assert not bad, "\n".join(bad)


def test_mpi4py_is_imported_only_inside_partir_emu_mpi():
    """The MPI boundary is one package: every mpi4py import is in ``partir_emu/mpi``."""
    bad = [f"{i.module}:{i.line}" for i in ALL_IMPORTS
           if i.target.split(".")[0] == "mpi4py" and not i.module.startswith("partir_emu.mpi")]
    assert not bad, "mpi4py imported outside partir_emu/mpi:\n" + "\n".join(bad)


def test_function_local_imports_are_few_and_explained():
    local = [i for i in PACKAGE_IMPORTS if i.local]
    unexplained = [f"{i.module}:{i.line} {i.target}" for i in local if not i.reason]
    assert not unexplained, "function-local imports need a one-line reason:\n" + "\n".join(unexplained)
    assert len(local) < MAX_LOCAL_IMPORTS, "too many function-local imports:\n" + "\n".join(
        f"{i.module}:{i.line} {i.target}  # {i.reason}" for i in local)


def test_modules_and_functions_stay_small():
    big_files, big_functions = [], []
    for s in SOURCES:
        n = s.text.count("\n") + 1
        if n > MAX_FILE_LINES:
            big_files.append(f"{s.path.relative_to(ROOT)} ({n} lines)")
        for node in ast.walk(s.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    big_functions.append(f"{s.path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert not big_files, f"modules over {MAX_FILE_LINES} lines:\n" + "\n".join(big_files)
    assert not big_functions, "functions over the limit:\n" + "\n".join(big_functions)


def test_folders_hold_few_modules():
    """A folder of more than ten modules wants sub-folders by concept (a reader scans ten names)."""
    per_folder: dict[Path, int] = {}
    for s in SOURCES:
        if s.path.name != "__init__.py":
            per_folder[s.path.parent] = per_folder.get(s.path.parent, 0) + 1
    big = [f"{d.relative_to(ROOT)} ({n} modules)" for d, n in sorted(per_folder.items()) if n > MAX_MODULES_PER_FOLDER]
    assert not big, f"folders over {MAX_MODULES_PER_FOLDER} modules:\n" + "\n".join(big)


def test_every_module_has_a_docstring():
    missing = [str(s.path.relative_to(ROOT)) for s in SOURCES
               if s.text.strip() and ast.get_docstring(s.tree) is None]
    assert not missing, "modules without a docstring:\n" + "\n".join(missing)


RANK_SIDE = ["partir_emu", "partir_emu.mpi", "partir_emu.core.spmd", "partir_emu.primitives",
             "partir_emu.mpi.ranks.worker", "partir_emu.mpi.ranks.mesh", "partir_emu.runtime.local_mesh",
             "partir_emu.mpi.ranks.collectives", "partir_emu.hwmodels.analytical", "partir_emu.hwmodels.des.model"]


def test_rank_side_modules_load_without_jax():
    """What an MPI rank or a hardware-model run imports, imported for real in a fresh interpreter."""
    code = ("import importlib, sys\n"
            f"for m in {RANK_SIDE!r}: importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib'))\n"
            "print(','.join(bad[:5]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"jax was imported: {out.stdout.strip()}"


def test_the_driver_side_of_the_mpi_package_does_not_start_mpi():
    """Importing ``partir_emu.mpi`` and its launcher loads no mpi4py (the session's names load it on use)."""
    code = ("import partir_emu.mpi, partir_emu.mpi.launch, sys\n"
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] == 'mpi4py')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"mpi4py was imported: {out.stdout.strip()}"


def test_no_module_of_partir_emu_mpi_hides_a_session_name():
    """``partir_emu.mpi`` exports the session's names lazily; a submodule of the same name would win
    once imported (``partir_emu.mpi.rank`` once hid ``pmpi.rank()``)."""
    import partir_emu.mpi as pmpi
    here = ROOT / "partir_emu" / "mpi"
    subs = {p.stem for p in here.glob("*.py")} | {p.parent.name for p in here.glob("*/__init__.py")}
    assert not subs & set(pmpi.__all__), sorted(subs & set(pmpi.__all__))
