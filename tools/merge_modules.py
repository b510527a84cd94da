"""Merge one module into another and rewrite every reference to the merged one.

    python tools/merge_modules.py SOURCE TARGET

``SOURCE`` and ``TARGET`` are dotted module names. The source's docstring becomes a paragraph of
the target's, its imports join the target's (ruff then sorts them; an import of the target by the
source, or of the source by the target, is dropped), its body goes first (the
target may use its names at import), under a section comment, the source file is removed with ``git rm``, and references are rewritten as
:mod:`move_modules` does. A refactoring aid; the test suite checks its result.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _split(path: Path) -> tuple[str, list[str], str]:
    """(docstring, import lines, the rest) of a module whose imports all come right after its docstring."""
    text = path.read_text()
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    doc = ast.get_docstring(tree, clean=False) or ""
    body = tree.body[1:] if doc else tree.body
    imports = []
    k = 0
    while k < len(body) and isinstance(body[k], (ast.Import, ast.ImportFrom)):
        node = body[k]
        imports.append("".join(lines[node.lineno - 1:node.end_lineno]))
        k += 1
    start = body[k].lineno - 1 if k < len(body) else len(lines)
    # decorators and comments right above the first statement belong to it
    first = body[k] if k < len(body) else None
    if first is not None and getattr(first, "decorator_list", None):
        start = min(d.lineno for d in first.decorator_list) - 1
    return doc, imports, "".join(lines[start:])


def main(argv: list[str]) -> int:
    source, target = argv
    sp, tp = (ROOT / (m.replace(".", "/") + ".py") for m in (source, target))
    sdoc, simps, sbody = _split(sp)
    tdoc, timps, tbody = _split(tp)
    keep = [i for i in timps + simps if f" {source} " not in i + " " and f" {target} " not in i + " "
            and "from __future__" not in i]
    name = source.rsplit(".", 1)[1].lstrip("_")
    if "\n__all__" in "\n" + tbody or "\n__all__" in "\n" + sbody:
        raise SystemExit(f"{source} or {target} has an __all__: merge those by hand")
    text = ('"""' + tdoc.rstrip() + "\n\n**" + name.replace("_", " ").capitalize() + ".** " + sdoc.strip() + '\n"""\n'
            + "from __future__ import annotations\n\n" + "".join(sorted(set(keep))) + "\n\n"
            + f"# -- {name} " + "-" * max(4, 96 - len(name)) + "\n" + sbody.strip() + "\n\n\n"
            + "# " + "-" * 98 + "\n" + tbody.strip() + "\n")
    tp.write_text(text)
    subprocess.run(["git", "rm", "-qf", str(sp)], cwd=ROOT, check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({source: target}, f)
    subprocess.run([sys.executable, str(ROOT / "tools" / "move_modules.py"), f.name, "--rewrite-only"], cwd=ROOT,
                   check=True)
    subprocess.run([str(Path(sys.executable).parent / "ruff"), "check", "--fix", "-q", str(tp)], cwd=ROOT)
    print(f"merged {source} into {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
