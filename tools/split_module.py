"""Move top-level definitions of one module into a new module and rewrite the imports of them.

    python tools/split_module.py SOURCE NEW "docstring of NEW" NAME [NAME ...]

``SOURCE`` and ``NEW`` are dotted module names; each ``NAME`` is a top-level function, class or
assigned name of ``SOURCE``. Their source text (with decorators and the comment lines right above)
moves to ``NEW``, which gets ``SOURCE``'s imports (ruff then drops the unused ones). ``SOURCE``
imports back what it still uses of them; ``NEW`` imports what it uses of what stays (both at once
is refused: that would be a cycle). In every other tracked file, ``from SOURCE import NAME`` is
rewritten to import from ``NEW``; ``alias.NAME`` uses through a module alias are listed for a
manual fix. A refactoring aid; the test suite checks its result.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _path(dotted: str) -> Path:
    return ROOT / (dotted.replace(".", "/") + ".py")


def _names_of(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def _used(nodes: list[ast.stmt]) -> set[str]:
    return {n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name)}


def main(argv: list[str]) -> int:
    source, new, doc, *names = argv
    sp, np_ = _path(source), _path(new)
    if np_.exists():
        raise SystemExit(f"{np_} exists")
    text = sp.read_text()
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    wanted = set(names)
    moved, kept, imports = [], [], []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(node)
        elif _names_of(node) & wanted:
            if not _names_of(node) <= wanted:
                raise SystemExit(f"{ast.unparse(node)[:60]} defines more than the names given")
            moved.append(node)
        else:
            kept.append(node)
    missing = wanted - set().union(*(_names_of(n) for n in moved)) if moved else wanted
    if missing:
        raise SystemExit(f"not top-level names of {source}: {sorted(missing)}")

    def span(node: ast.stmt) -> tuple[int, int]:
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
        while start > 0 and lines[start - 1].lstrip().startswith("#"):
            start -= 1
        return start, node.end_lineno or node.lineno

    spans = [span(n) for n in moved]
    moved_text = "\n\n".join("".join(lines[a:b]).rstrip() for a, b in spans)
    keep_defined = set().union(*(_names_of(n) for n in kept)) if kept else set()
    back = sorted(_used(kept) & wanted)                        # SOURCE still uses these
    forth = sorted(_used(moved) & keep_defined)                # NEW uses these of SOURCE
    if back and forth:
        raise SystemExit(f"a cycle: {source} uses {back} and {new} uses {forth}; move those too")
    import_text = "".join("".join(lines[n.lineno - 1:n.end_lineno]) for n in imports
                          if not (isinstance(n, ast.ImportFrom) and n.module == "__future__"))
    body = ('"""' + doc.strip() + '\n"""\nfrom __future__ import annotations\n\n' + import_text
            + (f"from {source} import {', '.join(forth)}\n" if forth else "") + "\n\n" + moved_text + "\n")
    np_.write_text(body)
    for a, b in sorted(spans, reverse=True):
        del lines[a:b]
    out = "".join(lines)
    out = re.sub(r"\n{4,}", "\n\n\n", out)
    if back:                                                   # after the last import
        last = max(n.end_lineno or n.lineno for n in imports)
        ls = out.splitlines(keepends=True)
        ls.insert(last, f"from {new} import {', '.join(back)}\n")
        out = "".join(ls)
    sp.write_text(out)
    subprocess.run(["git", "add", str(np_)], cwd=ROOT, check=True)
    # other files: from SOURCE import NAME -> from NEW import NAME
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    alias_uses = []
    for f in files:
        p = ROOT / f
        if p in (sp, np_) or not p.exists():
            continue
        src = p.read_text()
        try:
            t = ast.parse(src)
        except SyntaxError:
            continue
        ls = src.splitlines(keepends=True)
        edits = []
        aliases = set()
        for node in ast.walk(t):
            if isinstance(node, ast.ImportFrom) and node.module == source:
                take = [a for a in node.names if a.name in wanted]
                if not take:
                    continue
                rest = [a for a in node.names if a.name not in wanted]
                ind = re.match(r"\s*", ls[node.lineno - 1]).group(0)
                fmt = lambda al: ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in al)  # noqa: E731
                stmt = (f"{ind}from {source} import {fmt(rest)}\n" if rest else "") + f"{ind}from {new} import {fmt(take)}\n"
                edits.append((node.lineno - 1, node.end_lineno or node.lineno, stmt))
            elif isinstance(node, ast.ImportFrom) and node.module and any(
                    f"{node.module}.{a.name}" == source for a in node.names):
                aliases |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" == source}
            elif isinstance(node, ast.Import):
                aliases |= {a.asname for a in node.names if a.name == source and a.asname}
        for a, b, s in sorted(edits, reverse=True):
            ls[a:b] = [s]
        if edits:
            p.write_text("".join(ls))
        for al in aliases:
            for m in re.finditer(rf"\b{re.escape(al)}\.({'|'.join(map(re.escape, wanted))})\b", src):
                alias_uses.append(f"{f}: {m.group(0)}")
    subprocess.run([str(Path(sys.executable).parent / "ruff"), "check", "--fix", "-q", str(sp), str(np_)], cwd=ROOT)
    print(f"moved {len(moved)} definitions from {source} to {new}")
    for u in alias_uses:
        print("  fix by hand:", u)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
