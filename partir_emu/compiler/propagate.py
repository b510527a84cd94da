"""Tactic application and sharding propagation.

The state holds, per value, the mesh axes tiling each dim and, per equation,
the axes tiling each of its factors (see ``rules``). A ``ManualPartition``
seeds its inputs with one axis; propagation then carries that axis through the
factor rules, forward and backward, to a fixed point. Decisions are only ever
*added*: an axis already placed is never moved (earlier tactics win). Where two
sources want different factors of one equation tiled by the same axis, or a
value would need the axis on two dims, nothing is guessed: the conflict is
recorded with both origins and the lowering inserts the resharding.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from partir_emu.compiler.tactics import REPLICATED, ManualPartition
from partir_emu.core.factors import FactorRule
from partir_emu.core.ir import Eqn, Program, Var
from partir_emu.core.mesh import Mesh
from partir_emu.core.sharding import Sharding
from partir_emu.errors import ShardingError, TacticError
from partir_emu.primitives import rule_for


@dataclass(frozen=True)
class Conflict:
    axis: str
    eqn: int
    message: str


@dataclass
class ShardingState:
    """Mutable while a schedule is applied; snapshots are taken after each tactic."""

    program: Program
    mesh: Mesh
    rules: list[FactorRule]
    value_dims: dict[Var, tuple[tuple[str, ...], ...]]
    eqn_factors: list[dict[int, tuple[str, ...]]]
    pinned: dict[Var, set[str]] = field(default_factory=dict)      # axes a value must not take
    origin: dict[tuple[int, str], str] = field(default_factory=dict)  # (var id, axis) -> why
    conflicts: list[Conflict] = field(default_factory=list)
    tactics_applied: list[str] = field(default_factory=list)
    auto_results: list = field(default_factory=list)   # (label, auto.SearchResult) per AutomaticPartition

    @classmethod
    def initial(cls, program: Program, mesh: Mesh) -> ShardingState:
        vd = {v: ((),) * v.ndim for v in program.vars()}
        return cls(program, mesh, rules_for(program), vd, [{} for _ in program.eqns])

    def copy(self) -> ShardingState:
        return ShardingState(self.program, self.mesh, self.rules, dict(self.value_dims),
                             [dict(f) for f in self.eqn_factors], {v: set(s) for v, s in self.pinned.items()},
                             dict(self.origin), list(self.conflicts), list(self.tactics_applied),
                             list(self.auto_results))

    # -- derived shardings ------------------------------------------------------------
    def dims_from_factors(self, e: int, dims: tuple[tuple[int, ...], ...]) -> list[tuple[str, ...]] | None:
        """Axes of each tensor dim implied by equation ``e``'s factor tiling (None if some dim's
        tiling is not a contiguous block layout)."""
        F, sizes = self.eqn_factors[e], self.rules[e].sizes
        out = []
        for factors in dims:
            a = _dim_axes(F, sizes, factors, self.mesh)
            if a is None:
                return None
            out.append(a)
        return out

    def result_sharding(self, e: int, k: int = 0) -> Sharding:
        rule = self.rules[e]
        dims = self.dims_from_factors(e, rule.results[k])
        assert dims is not None
        partial = tuple(a for f in sorted(rule.reduction) for a in self.eqn_factors[e].get(f, ()))
        return Sharding(tuple(dims), _mesh_order(self.mesh, partial))

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
                lines.append(f"  [{c.eqn}] {c.axis}: {c.message}")
        return "\n".join(lines)

    def _why(self, v: Var) -> str:
        whys = [f"{a}: {self.origin[(v.id, a)]}" for d in self.value_dims[v] for a in d if (v.id, a) in self.origin]
        return ("   # " + "; ".join(whys)) if whys else ""


def rules_for(program: Program) -> list[FactorRule]:
    """The factor rule of every equation; identical equations (every layer of a deep model)
    share one rule object."""
    cache: dict = {}
    out = []
    for e in program.eqns:
        key = (e.prim, tuple(a.shape for a in e.inputs), tuple(o.shape for o in e.outputs), repr(e.params))
        r = cache.get(key)
        if r is None:
            r = cache[key] = rule_for(e)
        out.append(r)
    return out


def _mesh_order(mesh: Mesh, axes) -> tuple[str, ...]:
    if len(axes) < 2:
        return tuple(axes)
    s = set(axes)
    return tuple(a for a in mesh.axis_names if a in s)


def _factor_of_axis(state: ShardingState, sizes, factors, dim_axes, axis) -> int | None:
    """Which factor of a compound dim the axis lands in, given the dim's axes (major→minor)."""
    i = 0
    filled = 1
    for a in dim_axes:
        n = state.mesh.axis_size(a)
        while i < len(factors) and (sizes[factors[i]] == 1 or filled == sizes[factors[i]]):
            i += 1
            filled = 1
        if i >= len(factors) or sizes[factors[i]] % (filled * n):
            return None
        filled *= n
        if a == axis:
            return factors[i]
    return None


def apply_tactic(state: ShardingState, tactic: ManualPartition, index: int) -> None:
    """Seed the tactic's inputs, then propagate its axis to a fixed point."""
    mesh, p = state.mesh, state.program
    axis = tactic.axis
    mesh.check_axis(axis)
    label = tactic.name or f"tactic {index} ({axis})"
    seeds: list[Var] = []
    for i, dim in tactic.resolve(p.input_names).items():
        v, name = p.inputs[i], p.input_names[i]
        dims = state.value_dims[v]
        if dim is REPLICATED:
            if any(axis in d for d in dims):
                raise ShardingError(f"tactic {label}: input {name!r} is already tiled by axis {axis!r} "
                                    f"({state.sharding(v)}); it cannot also be pinned REPLICATED on it")
            state.pinned.setdefault(v, set()).add(axis)
            continue
        if not -v.ndim <= dim < v.ndim:
            raise TacticError(f"tactic {label}: dim {dim} is out of range for input {name!r} of shape {v.shape} "
                              f"(rank {v.ndim}); use 0..{v.ndim - 1}")
        dim %= v.ndim
        where = next((k for k, d in enumerate(dims) if axis in d), None)
        if where == dim:
            continue
        if where is not None:
            why = state.origin.get((v.id, axis), "an earlier tactic")
            raise ShardingError(f"tactic {label}: axis {axis!r} is used twice on input {name!r}: it already tiles "
                                f"dim {where} ({state.sharding(v)}, from {why}) and the tactic asks for dim {dim}; "
                                "drop one of the two or use another axis")
        if axis in state.pinned.get(v, ()):
            raise ShardingError(f"tactic {label}: input {name!r} was pinned REPLICATED on axis {axis!r} "
                                "by an earlier tactic")
        k = mesh.group_size(dims[dim]) * mesh.axis_size(axis)
        if v.shape[dim] % k:
            raise ShardingError(f"tactic {label}: dim {dim} of input {name!r} has size {v.shape[dim]}, which is not "
                                f"divisible by {k} (axes {dims[dim] + (axis,)} of {mesh}); pick another dim or mesh")
        state.value_dims[v] = dims[:dim] + (dims[dim] + (axis,),) + dims[dim + 1:]
        state.origin[(v.id, axis)] = f"{label} (input {name!r} dim {dim})"
        seeds.append(v)
    propagate(state, axis, seeds, label)
    state.tactics_applied.append(label)


def propagate(state: ShardingState, axis: str, seeds: list[Var], label: str) -> None:
    p = state.program
    users = _users(state)
    producers = _producers(state)
    slots_of = _all_slots(state)
    value_dims = state.value_dims
    mesh = state.mesh
    queue: deque[int] = deque()
    queued: set[int] = set()

    def enqueue_value(v: Var) -> None:
        for e in users.get(v, ()):
            if e not in queued:
                queued.add(e)
                queue.append(e)
        e = producers.get(v)
        if e is not None and e not in queued:
            queued.add(e)
            queue.append(e)

    for v in seeds:
        enqueue_value(v)
    seen_conflicts = {(c.eqn, c.axis) for c in state.conflicts}

    def conflict(e: int, msg: str) -> None:
        if (e, axis) not in seen_conflicts:
            seen_conflicts.add((e, axis))
            state.conflicts.append(Conflict(axis, e, f"{p.eqns[e].prim} at {p.eqns[e].source or '?'}: {msg}"))

    def origin_of(v: Var) -> str:
        return state.origin.get((v.id, axis), "?")

    n_axis = mesh.axis_size(axis)
    while queue:
        e = queue.popleft()
        queued.discard(e)
        rule = state.rules[e]
        F = state.eqn_factors[e]
        slots = slots_of[e]
        current = None
        for f, ax in F.items():
            if axis in ax:
                current = f
                break
        cands: dict[int, Var] = {}
        for v, factors in slots:
            for d, da in enumerate(value_dims[v]):
                if axis in da:
                    f = _factor_of_axis(state, rule.sizes, factors[d], da, axis)
                    if f is not None:
                        cands.setdefault(f, v)
        if current is None:
            if not cands:
                continue
            if len(cands) > 1:
                (f1, v1), (f2, v2) = list(cands.items())[:2]
                conflict(e, f"{v1} (from {origin_of(v1)}) and {v2} (from {origin_of(v2)}) want different "
                            f"factors tiled by {axis!r}; left untiled")
                continue
            (f, src), = cands.items()
            if f in rule.blocked:
                continue
            have = F.get(f, ())
            if rule.sizes[f] % (mesh.group_size(have) * n_axis):
                continue
            F[f] = have + (axis,)
            # every operand/result dim made of this factor must express the new tiling as blocks
            if any(_dim_axes(F, rule.sizes, slots[k][1][d], mesh) is None for k, d in _factor_dims(rule)[f]):
                F[f] = have
                conflict(e, f"tiling factor of size {rule.sizes[f]} by {axis!r} is not a block layout here")
                continue
            current = f
            why = f"{label} via {p.eqns[e].prim} from {src}"
        else:
            for f, v in cands.items():
                if f != current:
                    holder = next((x for x, fs in slots for dd, da in enumerate(value_dims[x])
                                   if axis in da and current in fs[dd]), None)
                    conflict(e, f"{v} (from {origin_of(v)}) wants another factor tiled by {axis!r} than the "
                                f"one the equation has" + (f" (from {origin_of(holder)})" if holder else ""))
            why = f"{label} via {p.eqns[e].prim}"
        # push the decision to every operand and result dim made of that factor
        for k, d in _factor_dims(rule).get(current, ()):
            v, factors = slots[k]
            dims = value_dims[v]
            if axis in dims[d]:
                continue
            w = _dim_axes(F, rule.sizes, factors[d], mesh)
            if any(axis in x for x in dims):
                conflict(e, f"{v} already uses {axis!r} on another dim (from {origin_of(v)})")
                continue
            if axis in state.pinned.get(v, ()):
                conflict(e, f"{v} is pinned REPLICATED on {axis!r}")
                continue
            if w is None or dims[d] + (axis,) != w:
                conflict(e, f"{v} dim {d} is tiled {dims[d]}, the equation wants {w}")
                continue
            q = producers.get(v)
            if q is not None and q != e and not _producer_accepts(state, q, v, d, dims[d] + (axis,), axis):
                # never tile a value in a way its own producer cannot compute: the consumer
                # reshards it instead (e.g. x + y.T with x and y tiled alike: one all_to_all)
                conflict(e, f"{v} dim {d}: its producer [{q}] {p.eqns[q].prim} cannot tile it by {axis!r}")
                continue
            value_dims[v] = dims[:d] + (w,) + dims[d + 1:]
            state.origin[(v.id, axis)] = why
            enqueue_value(v)


def _producer_accepts(state: ShardingState, q: int, v: Var, d: int, new_axes: tuple[str, ...], axis: str) -> bool:
    """Could equation ``q`` (which defines ``v``) take ``axis`` on the factor behind dim ``d`` of ``v``,
    given what its other operands and results already say?"""
    rule = state.rules[q]
    F = state.eqn_factors[q]
    slots = _all_slots(state)[q]
    factors = slots[_result_slot(state, q, v)][1][d]
    f = _factor_of_axis(state, rule.sizes, factors, new_axes, axis)
    if f is None or f in rule.blocked:
        return False
    cur = next((g for g, ax in F.items() if axis in ax), None)
    if cur is not None:
        return cur == f
    if rule.sizes[f] % (state.mesh.group_size(F.get(f, ())) * state.mesh.axis_size(axis)):
        return False
    for x, fs in slots:
        if x is v:
            continue
        for dd, da in enumerate(state.value_dims[x]):
            if axis in da:
                g = _factor_of_axis(state, rule.sizes, fs[dd], da, axis)
                if g is not None and g != f:
                    return False
    return True


def _result_slot(state: ShardingState, q: int, v: Var) -> int:
    """Index in ``_all_slots(state)[q]`` of result ``v`` of equation ``q``."""
    slots = _all_slots(state)[q]
    n_in = len(slots) - sum(1 for fs in state.rules[q].results if fs)
    for i in range(n_in, len(slots)):
        if slots[i][0] is v:
            return i
    raise AssertionError(f"{v} is not a result of equation {q}")


def _dim_axes(F: dict[int, tuple[str, ...]], sizes, factors, mesh: Mesh) -> tuple[str, ...] | None:
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


def _factor_dims(rule: FactorRule) -> dict[int, list[tuple[int, int]]]:
    """factor -> [(slot index, dim)] over the rule's non-empty operands then results (as _slots)."""
    cached = rule.__dict__.get("_fd")
    if cached is None:
        cached = {}
        k = 0
        for dims in (*rule.operands, *rule.results):
            if not dims:
                continue
            for d, fs in enumerate(dims):
                for f in fs:
                    cached.setdefault(f, []).append((k, d))
            k += 1
        object.__setattr__(rule, "_fd", cached)
    return cached


def _slots(eqn: Eqn, rule: FactorRule) -> list[tuple[Var, tuple]]:
    out = [(a, fs) for a, fs in zip(eqn.inputs, rule.operands) if fs]
    out += [(o, fs) for o, fs in zip(eqn.outputs, rule.results) if fs]
    return out


def _all_slots(state: ShardingState) -> list[list[tuple[Var, tuple]]]:
    cache = getattr(state, "_slots_cache", None)
    if cache is None:
        cache = [_slots(e, r) for e, r in zip(state.program.eqns, state.rules)]
        state._slots_cache = cache  # type: ignore[attr-defined]
    return cache


def _users(state: ShardingState) -> dict[Var, list[int]]:
    cache = getattr(state, "_users_cache", None)
    if cache is None:
        cache = state.program.users()
        state._users_cache = cache  # type: ignore[attr-defined]
    return cache


def _producers(state: ShardingState) -> dict[Var, int]:
    cache = getattr(state, "_prod_cache", None)
    if cache is None:
        cache = state.program.producers()
        state._prod_cache = cache  # type: ignore[attr-defined]
    return cache


def group_size(mesh: Mesh, axes) -> int:
    return math.prod(mesh.axis_size(a) for a in axes)
