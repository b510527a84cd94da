"""The lock file: the exact environment the suite passed with, installed by ``make setup``.

``pyproject.toml`` keeps version *ranges* (for people who use partir_emu as a library);
``requirements.lock`` pins every package of the development environment, pip and setuptools
included, so that a fresh clone next month gets the numpy, jaxlib and OpenBLAS that CI passed
with (tests that compare bits move with them).

    python tools/lock.py write     # regenerate: a fresh venv from the ranges, then pip freeze (make lock)
    python tools/lock.py write --keep   # the same, every package already locked held at its pin
                                        # (a dependency added to pyproject: only the new ones move;
                                        # pip says which pin a new package cannot live with)
    python tools/lock.py check     # the running interpreter's packages are exactly the lock's (make setup)

``write`` resolves the ranges in a new virtual environment made by this interpreter, so the lock
is for this Python version and platform (its header says which; ``check`` warns on another).
Standard library only: it runs before anything is installed.
"""
from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
PROJECT = "partir_emu"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """``{normalised name: version}`` of the lock's ``name==version`` lines."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise SystemExit(f"{path}: {line!r} is not name==version; regenerate it with `make lock`")
        out[_norm(name)] = version.strip()
    return out


def header() -> str:
    return (f"# partir_emu development environment, exact versions (python tools/lock.py write; `make lock`).\n"
            f"# Made with Python {platform.python_version()} on {platform.system()} {platform.machine()}; "
            f"`make setup` installs it with --no-deps.\n")


def write(keep: bool = False) -> int:
    """Resolve the pyproject ranges in a new venv and freeze it; ``keep``: the current lock as pip
    constraints, so that what it pins stays as it is."""
    with tempfile.TemporaryDirectory(prefix="partir-emu-lock-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        py = str(venv / "bin" / "python")
        pins = ["-c", str(LOCK)] if keep else []
        subprocess.run([py, "-m", "pip", "install", "-q", "--upgrade", *pins, "pip", "setuptools"], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", *pins, f"{ROOT}[dev]"], check=True)
        frozen = subprocess.run([py, "-m", "pip", "freeze", "--all", "--exclude", PROJECT], check=True,
                                capture_output=True, text=True).stdout
    lines = sorted(ln for ln in frozen.splitlines() if "==" in ln)
    LOCK.write_text(header() + "\n".join(lines) + "\n")
    print(f"wrote {LOCK.name}: {len(lines)} packages")
    return 0


def check() -> int:
    """Compare the installed distributions with the lock; exit 1 listing what differs."""
    want = read_lock()
    have = {_norm(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}
    have.pop(_norm(PROJECT), None)
    wrong = [f"{n}: installed {have.get(n, 'nothing')}, locked {v}" for n, v in sorted(want.items()) if have.get(n) != v]
    extra = sorted(f"{n}=={v}" for n, v in have.items() if n not in want)
    missing = _unpinned()
    made = re.search(r"Made with Python (\S+)", LOCK.read_text())
    if made and made.group(1).rsplit(".", 1)[0] != platform.python_version().rsplit(".", 1)[0]:
        print(f"warning: {LOCK.name} was made with Python {made.group(1)}, this is {platform.python_version()}; "
              f"run `make lock` with this Python if the install fails", file=sys.stderr)
    for what, items in (("differ from the lock", wrong), ("are installed but not locked", extra),
                        ("are pyproject dependencies missing from the lock", missing)):
        if items:
            print(f"{len(items)} package(s) {what}:\n  " + "\n  ".join(items), file=sys.stderr)
    if wrong or extra or missing:
        print(f"the environment is not {LOCK.name}'s: `make clean setup` reinstalls it, `make lock` regenerates it",
              file=sys.stderr)
        return 1
    print(f"environment matches {LOCK.name} ({len(want)} packages)")
    return 0


def _unpinned() -> list[str]:
    """pyproject dependencies (runtime and dev) that the lock does not pin."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + [r for group in project.get("optional-dependencies", {}).values()
                                           for r in group]
    locked = read_lock()
    names = {_norm(re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0]) for r in reqs}
    return sorted(n for n in names if n not in locked)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("write", "check"))
    ap.add_argument("--keep", action="store_true", help="write: keep every pin of the current lock")
    args = ap.parse_args()
    return write(args.keep) if args.what == "write" else check()


if __name__ == "__main__":
    sys.exit(main())
