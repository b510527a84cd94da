"""One scenario × strategy × mesh run: build inputs, lower, execute, verify.

Shared by the CLI, the benchmarks and the tests. Lowering traces with
abstract inputs (nothing allocated), so full-size presets can be lowered for
simulation. Real inputs are numpy, generated deterministically from the seed,
and flattened in jax's pytree order without importing jax (so MPI ranks can
make their own copy).
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partir_emu.core.mesh import Mesh
from partir_emu.errors import ArgumentError, EmulationError

RTOL = 1e-5
ATOL = 1e-6


def flatten(tree: Any) -> list[np.ndarray]:
    """Leaves in jax's order for nested dicts/lists/tuples (dict keys sorted)."""
    if isinstance(tree, dict):
        return [x for k in sorted(tree) for x in flatten(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [x for t in tree for x in flatten(t)]
    return [np.asarray(tree)]


@dataclass
class Experiment:
    scenario_name: str
    strategy: str
    mesh: Mesh
    preset: str | None = None
    overrides: str | dict | None = None
    seed: int = 0
    inputs_file: str | None = None       # load inputs from this .npz instead of generating them
    scenario: Any = field(init=False)
    cfg: dict = field(init=False)

    def __post_init__(self) -> None:
        from scenarios import get_scenario
        self.scenario = get_scenario(self.scenario_name)
        self.cfg = self.scenario.config(self.preset, self.overrides)

    @property
    def schedule(self):
        return self.scenario.strategy(self.strategy, self.mesh, self.cfg)

    def lower(self):
        """Trace (abstractly), partition and lower. Imports jax."""
        from partir_emu.compiler.api import lower_program, trace
        from scenarios.common import STATE_OUTPUTS
        step = self.scenario.make_step(self.cfg)
        prog = trace(step, *self.scenario.abstract_inputs(self.cfg))
        return lower_program(prog, self.mesh, self.schedule, STATE_OUTPUTS)

    def inputs(self, names: Sequence[str] | None = None) -> list[np.ndarray]:
        """Global inputs, flat, in the program's input order (numpy only): generated from the
        seed, or read from ``inputs_file`` (keys = input ``names``, or arr_0, arr_1, ...)."""
        if self.inputs_file:
            return load_inputs_npz(self.inputs_file, names or self.scenario.input_names(self.cfg))
        return flatten(self.scenario.make_inputs(self.cfg, self.seed))

    def reference(self, inputs: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """The unpartitioned ``jax.jit(step)`` on the same (flat) inputs."""
        import jax
        treedef = jax.tree_util.tree_structure(self.scenario.abstract_inputs(self.cfg))
        args = jax.tree_util.tree_unflatten(treedef, list(self.inputs() if inputs is None else inputs))
        out = jax.jit(self.scenario.make_step(self.cfg))(*args)
        return [np.asarray(x) for x in jax.tree_util.tree_leaves(out)]


@dataclass(frozen=True)
class Verification:
    verified: bool
    max_abs_err: float
    max_rel_err: float
    worst: str

    def to_json(self) -> dict:
        return {"verified": self.verified, "max_abs_err": self.max_abs_err, "max_rel_err": self.max_rel_err,
                "worst_output": self.worst}


def verify(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray], names: Sequence[str],
           rtol: float = RTOL, atol: float = ATOL) -> Verification:
    if len(outputs) != len(reference):
        raise EmulationError(f"{len(outputs)} outputs but the reference has {len(reference)}")
    ok, worst, max_abs, max_rel = True, "", 0.0, 0.0
    for o, r, n in zip(outputs, reference, names):
        o = np.asarray(o)
        r = np.asarray(r)
        if o.shape != r.shape:
            raise EmulationError(f"output {n!r}: shape {o.shape}, reference {r.shape}")
        if o.size == 0:
            continue
        diff = np.abs(o.astype(np.float64) - r.astype(np.float64))
        a = float(diff.max())
        rel = float((diff / np.maximum(np.abs(r.astype(np.float64)), 1e-30)).max())
        if a > max_abs:
            max_abs, worst = a, n
        max_rel = max(max_rel, rel)
        if not np.allclose(o, r, rtol=rtol, atol=atol):
            ok = False
            worst = n
    return Verification(ok, max_abs, max_rel, worst)


def run_local(exp: Experiment, algorithm: str = "ring", lowered=None) -> dict:
    """Run on the in-process mesh, verify against jax.jit, return the JSON report."""
    from partir_emu.runtime.local_mesh import LocalMesh
    t0 = time.perf_counter()
    low = lowered or exp.lower()
    t1 = time.perf_counter()
    inputs = exp.inputs(low.spmd.input_names)
    res = LocalMesh(exp.mesh, algorithm=algorithm).run(low.spmd, inputs)
    t2 = time.perf_counter()
    ver = verify(res.outputs, exp.reference(inputs), low.spmd.output_names)
    return report(exp, low.spmd, "local", ver, res.peak_bytes_per_device, wall_s=time.perf_counter() - t0,
                  extra={"lower_s": t1 - t0, "step_s": t2 - t1, "algorithm": algorithm})


def report(exp: Experiment, spmd, backend: str, ver: Verification, peak: Sequence[int], wall_s: float,
           extra: dict | None = None) -> dict:
    st = spmd.stats()
    out = {
        "scenario": exp.scenario_name, "strategy": exp.strategy, "size": exp.cfg,
        "mesh": dict(exp.mesh.axes), "devices": exp.mesh.size, "backend": backend,
        "verified": ver.verified, "max_abs_err": ver.max_abs_err, "max_rel_err": ver.max_rel_err,
        "worst_output": ver.worst, "collectives": st.count, "collective_bytes": st.bytes,
        "collectives_by_axes": st.by_axes, "comm_bytes_per_device": st.wire_bytes_per_device,
        "peak_bytes_per_device": int(max(peak)) if len(peak) else 0, "wall_s": wall_s,
        "tactics": [t.name or t.describe() for t in exp.schedule],
    }
    out.update(extra or {})
    return out


def load_inputs_npz(path: str | os.PathLike, names: Sequence[str]) -> list[np.ndarray]:
    """Inputs from an ``.npz`` (no pickles): keys = input names, or ``arr_0 …`` in input order."""
    try:
        with np.load(path, allow_pickle=False) as z:
            keys = list(z.keys())
            if all(n in keys for n in names):
                return [z[n] for n in names]
            if all(f"arr_{i}" in keys for i in range(len(names))):
                return [z[f"arr_{i}"] for i in range(len(names))]
    except (OSError, ValueError) as exc:
        raise ArgumentError(f"--inputs {path}: cannot read it as an .npz without pickles ({exc})") from None
    missing = [n for n in names if n not in keys][:5]
    raise ArgumentError(f"--inputs {path}: keys {keys[:5]}{'…' if len(keys) > 5 else ''} are neither the program's "
                        f"input names (missing e.g. {missing}) nor arr_0..arr_{len(names) - 1}")
