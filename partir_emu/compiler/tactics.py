"""Tactics: user decisions, written apart from the model code.

A schedule is an ordered list of tactics, each using one mesh axis. A
``ManualPartition`` tiles the matching inputs' dims by its axis (or pins them
replicated on it); propagation then carries that axis through the program.
Input names are pytree paths such as ``params/layer_3/mlp/w_in``; patterns are
shell globs (``*`` also matches ``/``), tried in the order written; the first
pattern that matches an input decides for it. An ``AutomaticPartition`` searches those
decisions instead (:mod:`partir_emu.compiler.auto.tactic`), priced by a cost function.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import TacticError


class Replicated:
    _inst = None

    def __new__(cls):  # a singleton, so `is REPLICATED` works after copies
        if cls._inst is None:
            cls._inst = super().__new__(cls)
        return cls._inst

    def __repr__(self) -> str:
        return "REPLICATED"


REPLICATED = Replicated()
"""Pin an input replicated on the tactic's axis: propagation will not tile it."""


@dataclass(frozen=True)
class ManualPartition:
    inputs: Mapping[str, int | Replicated]
    axis: str
    name: str = ""
    # By default a pattern that matches no input is an error (a typo would
    # otherwise silently replicate a parameter). Set to True for schedules
    # written for several models at once.
    allow_unmatched: bool = False
    # Where this tactic's own seeds meet with different tilings of one value: "warn" (a tactic's
    # decisions are expected to agree, so a meeting means propagation order chose a tiling, see
    # compiler.conflicts) or "reshard" (the meeting is the point: multi-query sharding tiles the KV
    # cache on batch and the queries on heads, and wants the small operands resharded where they
    # meet; the conflicts are recorded and resharded, not warned about).
    meet: str = "warn"
    # Globs over the names of the model's tags (``partir_emu.tag(x, name)``) where this tactic's
    # propagation stops: its axis is not carried across them, so each side keeps the tiling its own
    # side gives it and the lowering reshards at the tag (a mixture of experts' expert tactic stops
    # at the dispatch and combine tags: the tokens keep the batch tiling, the experts theirs).
    stop_at: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str):
            raise TacticError(f"ManualPartition axis must be a mesh axis name, got {self.axis!r}")
        if isinstance(self.stop_at, str) or not all(isinstance(p, str) and p for p in self.stop_at):
            raise TacticError(f"ManualPartition on axis {self.axis!r}: stop_at={self.stop_at!r}; give a tuple of "
                              "tag-name globs, e.g. stop_at=('moe/*',)")
        if self.meet not in ("warn", "reshard"):
            raise TacticError(f"ManualPartition on axis {self.axis!r}: meet={self.meet!r}; use 'warn' (the default) or "
                              "'reshard' (the tactic's seeds are meant to meet with different tilings)")
        for pat, dim in self.inputs.items():
            if not (dim is REPLICATED or (isinstance(dim, int) and not isinstance(dim, bool))):
                raise TacticError(f"ManualPartition on axis {self.axis!r}: pattern {pat!r} maps to {dim!r}; "
                                  "use a dim index (negative counts from the end) or REPLICATED")

    def describe(self) -> str:
        items = ", ".join(f"{p!r}: {d!r}" for p, d in self.inputs.items())
        return self.name or f"ManualPartition({{{items}}}, axis={self.axis!r})"

    def stops(self, tags: Sequence[tuple[int, str]]) -> frozenset[int]:
        """The equations, of ``(equation, tag name)``, where this tactic stops. Raises if a ``stop_at``
        glob matches no tag (unless ``allow_unmatched``)."""
        out = set()
        for pat in self.stop_at:
            hits = [e for e, name in tags if fnmatch.fnmatchcase(name, pat)]
            if not hits and not self.allow_unmatched:
                known = sorted({name for _, name in tags})
                raise TacticError(f"tactic {self.describe()}: stop_at pattern {pat!r} matches no tag of the program; "
                                  f"its tags are {known or 'none (the model calls partir_emu.tag(x, name))'}")
            out.update(hits)
        return frozenset(out)

    def resolve(self, names: Sequence[str]) -> dict[int, int | Replicated]:
        """Input index → dim (or REPLICATED). Raises if a pattern matches nothing."""
        out: dict[int, int | Replicated] = {}
        for pat, dim in self.inputs.items():
            hits = [i for i, n in enumerate(names) if fnmatch.fnmatchcase(n, pat)]
            if not hits and not self.allow_unmatched:
                sample = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
                raise TacticError(f"tactic {self.describe()}: pattern {pat!r} matches no input; "
                                  f"inputs are named by pytree path, e.g. {sample}")
            for i in hits:
                out.setdefault(i, dim)
        return out


@dataclass(frozen=True)
class AutomaticPartition:
    """Search the decisions a ManualPartition on ``axis`` would make for the ``inputs`` patterns
    (see :mod:`partir_emu.compiler.auto.tactic`), pricing each candidate with ``cost``, or else with the
    cost model the caller of ``partition``/``lower_program`` passes. The search stops after
    ``budget`` evaluations, a deterministic count, so the same call gives the same decisions on a
    fast machine and a loaded one; ``seconds`` (default None: no limit) is only a safety net, and a
    search it stops says so (``stopped: time``, not reproducible). ``rollouts`` random completions
    are priced per new node besides the node itself, drawn from ``seed``; then up to ``polish`` more
    evaluations drop one decision of the best at a time while that is cheaper; ``memory_limit`` is
    bytes per device (None: the cost model's capacity, e.g. the chip's HBM, when it reports one)."""

    axis: str
    inputs: str | Sequence[str] = "params/*"
    name: str = ""
    hardware: str = "tpu-v4"          # read by the caller's cost model, not by the compiler
    budget: int = 48
    seconds: float | None = None
    seed: int = 0
    rollouts: int = 0
    polish: int = 16                  # evaluations of the local descent after the tree (compiler.auto_search)
    memory_limit: int | None = None
    cost: Callable[[SpmdProgram], Any] | None = None    # -> float or compiler.auto.Price

    def describe(self) -> str:
        return self.name or f"AutomaticPartition(axis={self.axis!r}, inputs={self.inputs!r})"


Tactic = ManualPartition | AutomaticPartition

# how a caller prices the candidates of an AutomaticPartition that has no ``cost`` of its own
CostModel = Callable[[AutomaticPartition], Callable[[SpmdProgram], Any]]   # -> float or auto.Price
