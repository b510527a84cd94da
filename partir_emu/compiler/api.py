"""Compiler entry points: ``partition`` (apply a schedule) and ``partition_and_lower`` (partition,
then lower to an SpmdProgram), whose result is a :class:`Partitioned`.

Pure functions of a traced :class:`~partir_emu.core.ir.Program`: no jax, no runtime, no hardware
model. An :class:`AutomaticPartition` without its own ``cost`` is priced by the ``cost_model``
the caller passes; :mod:`partir_emu.api` (the user-facing ``jit``/``trace``/``lower_program``)
passes the analytical model, and its :class:`~partir_emu.api.Lowered` (a ``Partitioned`` that can
also run and export) is what this module builds when it is asked to (``result=``).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from partir_emu.compiler.auto.tactic import apply_automatic
from partir_emu.compiler.lowering.lower import lower
from partir_emu.compiler.propagate import apply_tactic
from partir_emu.compiler.state import ShardingState
from partir_emu.compiler.tactics import AutomaticPartition, CostModel, Tactic
from partir_emu.core.ir import Program
from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import CollectiveStats, SpmdProgram
from partir_emu.errors import MeshError

P = TypeVar("P", bound="Partitioned")


def partition(program: Program, mesh: Mesh, schedule: Sequence[Tactic], keep_states: bool = True,
              cost_model: CostModel | None = None,
              state_outputs: dict[str, str] | None = None, replay: Sequence[Any] = ()) -> list[ShardingState]:
    """Apply the tactics in order; return the state before any tactic and after each one
    (only the final state with ``keep_states=False``). ``cost_model`` prices the
    AutomaticPartitions that carry no ``cost`` of their own; they lower their candidates with
    ``state_outputs``, as the final lowering will; with ``replay`` (the ``auto_results`` of an earlier
    partition of the same schedule) they apply those results instead of searching again (a search
    cut short by its time budget need not repeat itself)."""
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh must be a partir_emu.Mesh, got {type(mesh).__name__}")
    state = ShardingState.initial(program, mesh)
    states = [state.copy()] if keep_states else []
    done = iter(replay)
    for k, t in enumerate(schedule):
        if isinstance(t, AutomaticPartition) and replay:
            apply_automatic(state, t, k, recorded=next(done)[1])
        elif isinstance(t, AutomaticPartition):
            # each candidate is priced after the manual tactics that follow it (compiler.auto)
            later = [u for u in schedule[k + 1:] if not isinstance(u, AutomaticPartition)]
            apply_automatic(state, t, k, cost_model, later, state_outputs)
        else:
            apply_tactic(state, t, k)
        if keep_states:
            states.append(state.copy())
    return states if keep_states else [state]


@dataclass
class Partitioned:
    """A partitioned and lowered program: the global program, the schedule, the final sharding state
    and the SPMD program."""

    program: Program                 # the traced, global program
    schedule: list[Tactic]
    final_state: ShardingState
    spmd: SpmdProgram
    cost_model: CostModel | None = None
    state_outputs: dict[str, str] | None = None

    def stats(self) -> CollectiveStats:
        return self.spmd.stats()

    @functools.cached_property
    def states(self) -> list[ShardingState]:
        """[before any tactic, after tactic 1, ...]: replayed on demand (partitioning is
        deterministic), so lowering does not pay for snapshots nobody reads."""
        return partition(self.program, self.spmd.mesh, self.schedule, keep_states=True, cost_model=self.cost_model,
                         state_outputs=self.state_outputs, replay=self.final_state.auto_results)

    def state_after(self, k: int) -> ShardingState:
        return self.states[k]

    @property
    def warnings(self) -> list[str]:
        """Conflicts between a tactic's own decisions, one line per kind (see
        :mod:`partir_emu.compiler.conflicts`); the CLI prints them to stderr."""
        return self.final_state.warnings()

    def __str__(self) -> str:
        return str(self.spmd)


def partition_and_lower(program: Program, mesh: Mesh, schedule: Sequence[Tactic],
                        state_outputs: dict[str, str] | None = None, cost_model: CostModel | None = None,
                        result: type[P] | None = None) -> P:
    """Partition ``program`` with ``schedule`` and lower the final state (see ``lower.lower`` for
    ``state_outputs``); the result is a ``result`` (default :class:`Partitioned`; a subclass that
    adds behaviour, as :class:`partir_emu.api.Lowered` does, is built directly, nothing copied)."""
    (state,) = partition(program, mesh, schedule, keep_states=False, cost_model=cost_model, state_outputs=state_outputs)
    cls: type[Any] = result if result is not None else Partitioned
    return cls(program, list(schedule), state, lower(state, state_outputs), cost_model, state_outputs)
