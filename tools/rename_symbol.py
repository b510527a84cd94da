"""Rename a top-level name of one module everywhere it is used.

    python tools/rename_symbol.py MODULE OLD NEW

In ``MODULE`` every ``OLD`` becomes ``NEW``; in every other tracked Python file that imports
``OLD`` from ``MODULE`` (``from MODULE import OLD``, also through a re-exporting package) every
``OLD`` becomes ``NEW``, unless the file also gets an ``OLD`` from elsewhere (then it is listed for
a manual fix); ``alias.OLD`` where ``alias`` is ``MODULE`` imported as a module becomes
``alias.NEW``; and the dotted ``MODULE.OLD`` in any tracked text file. A refactoring aid; the test
suite checks its result.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    module, old, new = argv
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    src = ROOT / (module.replace(".", "/") + ".py")
    word = re.compile(rf"\b{re.escape(old)}\b")
    manual = []
    reexporting = {pkg for pkg in {m.rpartition(".")[0] for m in _prefixes(module)} if _reexports(pkg, old, module)}
    for f in files:
        p = ROOT / f
        if not p.is_file():
            continue
        text = p.read_text()
        out = text.replace(f"{module}.{old}", f"{module}.{new}")
        if p.suffix == ".py":
            try:
                tree = ast.parse(text)
            except SyntaxError:
                tree = None
            if p == src:
                out = word.sub(new, out)
            elif tree is not None:
                ours, theirs, aliases = False, False, set()
                for node in ast.walk(tree):
                    if isinstance(node, ast.ImportFrom) and node.module:
                        for a in node.names:
                            if a.name == old:
                                if node.module == module or node.module in reexporting:
                                    ours = True
                                else:
                                    theirs = True
                            if f"{node.module}.{a.name}" == module:
                                aliases.add(a.asname or a.name)
                    elif isinstance(node, ast.Import):
                        aliases |= {a.asname for a in node.names if a.name == module and a.asname}
                if ours and theirs:
                    manual.append(f)
                elif ours:
                    out = word.sub(new, out)
                for al in aliases:
                    out = re.sub(rf"\b{re.escape(al)}\.{re.escape(old)}\b", f"{al}.{new}", out)
        if out != text:
            p.write_text(out)
    for f in manual:
        print("fix by hand (two names", old, "):", f)
    return 0


def _prefixes(module: str) -> list[str]:
    """``a.b.c`` -> [``a.b.c``, ``a.b``]: the module and its packages (as ``pkg.x`` names)."""
    parts = module.split(".")
    return [".".join(parts[:k]) + ".x" for k in range(1, len(parts))]


def _reexports(pkg: str, name: str, module: str) -> bool:
    """Whether package ``pkg`` re-exports ``name`` from ``module``."""
    init = ROOT / pkg.replace(".", "/") / "__init__.py"
    if not init.is_file():
        return False
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == module and any(a.name == name for a in node.names):
            return True
    return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
