"""The user-facing entry points: ``trace``, ``lower_program`` and ``jit``.

``jit(fn, mesh=..., schedule=[...])`` returns a callable that traces ``fn`` on its first call
(and again for new argument shapes, like ``jax.jit``), partitions and lowers it, and runs the
SPMD program on the in-process mesh. ``.lower(*args)`` returns a :class:`Lowered` with the
SpmdProgram, its collective statistics and the sharding state after every tactic.

This is the app layer: it joins the compiler (which knows no hardware and runs nothing) to the
runtime (:class:`~partir_emu.runtime.local_mesh.LocalMesh`) and to the hardware models, whose
analytical step time prices an :class:`AutomaticPartition` that has no ``cost`` of its own.
MPI ranks import this module (through :mod:`partir_emu.app.experiment`), so jax is loaded
only when something is traced; ``import partir_emu`` loads this module only when
``jit``/``trace``/``lower_program`` is first used.
"""
from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partir_emu.compiler import api as compiler_api
from partir_emu.compiler.auto.space import Price
from partir_emu.compiler.tactics import AutomaticPartition, CostModel, Tactic
from partir_emu.core.ir import Program
from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import ArgumentError, PartitionWarning, TraceError
from partir_emu.hwmodels.analytical import Analyzer, simulate
from partir_emu.hwmodels.machine.specs import load_spec
from partir_emu.runtime.kernels import check_kernels
from partir_emu.runtime.local_mesh import LocalMesh
from partir_emu.runtime.rounding import other_orders
from partir_emu.runtime.verdict import UNIT_ROUNDOFF, Verdict, compute_precision, judge, reduction_length

__all__ = ["Lowered", "Jitted", "jit", "lower_program", "trace", "analytical_cost"]


def _jax() -> Any:
    import jax  # here, not at the top: MPI ranks import this module and must not load jax
    return jax


def trace(fn: Callable, *args: Any, arg_names: Sequence[str] | None = None) -> Program:
    """Trace ``fn`` on example (or abstract) arguments into a Program (imports jax)."""
    from partir_emu.compiler.tracing.trace import trace as trace_jaxpr  # here: it imports jax (see _jax)
    return trace_jaxpr(fn, *args, arg_names=arg_names)


def analytical_cost(tactic: AutomaticPartition) -> Callable[[SpmdProgram], Price]:
    """The default cost model: the analytical step time on ``tactic.hardware`` (no overlap, so the
    step is compute + communication), the peak memory against the chip's HBM (the search's memory
    limit unless the tactic sets one), and the time and count of each collective kind per axes
    (the report's "why"). One Analyzer per search keeps placements and prices between candidates."""
    spec = load_spec(tactic.hardware)
    analyzer = Analyzer(max_programs=1)      # each candidate is a new program: keep only the last

    def cost(spmd: SpmdProgram) -> Price:
        rep = simulate(spmd, spec, analyzer=analyzer)
        parts: dict[str, float] = {"compute": rep.compute_s}
        counts: dict[str, int] = {}
        for r in rep.collectives:
            k = f"{r.prim} over {','.join(r.axes)}"
            parts[k] = parts.get(k, 0.0) + r.time_s
            counts[k] = counts.get(k, 0) + 1
        return Price(rep.step_s, rep.peak_bytes_per_device, rep.hbm_bytes, parts, counts)
    return cost


@dataclass
class Lowered(compiler_api.Partitioned):
    """A lowered program that can also run on the in-process mesh; ``in_tree``/``out_tree`` are
    the argument and result pytrees when it came from :func:`jit`."""

    in_tree: Any = None
    out_tree: Any = None
    # per output leaf: the PRNG key implementation of a typed key output (run as its key data), else None
    out_keys: tuple = ()

    def run(self, *flat_inputs: np.ndarray, algorithm: str = "ring", kernels: str = "blas"):
        return LocalMesh(self.spmd.mesh, algorithm=algorithm, kernels=kernels).run(self.spmd, list(flat_inputs))

    def to_jax(self, devices: Any = None):
        """The in/out shardings as ``NamedSharding``s for ``jax.jit`` (see :func:`partir_emu.interop.to_jax`)."""
        from partir_emu import interop  # here, not at the top: it imports jax, and MPI ranks import this module
        return interop.to_jax(self, devices)


def lower_program(program: Program, mesh: Mesh, schedule: Sequence[Tactic],
                  state_outputs: dict[str, str] | None = None,
                  cost_model: CostModel | None = analytical_cost) -> Lowered:
    """:func:`partir_emu.compiler.api.partition_and_lower` with the analytical cost model by default,
    as a :class:`Lowered`."""
    return compiler_api.partition_and_lower(program, mesh, schedule, state_outputs, cost_model, result=Lowered)


BACKENDS = ("local", "mpi")


class Jitted:
    def __init__(self, fn: Callable, mesh: Mesh, schedule: Sequence[Tactic], algorithm: str = "ring",
                 state_outputs: dict[str, str] | None = None, cost_model: CostModel | None = analytical_cost,
                 backend: str = "local", devices_per_rank: int = 1, outputs: str = "all",
                 timeout_s: float | None = 300.0, kernels: str = "blas"):
        if backend not in BACKENDS:
            raise ArgumentError(f"backend={backend!r}: use one of {BACKENDS}")
        if backend == "mpi" and (not isinstance(devices_per_rank, int) or devices_per_rank < 1):
            raise ArgumentError(f"devices_per_rank={devices_per_rank!r}: give a positive integer")
        self.fn, self.mesh, self.schedule, self.algorithm = fn, mesh, list(schedule), algorithm
        self.state_outputs, self.cost_model = state_outputs, cost_model
        self.backend, self.devices_per_rank, self.outputs, self.timeout_s = backend, devices_per_rank, outputs, timeout_s
        self.kernels = check_kernels(kernels)
        self._cache: dict[Any, Lowered] = {}
        self._nargs = _positional_count(fn)

    def _key(self, args: tuple) -> tuple[Any, list, Any]:
        jax = _jax()
        leaves, tree = jax.tree_util.tree_flatten(args)
        # a typed PRNG key array runs as its uint32 key data (how the tracer represents keys)
        leaves = [jax.random.key_data(x) if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)
                  else x for x in leaves]
        return (tree, tuple((np.shape(x), _dtype_name(x)) for x in leaves)), leaves, tree

    def lower(self, *args: Any) -> Lowered:
        return self._lower(args, self._key(args))

    def _lower(self, args: tuple, keyed: tuple[Any, list, Any]) -> Lowered:
        """The Lowered for ``args``, whose :meth:`_key` is ``keyed`` (computed once per call)."""
        if self._nargs is not None and len(args) != self._nargs:
            raise ArgumentError(f"{getattr(self.fn, '__name__', 'function')} takes {self._nargs} argument(s), "
                                f"got {len(args)}")
        key, _, tree = keyed
        if key not in self._cache:
            prog = trace(self.fn, *args)
            low = lower_program(prog, self.mesh, self.schedule, self.state_outputs, self.cost_model)
            low.in_tree = tree
            jax = _jax()
            shapes = jax.eval_shape(self.fn, *args)
            low.out_tree = jax.tree_util.tree_structure(shapes)
            low.out_keys = tuple(x.dtype._impl.name if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else None
                                 for x in jax.tree_util.tree_leaves(shapes))
            self._cache[key] = low
            for line in low.warnings:     # once per lowering, as the CLI prints them once per run
                warnings.warn(line, PartitionWarning, stacklevel=3)
        return self._cache[key]

    def __call__(self, *args: Any):
        keyed = self._key(args)
        low = self._lower(args, keyed)
        flat = [np.asarray(x) for x in keyed[1]]
        if self.backend == "mpi":
            from partir_emu import mpi  # here: importing mpi4py initialises MPI, only MPI users may
            outs = mpi.run(low.spmd, flat, devices_per_rank=self.devices_per_rank, algorithm=self.algorithm,
                           outputs=self.outputs, timeout_s=self.timeout_s, kernels=self.kernels)
        else:
            outs = low.run(*flat, algorithm=self.algorithm, kernels=self.kernels).outputs
        jax = _jax()
        # a typed key output (a model's rng state, e.g. flax.nnx's) ran as its key data: a key again
        outs = [jax.random.wrap_key_data(o, impl=impl) if impl else o
                for o, impl in zip(outs, low.out_keys or [None] * len(outs))]
        return jax.tree_util.tree_unflatten(low.out_tree, outs)

    def verify(self, *args: Any) -> Verdict:
        """Run the partitioned step on ``args`` (on this backend) and judge its outputs as the
        scenarios' runs are judged (:mod:`partir_emu.runtime.verdict`): against the unpartitioned
        ``jax.jit(fn)`` and the same step in float64 (float arguments cast up, jax's 64-bit mode on
        for that call only), with the reach of the unpartitioned program in other summation orders.
        ``.summary()`` of the result is the one-line verdict; ``.verified`` the yes/no.

        A step that casts to a narrower float inside (a bf16 step, or a module whose ``dtype`` is
        float32, as HF transformers' Flax models are by default) still rounds there under x64, so
        its float64 reference is only as exact as those casts; the verdict's ``reference`` says
        where (``"float32 in 669 of 1651 equations"``) and its summary names it. The scenarios
        build such steps again without the casts, which a user's function cannot be (give such a
        module ``dtype=jnp.float64``: it computes in float32 without x64, in float64 with it)."""
        jax = _jax()
        keyed = self._key(args)
        low = self._lower(args, keyed)
        flat = [np.asarray(x) for x in keyed[1]]
        ours = _numpy_leaves(self(*args))
        jitted = jax.jit(self.fn)
        baseline = _numpy_leaves(jitted(*args))
        leaves = jax.tree_util.tree_leaves(args)
        with jax.enable_x64(True):
            try:
                reference, ref64 = _float64_reference(jitted, low.in_tree, [_widened(x) for x in leaves])
            except (TypeError, ValueError) as exc:
                try:     # int32 indices beside Python ints (int64 under x64): widen the integers too
                    reference, ref64 = _float64_reference(jitted, low.in_tree, [_widened(x, True) for x in leaves])
                except (TypeError, ValueError):
                    raise TraceError(
                        f"verify: {getattr(self.fn, '__name__', 'the step')} fails on its arguments cast to "
                        f"float64 under jax's 64-bit mode, which verify's float64 reference is: {_first_lines(exc)} "
                        "A module that fixed its dtype to float32 when it was built casts there while the rest "
                        "computes in float64 (flax.nnx.Embed takes its embedding's dtype at construction): build "
                        "such modules with dtype=jnp.float64 (float32 without x64, float64 with it), or judge "
                        "the step by calling it and comparing with jax.jit yourself") from exc
        program = low.program
        verdict = judge(ours, baseline, ref64, program.output_names, reduction_length(program),
                        others=other_orders(program, flat), precision=compute_precision(program))
        return dataclasses.replace(verdict, reference=reference)


def _float64_reference(jitted: Any, in_tree: Any, wide: list) -> tuple[str, list[np.ndarray]]:
    """Where the step on the widened leaves ``wide`` computes narrower than float64, and its outputs
    (jax's 64-bit mode on: the caller's)."""
    wide_args = _jax().tree_util.tree_unflatten(in_tree, wide)
    return _narrowed_floats(jitted.trace(*wide_args).jaxpr), _numpy_leaves(jitted(*wide_args))


def _widened(x: Any, ints: bool = False) -> Any:
    """An argument leaf for the float64 reference: floats cast up, a weakly typed scalar as the Python
    scalar it was made from (under x64 jax makes it weak again, in the 64-bit type of its kind, as the
    step's own scalars are: Equinox's state compares the two), anything else (ints, typed PRNG keys)
    the caller's own; with ``ints``, signed integers as int64 too, for a step that fails under x64
    with its own: HF's Flax KV caches keep their index int32 and slice with it beside Python ints,
    which x64 makes int64, and ``lax.dynamic_slice`` refuses the mix. Unsigned ones (PRNG key data,
    bit patterns) stay: their wrap-around is their meaning; integer outputs are judged against
    ``jax.jit``'s, exactly, not against this reference."""
    jax = _jax()
    if getattr(x, "weak_type", False) and np.ndim(x) == 0:
        return np.asarray(x).item()
    dtype = getattr(x, "dtype", None)
    if ints and dtype is not None and jax.dtypes.issubdtype(dtype, np.signedinteger):
        return np.asarray(x, np.int64)
    return np.asarray(x, np.float64) if jax.dtypes.issubdtype(dtype, np.floating) else x


def _first_lines(exc: Exception, n: int = 2) -> str:
    return " ".join([line for line in str(exc).splitlines() if line.strip()][:n])


def _numpy_leaves(tree: Any) -> list[np.ndarray]:
    """``tree``'s leaves as numpy arrays, a typed PRNG key as its key data."""
    jax = _jax()
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)
                       else x) for x in jax.tree_util.tree_leaves(tree)]


def _narrowed_floats(closed: Any) -> str:
    """Where a jaxpr traced under x64 computes in a float narrower than float64: ``"float64"`` if
    nowhere, else the narrowest such dtype and how many of its equations (nested ones counted)
    have a result of a narrower float (bool masks converted to floats, which are exact, aside)."""
    narrow: dict[str, int] = {}
    total = 0

    def walk(jaxpr: Any) -> None:
        nonlocal total
        for e in jaxpr.eqns:
            total += 1
            names = {n for v in e.outvars if (n := _float_name(v.aval)) not in (None, "float64")}
            if names and not (e.primitive.name == "convert_element_type"       # a mask made float: exact
                              and np.dtype(e.invars[0].aval.dtype) == np.bool_):
                worst = max(names, key=lambda n: UNIT_ROUNDOFF[n])
                narrow[worst] = narrow.get(worst, 0) + 1
            for p in e.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                    inner = getattr(sub, "jaxpr", sub)       # a ClosedJaxpr's jaxpr, or a Jaxpr
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed.jaxpr)
    if not narrow:
        return "float64"
    worst = max(narrow, key=lambda n: UNIT_ROUNDOFF[n])
    return f"{worst} in {sum(narrow.values())} of {total} equations"


def _float_name(aval: Any) -> str | None:
    """The name of ``aval``'s dtype if it is a float the verdict knows (not a PRNG key, not an int)."""
    try:
        name = np.dtype(aval.dtype).name
    except (AttributeError, TypeError):
        return None
    return name if name in UNIT_ROUNDOFF else None


def _dtype_name(x: Any) -> str:
    dt = getattr(x, "dtype", None)
    return np.dtype(dt).name if dt is not None else np.result_type(x).name


def _positional_count(fn: Callable) -> int | None:
    """How many positional arguments ``fn`` takes (None: any number, or unknown)."""
    try:
        ps = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in ps):
        return None
    return len([p for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])


def jit(fn: Callable, *, mesh: Mesh, schedule: Sequence[Tactic] = (), algorithm: str = "ring",
        state_outputs: dict[str, str] | None = None, cost_model: CostModel | None = analytical_cost,
        backend: str = "local", devices_per_rank: int = 1, outputs: str = "all",
        timeout_s: float | None = 300.0, kernels: str = "blas") -> Jitted:
    """Partition ``fn`` over ``mesh`` with ``schedule``; calls run on the in-process mesh, or with
    ``backend="mpi"`` on the ranks of the ``mpiexec`` that started this script (rank 0 calls, the
    others are in :func:`partir_emu.mpi.serve`; ``devices_per_rank`` devices each; ``outputs="all"``
    gives every rank the global outputs, ``"root"`` only rank 0; every wait ends after ``timeout_s``).
    ``state_outputs={"1": "params"}`` lays output ``1/...`` out like input ``params/...``.
    ``kernels="exact"``: the fixed-order matmul (:mod:`partir_emu.runtime.kernels`), with which
    row-tiled results equal the unpartitioned ones bit for bit where no sum crosses devices."""
    return Jitted(fn, mesh, schedule, algorithm, state_outputs, cost_model, backend, devices_per_rank, outputs,
                  timeout_s, kernels)
