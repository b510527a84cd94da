"""The sharding state of a program, and the index propagation and lowering look things up in.

``ShardingState`` holds, per value, the mesh axes tiling each dim and, per equation, the
axes tiling each of its factors (see :mod:`partir_emu.core.factors`), plus where each
decision came from and the conflicts left for lowering (:mod:`.conflicts`, which also turns
them into warnings). It is mutable while a schedule is applied; ``copy()`` snapshots it after
each tactic.

``ProgramIndex`` is everything about the *program* that propagation needs again and again
(the rule of each equation, its operand/result slots, which dims each factor spans, users
and producers). It depends on the program only, is built once and is shared by every copy of
a state; it is the one cache of this package, owned by the states that read it.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from partir_emu.compiler.conflicts import Conflict, warnings
from partir_emu.compiler.loop_view import LINK_PRIMS, Region, flatten, link_rule
from partir_emu.core.factors import Dims, FactorRule
from partir_emu.core.ir import Eqn, Program, Var
from partir_emu.core.mesh import Mesh
from partir_emu.core.sharding import Sharding
from partir_emu.primitives import rule_for

Slot = tuple[Var, Dims]                 # an operand or result value, and the factors of each of its dims
FactorDims = Mapping[int, tuple[tuple[int, int], ...]]   # factor -> ((slot index, dim), ...)


@dataclass(frozen=True)
class ProgramIndex:
    """Per-program lookups, built once (identical equations share one rule and factor map)."""

    rules: tuple[FactorRule, ...]
    slots: tuple[tuple[Slot, ...], ...]         # per eqn: its non-scalar operands, then results
    factor_dims: tuple[FactorDims, ...]         # per eqn
    result_slot: Mapping[Var, int]              # value -> its slot index in its producer's slots
    users: Mapping[Var, list[int]]
    producers: Mapping[Var, int]
    regions: Mapping[int, Region] = field(default_factory=dict)   # loops of the flat program (loop_view)

    @classmethod
    def build(cls, program: Program, regions: Mapping[int, Region] | None = None) -> ProgramIndex:
        shared: dict[tuple, tuple[FactorRule, FactorDims]] = {}
        rules, slots, fdims = [], [], []
        result_slot: dict[Var, int] = {}
        for e in program.eqns:
            key = (e.prim, tuple(a.shape for a in e.inputs), tuple(o.shape for o in e.outputs), repr(e.params))
            if key not in shared:
                r = link_rule(e) if e.prim in LINK_PRIMS else rule_for(e)
                shared[key] = (r, factor_dims(r))
            rule, fd = shared[key]
            s = _slots(e, rule)
            n_in = len(s) - sum(1 for fs in rule.results if fs)
            result_slot.update((v, k) for k, (v, _) in enumerate(s) if k >= n_in)
            rules.append(rule)
            slots.append(s)
            fdims.append(fd)
        return cls(tuple(rules), tuple(slots), tuple(fdims), result_slot, program.users(), program.producers(),
                   dict(regions or {}))


def factor_dims(rule: FactorRule) -> FactorDims:
    """factor -> [(slot index, dim)] over the rule's non-empty operands then results (as slots)."""
    out: dict[int, list[tuple[int, int]]] = {}
    k = 0
    for dims in (*rule.operands, *rule.results):
        if not dims:
            continue
        for d, fs in enumerate(dims):
            for f in fs:
                out.setdefault(f, []).append((k, d))
        k += 1
    return {f: tuple(x) for f, x in out.items()}


def _slots(eqn: Eqn, rule: FactorRule) -> tuple[Slot, ...]:
    # a Literal is a scalar: its rule dims are empty, so it is never a slot
    out: list[Slot] = [(a, fs) for a, fs in zip(eqn.inputs, rule.operands) if fs and isinstance(a, Var)]
    out += [(o, fs) for o, fs in zip(eqn.outputs, rule.results) if fs]
    return tuple(out)


def mesh_order(mesh: Mesh, axes: Iterable[str]) -> tuple[str, ...]:
    """``axes`` in the mesh's axis order (the canonical order of a partial-sum group)."""
    axes = tuple(axes)
    if len(axes) < 2:
        return axes
    s = set(axes)
    return tuple(a for a in mesh.axis_names if a in s)


def dim_axes(F: Mapping[int, tuple[str, ...]], sizes: Sequence[int], factors: Sequence[int],
             mesh: Mesh) -> tuple[str, ...] | None:
    """Axes of one tensor dim made of ``factors``; None if not a contiguous block layout
    (a factor not fully tiled may only be followed by untiled factors)."""
    axes: tuple[str, ...] = ()
    closed = False
    for f in factors:
        fa = F.get(f)
        if not fa:
            if sizes[f] != 1:
                closed = True
            continue
        if closed:
            return None
        axes += fa
        if mesh.group_size(fa) != sizes[f]:
            closed = True
    return axes


def factor_of_axis(mesh: Mesh, sizes: Sequence[int], factors: Sequence[int], axes: Sequence[str],
                   axis: str) -> int | None:
    """Which factor of a compound dim tiled by ``axes`` (major→minor) ``axis`` lands in;
    None if the tiling does not split along the factors."""
    i = 0
    filled = 1
    for a in axes:
        n = mesh.axis_size(a)
        while i < len(factors) and (sizes[factors[i]] == 1 or filled == sizes[factors[i]]):
            i += 1
            filled = 1
        if i >= len(factors) or sizes[factors[i]] % (filled * n):
            return None
        filled *= n
        if a == axis:
            return factors[i]
    return None


@dataclass
class ShardingState:
    """Mutable while a schedule is applied; snapshots are taken after each tactic."""

    program: Program
    mesh: Mesh
    index: ProgramIndex
    value_dims: dict[Var, tuple[tuple[str, ...], ...]]
    eqn_factors: list[dict[int, tuple[str, ...]]]
    pinned: dict[Var, set[str]] = field(default_factory=dict)      # axes a value must not take
    origin: dict[tuple[int, str], str] = field(default_factory=dict)  # (var id, axis) -> why
    conflicts: list[Conflict] = field(default_factory=list)
    tactics_applied: list[str] = field(default_factory=list)
    auto_results: list[tuple[str, Any]] = field(default_factory=list)  # (label, auto.SearchResult)

    @classmethod
    def initial(cls, program: Program, mesh: Mesh) -> ShardingState:
        """No tactic applied yet. A program with loops is partitioned in its flat form (each body
        once, between link equations: :mod:`.loop_view`); ``program`` is then that form."""
        program, regions = flatten(program)
        vd: dict[Var, tuple[tuple[str, ...], ...]] = {v: ((),) * v.ndim for v in program.vars()}
        return cls(program, mesh, ProgramIndex.build(program, regions), vd, [{} for _ in program.eqns])

    def copy(self) -> ShardingState:
        """An independent snapshot (the program index is shared: it never changes)."""
        return ShardingState(self.program, self.mesh, self.index, dict(self.value_dims),
                             [dict(f) for f in self.eqn_factors], {v: set(s) for v, s in self.pinned.items()},
                             dict(self.origin), list(self.conflicts), list(self.tactics_applied),
                             list(self.auto_results))

    @property
    def rules(self) -> tuple[FactorRule, ...]:
        return self.index.rules

    # -- derived shardings ------------------------------------------------------------
    def dims_from_factors(self, e: int, dims: Dims) -> list[tuple[str, ...]] | None:
        """Axes of each tensor dim implied by equation ``e``'s factor tiling (None if some dim's
        tiling is not a contiguous block layout)."""
        F, sizes = self.eqn_factors[e], self.rules[e].sizes
        out = []
        for factors in dims:
            a = dim_axes(F, sizes, factors, self.mesh)
            if a is None:
                return None
            out.append(a)
        return out

    def result_sharding(self, e: int, k: int = 0) -> Sharding:
        rule = self.rules[e]
        dims = self.dims_from_factors(e, rule.results[k])
        assert dims is not None
        partial = tuple(a for f in sorted(rule.reduction) for a in self.eqn_factors[e].get(f, ()))
        return Sharding(tuple(dims), mesh_order(self.mesh, partial), rule.reduce_op)

    def sharding(self, v: Var) -> Sharding:
        return Sharding(tuple(self.value_dims[v]))

    def pretty(self, show_all: bool = False) -> str:
        p = self.program
        lines = [f"# sharding state after {len(self.tactics_applied)} tactic(s): "
                 + (", ".join(self.tactics_applied) or "none") + f" on {self.mesh}"]
        lines.append("inputs:")
        for v, n in zip(p.inputs, p.input_names):
            lines.append(f"  {n:<40} {v.type_str():<16} {self.sharding(v)}{self._why(v)}")
        lines.append("equations:")
        for i, e in enumerate(p.eqns):
            if not show_all and not any(self.eqn_factors[i].values()):
                continue
            outs = ", ".join(f"{o}:{o.type_str()} {self.result_sharding(i, k)}" for k, o in enumerate(e.outputs))
            lines.append(f"  [{i}] {e.prim:<18} {outs}{self._why(e.outputs[0])}")
        lines.append("outputs:")
        for o, n in zip(p.outputs, p.output_names):
            if isinstance(o, Var):
                lines.append(f"  {n:<40} {o.type_str():<16} {self.sharding(o)}")
        if self.conflicts:
            lines.append(f"conflicts ({len(self.conflicts)}; left unpropagated, resharded at lowering):")
            for c in self.conflicts:
                mark = (f" [within tactic {c.tactic!r}: {'intended (meet=reshard)' if c.intended else 'a warning'}]"
                        if c.within_tactic else "")
                lines.append(f"  [{c.eqn}] {c.axis}: {c.message}{mark}")
        return "\n".join(lines)

    def warnings(self) -> list[str]:
        """One line per kind of conflict between a tactic's own decisions (see
        :mod:`partir_emu.compiler.conflicts`); empty when the schedule says what it means."""
        return warnings(self.conflicts, self.program, self.origin)

    def _why(self, v: Var) -> str:
        whys = [f"{a}: {self.origin[(v.id, a)]}" for d in self.value_dims[v] for a in d if (v.id, a) in self.origin]
        return ("   # " + "; ".join(whys)) if whys else ""
