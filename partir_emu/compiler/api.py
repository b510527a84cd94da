"""Public compiler entry points: ``partition``, ``lower_program`` and ``jit``.

``jit(fn, mesh=..., schedule=[...])`` returns a callable that traces ``fn`` on
its first call (and again for new argument shapes, like ``jax.jit``),
partitions and lowers it, and runs the SPMD program on the in-process mesh.
``.lower(*args)`` returns a :class:`Lowered` with the SpmdProgram, its
collective statistics and the sharding state after every tactic.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partir_emu.compiler.auto import AutomaticPartition, apply_automatic
from partir_emu.compiler.lower import lower
from partir_emu.compiler.propagate import ShardingState, apply_tactic
from partir_emu.compiler.tactics import ManualPartition
from partir_emu.core.ir import Program
from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import CollectiveStats, SpmdProgram
from partir_emu.errors import ArgumentError, MeshError


def partition(program: Program, mesh: Mesh, schedule: Sequence[ManualPartition],
              keep_states: bool = True) -> list[ShardingState]:
    """Apply the tactics in order; return the state before any tactic and after each one
    (only the final state with ``keep_states=False``)."""
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh must be a partir_emu.Mesh, got {type(mesh).__name__}")
    state = ShardingState.initial(program, mesh)
    states = [state.copy()] if keep_states else []
    for k, t in enumerate(schedule):
        if isinstance(t, AutomaticPartition):
            apply_automatic(state, t, k)
        else:
            apply_tactic(state, t, k)
        if keep_states:
            states.append(state.copy())
    return states if keep_states else [state]


@dataclass
class Lowered:
    program: Program                 # the traced, global program
    schedule: list[ManualPartition]
    final_state: ShardingState
    spmd: SpmdProgram
    in_tree: Any = None
    out_tree: Any = None

    def stats(self) -> CollectiveStats:
        return self.spmd.stats()

    @functools.cached_property
    def states(self) -> list[ShardingState]:
        """[before any tactic, after tactic 1, ...]: replayed on demand (partitioning is
        deterministic), so lowering does not pay for snapshots nobody reads."""
        return partition(self.program, self.spmd.mesh, self.schedule, keep_states=True)

    def state_after(self, k: int) -> ShardingState:
        return self.states[k]

    def __str__(self) -> str:
        return str(self.spmd)

    def run(self, *flat_inputs: np.ndarray, algorithm: str = "ring"):
        from partir_emu.runtime.local_mesh import LocalMesh
        return LocalMesh(self.spmd.mesh, algorithm=algorithm).run(self.spmd, list(flat_inputs))


def lower_program(program: Program, mesh: Mesh, schedule: Sequence[ManualPartition],
                  state_outputs: dict[str, str] | None = None) -> Lowered:
    (state,) = partition(program, mesh, schedule, keep_states=False)
    return Lowered(program, list(schedule), state, lower(state, state_outputs))


def trace(fn: Callable, *args: Any, arg_names: Sequence[str] | None = None) -> Program:
    from partir_emu.compiler.trace import trace as _trace
    return _trace(fn, *args, arg_names=arg_names)


class Jitted:
    def __init__(self, fn: Callable, mesh: Mesh, schedule: Sequence[ManualPartition], algorithm: str = "ring",
                 state_outputs: dict[str, str] | None = None):
        self.fn, self.mesh, self.schedule, self.algorithm = fn, mesh, list(schedule), algorithm
        self.state_outputs = state_outputs
        self._cache: dict[Any, Lowered] = {}
        try:
            sig = inspect.signature(fn)
            ps = list(sig.parameters.values())
            self._nargs = None if any(p.kind == p.VAR_POSITIONAL for p in ps) else \
                len([p for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
        except (TypeError, ValueError):
            self._nargs = None

    def _key(self, args):
        import jax
        leaves, tree = jax.tree_util.tree_flatten(args)
        return (tree, tuple((np.shape(x), np.result_type(x).name) for x in leaves)), leaves, tree

    def lower(self, *args: Any) -> Lowered:
        if self._nargs is not None and len(args) != self._nargs:
            raise ArgumentError(f"{getattr(self.fn, '__name__', 'function')} takes {self._nargs} argument(s), "
                                f"got {len(args)}")
        key, _, tree = self._key(args)
        if key not in self._cache:
            import jax
            prog = trace(self.fn, *args)
            low = lower_program(prog, self.mesh, self.schedule, self.state_outputs)
            low.in_tree = tree
            low.out_tree = jax.tree_util.tree_structure(jax.eval_shape(self.fn, *args))
            self._cache[key] = low
        return self._cache[key]

    def __call__(self, *args: Any):
        import jax
        low = self.lower(*args)
        _, leaves, _ = self._key(args)
        res = low.run(*[np.asarray(x) for x in leaves], algorithm=self.algorithm)
        return jax.tree_util.tree_unflatten(low.out_tree, res.outputs)


def jit(fn: Callable, *, mesh: Mesh, schedule: Sequence[ManualPartition] = (), algorithm: str = "ring",
        state_outputs: dict[str, str] | None = None) -> Jitted:
    """Partition ``fn`` over ``mesh`` with ``schedule``; calls run on the in-process mesh.
    ``state_outputs={"1": "params"}`` lays output ``1/...`` out like input ``params/...``."""
    return Jitted(fn, mesh, schedule, algorithm, state_outputs)
