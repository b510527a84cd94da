"""How one CLI command flows through the layers: calls between partir_emu modules, counted by kind.

    python tools/flow.py run mlp --strategy bp --mesh batch=2
    python tools/flow.py simulate transformer --size small --strategy bp+mp --mesh batch=2,model=2

Every Python call whose caller and callee are both partir_emu (or scenarios) functions is recorded
(``sys.setprofile``), and each *distinct* caller-module → callee-module edge is classified by the
layers of :mod:`tests.unit.test_architecture` (core 0; primitives, collectives 1; compiler, runtime,
hwmodels 2; mpi 3; app, api, interop, scenarios 4):

- **stay**: within one module's package (``hwmodels.network.comm`` → ``hwmodels.network.contention``);
- **down**: into a lower layer, or a sibling package of the same layer;
- **climb**: into a higher layer: a callback passed down (the imports never go up, so only a
  function object can make this call); these are the ones to keep few.

Printed: the counts, and every climb edge with how many calls it made. A measurement aid, not part
of the package.
"""
from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK = {"errors": 0, "limits": 0, "core": 0, "primitives": 1, "collectives": 1, "compiler": 2, "runtime": 2, "hwmodels": 2,
        "mpi": 3, "app": 4, "api": 4, "interop": 4, "__init__": 4, "scenarios": 4}


def _module(code_file: str) -> str | None:
    try:
        rel = Path(code_file).resolve().relative_to(ROOT)
    except ValueError:
        return None
    if rel.parts[0] not in ("partir_emu", "scenarios") or rel.suffix != ".py":
        return None
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "scenarios":
        return "scenarios"
    return "__init__" if len(parts) == 1 else parts[1]


def _package(module: str) -> str:
    return module.rpartition(".")[0]


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from partir_emu.app.cli.main import main as cli

    calls: Counter[tuple[str, str]] = Counter()
    modules: dict[object, str | None] = {}

    def prof(frame, event, _arg):  # noqa: ANN001
        if event != "call":
            return
        code = frame.f_code
        callee = modules.get(code)
        if callee is None and code not in modules:
            callee = modules[code] = _module(code.co_filename)
        if callee is None or frame.f_back is None:
            return
        bcode = frame.f_back.f_code
        caller = modules.get(bcode)
        if caller is None and bcode not in modules:
            caller = modules[bcode] = _module(bcode.co_filename)
        if caller is not None and caller != callee:
            calls[(caller, callee)] += 1

    threading.setprofile(prof)
    sys.setprofile(prof)
    try:
        rc = cli(argv)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    kinds: Counter[str] = Counter()
    climbs = []
    for (a, b), n in sorted(calls.items()):
        la, lb = _layer(a), _layer(b)
        if _package(a) == _package(b):
            kinds["stay"] += 1
        elif RANK[lb] > RANK[la]:
            kinds["climb"] += 1
            climbs.append((a, b, n))
        else:
            kinds["down"] += 1
    print(f"partir-emu {' '.join(argv)}: exit {rc}")
    print(f"distinct module-to-module call edges: {sum(kinds.values())} "
          f"(stay {kinds['stay']}, down {kinds['down']}, climb {kinds['climb']})")
    for a, b, n in climbs:
        print(f"  climb: {a} -> {b}  ({n} calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
