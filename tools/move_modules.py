"""Move modules to new dotted names and rewrite every reference in the tracked files.

    python tools/move_modules.py MOVES.json [--dry-run | --rewrite-only]

``MOVES.json`` maps old dotted module names to new ones (``{"partir_emu.runtime.worker":
"partir_emu.mpi.ranks.worker"}``). The tool ``git mv``s each file, creates the ``__init__.py`` of
every new package (with a placeholder docstring to be written by hand), and rewrites, in every
tracked text file: dotted names (``partir_emu.runtime.worker`` and anything below it), paths
(``partir_emu/runtime/worker.py``), and ``from partir_emu.runtime import worker`` imports
(rewritten to ``from partir_emu.mpi.ranks import worker``, keeping the local name). It is a
one-off refactoring aid, not part of the package; the test suite checks its result.
``--rewrite-only`` rewrites the references and moves no file (after merging one module into another).
"""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = (".py", ".md", ".toml", ".ini", ".cfg", ".sh", ".txt", ".yml", ".yaml", "Makefile", ".json")


def _path(dotted: str) -> Path:
    return ROOT / (dotted.replace(".", "/") + ".py")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / f for f in out.split() if f.endswith(TEXT) and (ROOT / f).is_file()]


def _rewrite_from_imports(src: str, moves: dict[str, str]) -> str:
    """``from a.b import c`` where ``a.b.c`` moved: point the import at the new parent."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return src
    lines = src.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
            continue
        moved = [a for a in node.names if f"{node.module}.{a.name}" in moves]
        if not moved:
            continue
        indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
        stmts = []
        kept = [a for a in node.names if a not in moved]
        if kept:
            stmts.append(f"{indent}from {node.module} import "
                         + ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in kept) + "\n")
        for a in moved:
            new = moves[f"{node.module}.{a.name}"]
            parent, name = new.rsplit(".", 1)
            local = a.asname or a.name
            stmts.append(f"{indent}from {parent} import {name}" + (f" as {local}" if local != name else "") + "\n")
        edits.append((node.lineno - 1, node.end_lineno or node.lineno, "".join(stmts)))
    for start, end, text in sorted(edits, reverse=True):
        lines[start:end] = [text]
    return "".join(lines)


def main(argv: list[str]) -> int:
    moves: dict[str, str] = json.loads(Path(argv[0]).read_text())
    dry = "--dry-run" in argv
    only = "--rewrite-only" in argv
    for old, new in ([] if only else moves.items()):
        src, dst = _path(old), _path(new)
        if not src.exists():
            raise SystemExit(f"{old}: no file {src}")
        if dst.exists():
            raise SystemExit(f"{new}: {dst} exists already")
    if dry:
        print(json.dumps(moves, indent=1))
        return 0
    for old, new in ([] if only else moves.items()):
        dst = _path(new)
        for pkg in reversed(dst.relative_to(ROOT).parents[:-1]):
            init = ROOT / pkg / "__init__.py"
            if not init.exists():
                init.parent.mkdir(parents=True, exist_ok=True)
                init.write_text(f'"""{pkg.as_posix().replace("/", ".")}: TODO docstring."""\n')
                subprocess.run(["git", "add", str(init)], cwd=ROOT, check=True)
        subprocess.run(["git", "mv", str(_path(old)), str(dst)], cwd=ROOT, check=True)
    olds = sorted(moves, key=len, reverse=True)
    dotted = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, olds)) + r")(?!\w)")
    paths = {o.replace(".", "/") + ".py": n.replace(".", "/") + ".py" for o, n in moves.items()}
    pathre = re.compile(r"(?<![\w/])(" + "|".join(map(re.escape, sorted(paths, key=len, reverse=True))) + r")")
    changed = 0
    for f in _tracked():
        text = f.read_text()
        # dotted names first: the rewritten ``from`` imports name new packages, which an old
        # module's name may equal (``scenarios.gns`` was a module and is now the package)
        new = dotted.sub(lambda m: moves[m.group(1)], text)
        new = _rewrite_from_imports(new, moves) if f.suffix == ".py" else new
        new = pathre.sub(lambda m: paths[m.group(1)], new)
        if new != text:
            f.write_text(new)
            changed += 1
    print(f"moved {len(moves)} modules, rewrote {changed} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
