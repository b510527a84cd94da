"""The test tiers are folders, and the folders are enforced (docs/tests.md): every test file is in
``tests/unit``, ``tests/integration``, ``tests/xla`` or ``tests/mpi``, and nothing in ``tests/unit``
imports jax (or flax, optax, equinox) — not at module level, not inside a function, not through
another test module, not through the partir_emu modules it imports."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
UNIT = TESTS / "unit"
TIERS = ("unit", "integration", "xla", "mpi")
JAX = ("jax", "jaxlib", "flax", "optax", "equinox")
OTHER_TIERS = tuple(f"tests.{t}" for t in TIERS if t != "unit")


def _test_files() -> list[Path]:
    return sorted({*TESTS.rglob("test_*.py"), *TESTS.rglob("*_test.py")})


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in ``tree``, and of every ``importlib.import_module("x")``
    or ``pytest.importorskip("x")`` with a literal name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("import_module", "importorskip") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


class _StripFunctions(ast.NodeTransformer):
    def visit_FunctionDef(self, node):
        return None

    visit_AsyncFunctionDef = visit_FunctionDef


def _module_level(text: str) -> ast.Module:
    """The statements of a module outside its functions (what importing it runs)."""
    return _StripFunctions().visit(ast.parse(text))


def _is_jax(name: str) -> bool:
    return name.split(".")[0] in JAX


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_every_test_file_is_in_a_tier_folder():
    stray = [_rel(p) for p in _test_files() if p.relative_to(TESTS).parts[0] not in TIERS]
    assert not stray, f"test files outside the tier folders tests/{{{','.join(TIERS)}}}/: {stray}"
    empty = [t for t in TIERS if not any((TESTS / t).rglob("test_*.py"))]
    assert not empty, f"tier folders without a test file: {empty}"


def test_every_tier_folder_is_a_package():
    """tests/ imports package-style (``from tests.unit.test_x import ...``): each folder needs its __init__."""
    folders = {p.parent for p in _test_files()}
    missing = [_rel(d) for d in sorted(folders) if not (d / "__init__.py").is_file()]
    assert not missing, f"no __init__.py in {missing}"


def test_unit_tests_never_import_jax():
    """Anywhere in a file of tests/unit (imports inside functions too); nor a test module of another
    tier; nor, at module level, a shared helper of tests/ (tests/conftest.py imports jax in fixtures)."""
    bad: set[str] = set()
    for path in sorted(UNIT.rglob("*.py")):
        for line, name in _imports(ast.parse(path.read_text())):
            if _is_jax(name):
                bad.add(f"{_rel(path)}:{line} imports {name}")
            elif name.startswith(OTHER_TIERS):
                bad.add(f"{_rel(path)}:{line} imports {name} (another tier's module)")
            elif name.startswith("tests.") and not name.startswith("tests.unit"):
                shared = TESTS / (name.split(".")[1] + ".py")        # a helper beside the tiers: tests/x.py
                if shared.is_file():
                    bad |= {f"{_rel(path)}:{line} imports {name}, whose line {n} imports {m}"
                            for n, m in _imports(_module_level(shared.read_text())) if _is_jax(m)}
    assert not bad, "tests/unit must run without jax:\n" + "\n".join(sorted(bad))


BLOCKED_IMPORT = """
import importlib, sys
class Block:
    def find_spec(self, name, *args):
        if name.split(".")[0] in {jax!r}:
            raise ImportError("tests/unit imported " + name)
sys.meta_path.insert(0, Block())
for m in {modules!r}:
    importlib.import_module(m)
"""


def test_unit_modules_import_with_jax_blocked():
    """What the ast cannot see: a partir_emu module that a unit test imports, and that imports jax."""
    modules = [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in sorted(UNIT.rglob("*.py"))]
    code = BLOCKED_IMPORT.format(jax=JAX, modules=[m.removesuffix(".__init__") for m in modules])
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
