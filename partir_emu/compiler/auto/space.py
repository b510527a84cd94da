"""The decision space of an :class:`~partir_emu.compiler.tactics.AutomaticPartition` and what a
cost function returns.

A *family* is a set of inputs that take one decision together: inputs matched by the tactic's
patterns whose names are equal up to layer numbers (``params/layer_3/mlp/w_in`` →
``params/layer_*/mlp/w_in``) **and** whose shapes are equal (so Flax's ``Dense_0`` and ``Dense_1``
of a block, ``[d, 4d]`` and ``[4d, d]``, are two families, not one). Families are ordered by
their total bytes, largest first (ties: input order), so the decisions that move the price most
sit at the top of the search tree. A decision tiles one dim of every member by the tactic's
axis, or leaves the family to propagation (no seed, not pinned).

Optimizer state that mirrors a parameter follows it, as in ZeRO and Megatron: an input not
matched by the patterns whose name ends with ``/<the parameter's name without its first
component>`` and whose shape is the parameter's (``opt/mu/layer_0/mlp/w_in`` for
``params/layer_0/mlp/w_in``; optax's ``opt/1/0/mu/params/...`` for Flax's ``params/params/...``).
"""
from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from partir_emu.compiler.state import ShardingState
from partir_emu.compiler.tactics import AutomaticPartition, ManualPartition, Replicated
from partir_emu.core.ir import Var
from partir_emu.errors import TacticError

_LAYER = re.compile(r"(?<=[_/])\d+(?=/|$)")


def family(name: str) -> str:
    """``name`` with its layer numbers (a number after ``_`` or ``/`` that ends a component) as ``*``."""
    return _LAYER.sub("*", name)


@dataclass(frozen=True)
class Price:
    """What a cost function may return instead of a bare float: the ``value`` the search minimises
    (e.g. seconds per step), the per-device ``peak_bytes`` (checked against the memory limit), the
    ``capacity`` that limit defaults to (e.g. the chip's HBM), and a breakdown for the report
    (``parts``: seconds per part, e.g. ``compute`` or ``all_reduce over model``; ``counts``: how many
    collectives each part holds)."""

    value: float
    peak_bytes: int | None = None
    capacity: int | None = None
    parts: Mapping[str, float] = field(default_factory=dict)
    counts: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    label: str                      # a glob, or the glob and the shape when two families share the glob
    members: tuple[int, ...]        # input indices matched by the tactic's patterns
    mirrors: tuple[int, ...]        # optimizer state that follows the members
    shape: tuple[int, ...]
    nbytes: int                     # all members and mirrors


@dataclass(frozen=True)
class Space:
    """The families of one search, in search order (largest first)."""

    families: tuple[Family, ...]

    def tactic(self, decisions: Mapping[int, int], axis: str, name: str) -> DecidedPartition:
        """The ManualPartition of ``decisions`` (family position → dim), resolved to input indices."""
        idx: dict[int, int] = {}
        pats: dict[str, int] = {}
        for k, d in sorted(decisions.items()):
            fam = self.families[k]
            for i in (*fam.members, *fam.mirrors):
                idx.setdefault(i, d)
            pats[fam.label] = d
        # meet="reshard": where the decisions' seeds meet with different tilings, the search has
        # priced the resharding that follows; a warning to split the tactic would not apply
        return DecidedPartition(pats, axis=axis, name=name, allow_unmatched=True, meet="reshard",
                                indices=tuple(sorted(idx.items())))

    def labels(self, decisions: Mapping[int, int]) -> dict[str, int]:
        return {self.families[k].label: d for k, d in sorted(decisions.items())}


@dataclass(frozen=True)
class DecidedPartition(ManualPartition):
    """A ManualPartition whose inputs are already resolved to indices (``inputs`` keeps the family
    labels for display): resolving globs against thousands of input names per candidate would cost
    more than propagating it."""

    indices: tuple[tuple[int, int], ...] = ()

    def resolve(self, names: Sequence[str]) -> dict[int, int | Replicated]:
        return dict(self.indices)


def build_space(state: ShardingState, tactic: AutomaticPartition) -> Space:
    """The families of the inputs the tactic's patterns match (a TacticError if none)."""
    p = state.program
    pats = [tactic.inputs] if isinstance(tactic.inputs, str) else list(tactic.inputs)
    matched = [i for i, n in enumerate(p.input_names) if any(fnmatch.fnmatchcase(n, q) for q in pats)]
    if not matched:
        raise TacticError(f"{tactic.describe()}: pattern(s) {pats} match no input; inputs are named by pytree "
                          f"path, e.g. {', '.join(p.input_names[:4])}")
    groups: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for i in matched:
        v = p.inputs[i]
        if v.ndim:                    # a scalar has no dim to tile
            groups.setdefault((family(p.input_names[i]), v.shape), []).append(i)
    mirrors = _mirrors(p.input_names, p.inputs, set(matched))
    per_glob: dict[str, int] = {}
    for glob, _ in groups:
        per_glob[glob] = per_glob.get(glob, 0) + 1
    fams = []
    for (glob, shape), idx in groups.items():
        if len(idx) == 1:
            label = p.input_names[idx[0]]
        else:
            label = glob if per_glob[glob] == 1 else f"{glob} {list(shape)}"
        mir = tuple(m for i in idx for m in mirrors.get(i, ()))
        nbytes = sum(p.inputs[i].nbytes for i in (*idx, *mir))
        fams.append(Family(label, tuple(idx), mir, shape, nbytes))
    order = sorted(range(len(fams)), key=lambda k: (-fams[k].nbytes, fams[k].members[0]))
    return Space(tuple(fams[k] for k in order))


def _mirrors(names: Sequence[str], inputs: Sequence[Var], matched: set[int]) -> dict[int, tuple[int, ...]]:
    """parameter index → the unmatched inputs of its shape whose name ends with its name minus the
    first component (see the module docstring)."""
    by_suffix: dict[str, list[int]] = {}
    for j, n in enumerate(names):
        if j in matched:
            continue
        parts = n.split("/")
        for k in range(1, len(parts)):
            by_suffix.setdefault("/".join(parts[k:]), []).append(j)
    out: dict[int, tuple[int, ...]] = {}
    for i in matched:
        head, sep, rest = names[i].partition("/")
        if not sep:
            continue
        hits = tuple(j for j in by_suffix.get(rest, ()) if inputs[j].shape == inputs[i].shape)
        if hits:
            out[i] = hits
    return out


def open_choices(state: ShardingState, space: Space, axis: str, start: int = 0) -> list[tuple[int, tuple[int, ...]]]:
    """(family position, the dims it could be tiled on) for the families from ``start`` on that
    ``state`` has not tiled by ``axis`` (every member already tiled: decided by propagation) and
    that have a dim each member can take (the axis unused on it and the dim divisible)."""
    mesh = state.mesh
    n = mesh.axis_size(axis)
    out = []
    for k in range(start, len(space.families)):
        fam = space.families[k]
        vs = [state.program.inputs[i] for i in fam.members]
        have = [state.value_dims[v] for v in vs]
        if all(any(axis in d for d in h) for h in have):
            continue
        if any(any(axis in d for d in h) for h in have):
            continue                 # partly tiled by propagation: a seed would contradict it
        dims = tuple(d for d in range(len(fam.shape))
                     if all(v.shape[d] % (mesh.group_size(h[d]) * n) == 0 for v, h in zip(vs, have)))
        if dims:
            out.append((k, dims))
    return out


def fingerprint(state: ShardingState) -> int:
    """A hash of what lowering reads from a state (every value's tiling, every equation's factors,
    the conflicts and pins): two decision sets that propagate alike are priced once."""
    vd = state.value_dims
    dims = tuple(vd[v] for v in state.program.inputs) + tuple(
        vd[o] for e in state.program.eqns for o in e.outputs)
    facts = tuple(tuple(sorted(f.items())) for f in state.eqn_factors)
    conf = tuple((c.eqn, c.axis, c.kind) for c in state.conflicts)
    pins = tuple(sorted((v.id, tuple(sorted(a))) for v, a in state.pinned.items()))
    return hash((dims, facts, conf, pins))
