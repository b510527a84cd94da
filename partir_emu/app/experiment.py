"""One scenario × strategy × mesh run: build inputs, lower, execute, verify.

Verification (:mod:`partir_emu.runtime.verdict`) holds the run's outputs against the unpartitioned
step computed in float64, relative to what the unpartitioned float32 ``jax.jit`` achieves.
:func:`verify` is the strict elementwise comparison the tests use for exact-ish checks.

Shared by the CLI, the benchmarks and the tests. Lowering traces with
abstract inputs (nothing allocated), so full-size presets can be lowered for
simulation. Real inputs are numpy, generated deterministically from the seed,
and flattened in jax's pytree order without importing jax (so MPI ranks can
make their own copy).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partir_emu.api import Lowered, lower_program, trace
from partir_emu.core.dtypes import array_files, restored
from partir_emu.core.ir import Program
from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import ArgumentError, EmulationError
from partir_emu.mpi.interrupts import responsive
from partir_emu.runtime.local_mesh import LocalMesh
from partir_emu.runtime.rounding import other_orders
from partir_emu.runtime.verdict import (
    UNIT_ROUNDOFF,
    References,
    Verdict,
    compute_precision,
    judge_references,
    judge_strict,
    reduction_length,
)
from scenarios import get_scenario
from scenarios.precision import reference_config

RTOL = 1e-5
ATOL = 1e-6


def _jax() -> Any:
    import jax  # why: MPI ranks import this module (flatten, inputs) and must never load jax
    return jax


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
    strict: bool = False                 # check loss and gradients before the optimizer, elementwise
    scenario: Any = field(init=False)
    cfg: dict = field(init=False)

    def __post_init__(self) -> None:
        self.scenario = get_scenario(self.scenario_name)
        self.cfg = self.scenario.config(self.preset, self.overrides)

    @property
    def schedule(self):
        return self.scenario.strategy(self.strategy, self.mesh, self.cfg)

    def make_step(self) -> Any:
        """The scenario's step; in strict mode a training step stops before the optimizer (loss and
        gradients; see ``Scenario.build_step``)."""
        return self.scenario.build_step(self.cfg, strict=self.strict)

    def with_strategy(self, strategy: str, mesh: Mesh) -> Experiment:
        """The same step (same scenario, size, seed, inputs) under another strategy and mesh; the
        traced program and the jitted references are shared, not made again."""
        other = dataclasses.replace(self, strategy=strategy, mesh=mesh)
        for name in ("program", "jitted_step", "high_precision_step"):
            if name in self.__dict__:
                other.__dict__[name] = self.__dict__[name]
        return other

    @functools.cached_property
    def program(self) -> Program:
        """The traced global step (abstract inputs: nothing allocated). Imports jax on first use."""
        return responsive(lambda: trace(self.make_step(), *self.scenario.abstract_inputs(self.cfg)))

    def lower(self) -> Lowered:
        """Trace (abstractly), partition and lower."""
        lowered = responsive(lambda: lower_program(self.program, self.mesh, self.schedule,
                                                   dict(self.scenario.state_outputs)))
        if self.scenario.program_meta is not None:
            lowered.spmd.meta.update(self.scenario.program_meta(self.cfg))
        return lowered

    def inputs(self, names: Sequence[str] | None = None) -> list[np.ndarray]:
        """Global inputs, flat, in the program's input order (numpy only): generated from the
        seed, or read from ``inputs_file`` (keys = input ``names``, or arr_0, arr_1, ...)."""
        if self.inputs_file:
            return load_inputs_npz(self.inputs_file, names or self.scenario.input_names(self.cfg))
        return flatten(self.scenario.make_inputs(self.cfg, self.seed))

    @functools.cached_property
    def jitted_step(self) -> Any:
        """``jax.jit`` of the unpartitioned step, made once (jax caches its compilations per
        input signature, so float32 and float64 calls each compile once)."""
        return _jax().jit(self.make_step())

    @functools.cached_property
    def high_precision_step(self) -> Any:
        """The step the float64 reference runs: a ``precision=bf16`` configuration's casts to
        bfloat16 would still round under x64, so its reference is the same step with
        ``precision=f32`` (no casts), run in float64; otherwise (``precision=fp8`` too: its
        quantisers are part of the step) the step itself (:func:`scenarios.precision.reference_config`)."""
        ref = reference_config(self.cfg)
        if ref is self.cfg:
            return self.jitted_step
        return _jax().jit(self.scenario.build_step(ref, strict=self.strict))

    def reference(self, inputs: Sequence[np.ndarray] | None = None, *, x64: bool = False) -> list[np.ndarray]:
        """The unpartitioned ``jax.jit(step)`` on the same (flat) inputs; with ``x64`` in float64
        (float inputs cast up, jax's 64-bit mode on for this call only). Like tracing and lowering, in
        a helper thread under the CLI (:func:`~partir_emu.mpi.interrupts.responsive`)."""
        return responsive(lambda: self._reference(inputs, x64))

    def _reference(self, inputs: Sequence[np.ndarray] | None, x64: bool) -> list[np.ndarray]:
        jax = _jax()
        flat = list(self.inputs() if inputs is None else inputs)
        if x64:
            flat = [x.astype(np.float64) if x.dtype.kind == "f" else x for x in map(np.asarray, flat)]
        treedef = jax.tree_util.tree_structure(self.scenario.abstract_inputs(self.cfg))
        args = jax.tree_util.tree_unflatten(treedef, flat)
        with jax.enable_x64(x64):
            out = (self.high_precision_step if x64 else self.jitted_step)(*args)
            return [np.asarray(x) for x in jax.tree_util.tree_leaves(out)]

    def references(self, inputs: Sequence[np.ndarray]) -> References:
        """What a run on ``inputs`` is judged against (:class:`~partir_emu.runtime.verdict.References`):
        the unpartitioned step by ``jax.jit``, in float64, and (unless the strict check needs only
        ``jax.jit``) the unpartitioned program in other summation orders."""
        jit, ref64 = self.reference(inputs), self.reference(inputs, x64=True)
        if self._strict_elementwise:
            return References(jit, ref64)
        return References(jit, ref64, tuple(other_orders(self.program, inputs)))

    @property
    def _strict_elementwise(self) -> bool:
        """The strict check on a program that computes in float32 or better: elementwise vs jax.jit."""
        return self.strict and UNIT_ROUNDOFF[compute_precision(self.program)] <= UNIT_ROUNDOFF["float32"]

    def check(self, outputs: Sequence[np.ndarray], inputs: Sequence[np.ndarray], names: Sequence[str],
              refs: References | None = None) -> Verdict:
        """The verdict on a run's global outputs (see :mod:`partir_emu.runtime.verdict`); ``refs`` from
        :meth:`references` when they were computed earlier (e.g. while MPI ranks started)."""
        refs = refs if refs is not None else self.references(inputs)
        if self._strict_elementwise:
            return judge_strict(outputs, refs.jit, names)
        precision = compute_precision(self.program)
        ver = judge_references(outputs, refs, names, reduction_length(self.program), precision=precision)
        if self.strict:   # rtol 1e-5 elementwise is below bfloat16's resolution (2^-8): normwise instead
            return dataclasses.replace(ver, criterion=f"{ver.criterion} (--strict on a {precision} program: "
                                                      f"loss and gradients)")
        return ver


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


def run_local(exp: Experiment, algorithm: str = "ring", lowered: Lowered | None = None, kernels: str = "blas") -> dict:
    """Run on the in-process mesh (``kernels``: the matmul kernel), verify, return the JSON report."""
    t0 = time.perf_counter()
    low = lowered or exp.lower()
    t1 = time.perf_counter()
    inputs = exp.inputs(low.spmd.input_names)
    res = LocalMesh(exp.mesh, algorithm=algorithm, kernels=kernels).run(low.spmd, inputs)
    t2 = time.perf_counter()
    ver = exp.check(res.outputs, inputs, low.spmd.output_names)
    return report(exp, low.spmd, "local", ver, res.peak_bytes_per_device, wall_s=time.perf_counter() - t0,
                  extra={"lower_s": t1 - t0, "step_s": t2 - t1, "algorithm": algorithm, "kernels": kernels})


def report(exp: Experiment, spmd: SpmdProgram, backend: str, ver: Verdict, peak: Sequence[int], wall_s: float,
           extra: dict | None = None) -> dict:
    """The JSON report of one run. ``error``/``baseline_error``: the largest normwise relative error
    of an output against the float64 reference, ours and ``jax.jit``'s; ``verdict`` has them per
    output with the worst element."""
    st = spmd.stats()
    out = {
        "scenario": exp.scenario_name, "strategy": exp.strategy, "size": exp.cfg,
        "mesh": dict(exp.mesh.axes), "devices": exp.mesh.size, "backend": backend,
        "verified": ver.verified, "max_abs_err": ver.max_abs_err, "error": ver.max_err,
        "baseline_error": ver.max_baseline_err, "worst_output": ver.worst.name if ver.worst else "",
        "verdict": ver.to_json(), "collectives": st.count, "collective_bytes": st.bytes,
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
            keys = array_files(z)   # bfloat16 arrays come back with their dtype (core.dtypes.storable)
            if all(n in keys for n in names):
                return [restored(z, n) for n in names]
            if all(f"arr_{i}" in keys for i in range(len(names))):
                return [restored(z, f"arr_{i}") for i in range(len(names))]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:   # not an npz, truncated, ...
        raise ArgumentError(f"--inputs {path}: cannot read it as an .npz without pickles ({exc})") from None
    missing = [n for n in names if n not in keys][:5]
    raise ArgumentError(f"--inputs {path}: keys {keys[:5]}{'…' if len(keys) > 5 else ''} are neither the program's "
                        f"input names (missing e.g. {missing}) nor arr_0..arr_{len(names) - 1}")
