"""The PartirError hierarchy.

Every error a user can provoke is a subclass of :class:`PartirError` whose
message names the offending value, axis, primitive or file and says what to do.
``assert`` is kept for internal invariants only.
"""
from __future__ import annotations


class PartirError(Exception):
    """Base class of every error partir_emu raises on bad input."""


class PartitionWarning(UserWarning):
    """A schedule lowered, but a tactic's own decisions conflict (:mod:`partir_emu.compiler.conflicts`):
    ``pe.jit`` warns with each line of ``Lowered.warnings`` when it lowers (the CLI prints them to
    stderr). Filter it like any warning: ``warnings.simplefilter("error", pe.PartitionWarning)``."""


class MeshError(PartirError):
    """A mesh is malformed, or an axis name is unknown to it."""


class ShardingError(PartirError):
    """A sharding or tactic is inconsistent with a value's shape or the mesh."""


class TacticError(ShardingError):
    """A tactic cannot be applied (pattern matches nothing, bad dim, ...)."""


class TraceError(PartirError):
    """A JAX function cannot be turned into the partir IR."""


class UnsupportedPrimitiveError(TraceError):
    """A primitive has no rule (trace, sharding, implementation or cost)."""


class LoweringError(PartirError):
    """A sharded program cannot be lowered to an SPMD program."""


class ArgumentError(PartirError):
    """A compiled function was called with the wrong number/shape of arguments."""


class ArtifactError(PartirError):
    """A serialized program file is unreadable or of an unknown version."""


class CollectiveError(PartirError):
    """A collective was given an impossible group, size or algorithm,
    or its participants disagree."""


class EmulationError(PartirError):
    """The emulated mesh (local or MPI) failed: a rank died, timed out, or
    produced a result that does not verify."""


class SpecError(PartirError):
    """A hardware spec file is missing, malformed or incomplete."""


class PlacementError(PartirError):
    """A logical mesh does not fit the physical topology as placed."""


class ScenarioError(PartirError):
    """An unknown scenario, strategy, size preset or size override."""


class UsageError(PartirError):
    """A command-line value that is out of range or inconsistent."""
