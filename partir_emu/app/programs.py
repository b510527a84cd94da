"""One cache of lowered programs, for the commands and the tests: in memory, and on disk in a directory.

Lowering a step (tracing it, partitioning it, searching an ``AutomaticPartition``) is most of the
time of ``validate``, ``fidelity`` and ``calibrate``, and of the test suite, where one strategy of
one scenario is lowered by many modules and child processes. A :class:`ProgramCache` keeps each
lowered :class:`~partir_emu.core.spmd.SpmdProgram` once.

**The key is everything that shapes the program**: the scenario, its whole configuration after the
overrides (not the text the user typed), the strategy, the mesh's axes and sizes, the strict flag,
the program file format, and a digest of the source of ``partir_emu`` and ``scenarios`` (so an
entry written by other code is never used). Seeds and input files do not shape the program and are
not in it.

**An entry is checked when it is read**: it is one JSON file ``<key digest>.json`` that holds the key
itself, the program's text and the SHA-256 of that text. A file that does not parse, holds another
key, or whose text does not hash to its digest (truncated by a killed writer, edited, another
version), or whose program does not read back as one for the key's mesh (a dtype that is not
jax's, a local shape that its sharding on that mesh does not give) is reported in one line on stderr and lowered again; the new entry replaces it atomically
(:func:`partir_emu.app.atomic.atomic_path`), so concurrent processes see the old file or the new one.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from partir_emu.app.atomic import atomic_path
from partir_emu.app.experiment import Experiment
from partir_emu.core.spmd import FORMAT, VERSION, SpmdProgram
from partir_emu.errors import ArtifactError
from partir_emu.limits import loads

ENTRY_FORMAT = "partir-emu-program-cache/1"
ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def source_digest() -> str:
    """SHA-256 over the source files of partir_emu and scenarios (path and content), once per process."""
    h = hashlib.sha256()
    for pkg in ("partir_emu", "scenarios"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def program_key(exp: Experiment) -> dict[str, Any]:
    """What shapes ``exp``'s lowered program (see the module docstring)."""
    return {"scenario": exp.scenario_name, "config": exp.cfg, "strategy": exp.strategy,
            "mesh": [[a, int(n)] for a, n in exp.mesh.axes], "strict": bool(exp.strict),
            "format": [FORMAT, VERSION], "source": source_digest()}


class ProgramCache:
    """Lowered SpmdPrograms by :func:`program_key`, the last ``memory`` in memory and all of them in
    ``directory`` when one is given. ``lower_s``: seconds spent lowering (misses); ``hits``, ``misses``."""

    def __init__(self, directory: str | os.PathLike | None = None, *, memory: int = 64) -> None:
        self.directory = Path(directory) if directory else None
        self.memory = memory
        self._mem: OrderedDict[str, SpmdProgram] = OrderedDict()
        self.lower_s = 0.0
        self.hits = self.misses = 0

    def spmd(self, exp: Experiment) -> SpmdProgram:
        """``exp``'s lowered program, from the cache or lowered now (and kept)."""
        key = program_key(exp)
        text = json.dumps(key, sort_keys=True)
        name = hashlib.sha256(text.encode()).hexdigest()[:32]
        hit = self._mem.get(name)
        if hit is None and self.directory is not None:
            hit = self._read(self.directory / f"{name}.json", key, exp)
        if hit is not None:
            self.hits += 1
            self._keep(name, hit)
            return hit
        self.misses += 1
        t0 = time.perf_counter()
        spmd = exp.lower().spmd
        self.lower_s += time.perf_counter() - t0
        if self.directory is not None:
            self._write(self.directory / f"{name}.json", key, spmd)
        self._keep(name, spmd)
        return spmd

    def _keep(self, name: str, spmd: SpmdProgram) -> None:
        self._mem[name] = spmd
        self._mem.move_to_end(name)
        while len(self._mem) > self.memory:
            self._mem.popitem(last=False)

    @staticmethod
    def _write(path: Path, key: dict, spmd: SpmdProgram) -> None:
        body = spmd.dumps()
        entry = {"format": ENTRY_FORMAT, "key": key, "sha256": hashlib.sha256(body.encode()).hexdigest(),
                 "program": body}
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            Path(tmp).write_text(json.dumps(entry))

    @staticmethod
    def _read(path: Path, key: dict, exp: Experiment) -> SpmdProgram | None:
        """The entry at ``path`` if it holds ``key`` and checks out (and its program takes ``exp``'s
        inputs: names and global shapes); None (with a warning when a file was there) otherwise."""
        if not path.is_file():
            return None
        why = None
        try:
            entry = loads(path.read_text(), str(path), ArtifactError, "program cache entry", finite=False)
            if not isinstance(entry, dict) or entry.get("format") != ENTRY_FORMAT:
                why = f"not a {ENTRY_FORMAT} entry"
            elif entry.get("key") != json.loads(json.dumps(key)):
                why = "it was written for another program"
            elif hashlib.sha256(str(entry.get("program", "")).encode()).hexdigest() != entry.get("sha256"):
                why = "its program does not match its SHA-256 (truncated or edited)"
            else:
                spmd = SpmdProgram.loads(entry["program"], str(path))
                want = {n: tuple(s) for n, s in exp.scenario.input_shapes(exp.cfg).items()}
                if [[a, int(n)] for a, n in spmd.mesh.axes] != key["mesh"]:
                    why = f"its program was lowered for {spmd.mesh}, not for the mesh of its key"
                elif dict(zip(spmd.input_names, spmd.global_in_shapes)) != want or len(spmd.input_names) != len(want):
                    why = "its program's inputs (names or global shapes) are not the scenario's"
                else:
                    return spmd
        except (OSError, ValueError, RecursionError, ArtifactError, KeyError, TypeError) as exc:
            why = str(exc).splitlines()[0].removeprefix(f"{path}: ")[:200] if str(exc) else type(exc).__name__
        print(f"partir-emu: warning: ignoring the program cache entry {path} ({why}); lowering it again",
              file=sys.stderr)
        return None
