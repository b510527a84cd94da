"""Tactic application and sharding propagation.

A ``ManualPartition`` seeds its inputs with one axis; propagation then carries that axis
through the factor rules (:mod:`partir_emu.core.factors`), forward and backward, to a fixed
point. It is a worklist over equations: visiting an equation picks the factor the axis tiles
there (the one it already tiles, or the one its tiled operands and results agree on) and
pushes that tiling to every operand and result dim made of the factor; a value that changes
puts its users and its producer back on the worklist.

Semantics:

* decisions are only ever *added*: an axis already placed is never moved, so earlier tactics
  win;
* a value is never tiled in a way its own producer cannot compute (producer-consistent): for
  ``x + y.T`` with ``x`` and ``y`` tiled alike, the add does not push the tiling into ``y.T``;
  the consumer reshards instead (one all_to_all);
* where two sources disagree (two factors of one equation wanted on the same axis, a value
  that would need the axis on two dims, a value pinned REPLICATED, a tiling that is not a
  block layout, a producer that cannot follow) nothing is guessed: the equation is left as it
  is, the conflict is recorded once per (equation, axis) with both origins, and the lowering
  inserts the resharding.

Every conflict goes through one path: ``_visit`` yields a :class:`_Met` (kind, reason, the value
and dim, and whether both sides got the axis from this very tactic), ``_record`` stores it as a
:class:`~partir_emu.compiler.conflicts.Conflict`. A conflict between two decisions of one tactic
was settled by the worklist's order, not by the user: :mod:`.conflicts` turns those into warnings.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

from partir_emu.compiler.conflicts import Conflict
from partir_emu.compiler.loop_view import ROW
from partir_emu.compiler.state import ShardingState, dim_axes, factor_of_axis
from partir_emu.compiler.tactics import REPLICATED, ManualPartition
from partir_emu.core.ir import Var
from partir_emu.errors import ShardingError, TacticError


def apply_tactic(state: ShardingState, tactic: ManualPartition, index: int) -> None:
    """Seed the tactic's inputs, then propagate its axis to a fixed point."""
    p, axis = state.program, tactic.axis
    state.mesh.check_axis(axis)
    label = tactic.name or f"tactic {index} ({axis})"
    seeds = [p.inputs[i] for i, dim in tactic.resolve(p.input_names).items()
             if _seed(state, axis, label, i, dim)]
    stops = tactic.stops([(k, e.params["name"]) for k, e in enumerate(p.eqns) if e.prim == "tag"])
    propagate(state, axis, seeds, label, intended=tactic.meet == "reshard", stops=stops)
    state.tactics_applied.append(label)


class _Met(NamedTuple):
    """A conflict as propagation meets it (see :class:`~partir_emu.compiler.conflicts.Conflict`)."""

    kind: str
    reason: str
    value: Var | None = None
    dim: int | None = None
    within: bool = False


def _seed(state: ShardingState, axis: str, label: str, i: int, dim: object) -> bool:
    """Apply one input decision of a tactic; True if the input's tiling changed."""
    mesh, v, name = state.mesh, state.program.inputs[i], state.program.input_names[i]
    dims = state.value_dims[v]
    if dim is REPLICATED:
        if any(axis in d for d in dims):
            raise ShardingError(f"tactic {label}: input {name!r} is already tiled by axis {axis!r} "
                                f"({state.sharding(v)}); it cannot also be pinned REPLICATED on it")
        state.pinned.setdefault(v, set()).add(axis)
        return False
    assert isinstance(dim, int)
    if not -v.ndim <= dim < v.ndim:
        raise TacticError(f"tactic {label}: dim {dim} is out of range for input {name!r} of shape {v.shape} "
                          f"(rank {v.ndim}); use 0..{v.ndim - 1}")
    dim %= v.ndim
    where = next((k for k, d in enumerate(dims) if axis in d), None)
    if where == dim:
        return False
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
    return True


def propagate(state: ShardingState, axis: str, seeds: list[Var], label: str, intended: bool = False,
              stops: frozenset[int] = frozenset()) -> None:
    """Carry ``axis`` from the ``seeds`` (values just tiled by it) to a fixed point. ``intended``:
    the tactic's seeds are meant to meet (``ManualPartition(meet="reshard")``); conflicts between
    them are recorded as intended, not warned about. ``stops``: tag equations the axis is not carried
    across (``ManualPartition(stop_at=...)``)."""
    _Propagation(state, axis, label, intended, stops).run(seeds)


class _Propagation:
    """One axis, one tactic: the worklist and the conflicts already recorded."""

    def __init__(self, state: ShardingState, axis: str, label: str, intended: bool = False,
                 stops: frozenset[int] = frozenset()) -> None:
        self.state, self.index, self.axis, self.label = state, state.index, axis, label
        self.intended, self.stops = intended, stops
        self.queue: deque[int] = deque()
        self.queued: set[int] = set()
        self.recorded = {(c.eqn, c.axis) for c in state.conflicts}
        self.mine: set[Var] = set()       # values this tactic tiled by the axis
        self.took: set[int] = set()       # equations whose factor took the axis in this tactic

    def run(self, seeds: list[Var]) -> None:
        for v in seeds:
            self.mine.add(v)
            self._enqueue(v)
        while self.queue:
            e = self.queue.popleft()
            self.queued.discard(e)
            for met in self._visit(e):
                self._record(e, met)

    def _enqueue(self, v: Var) -> None:
        """Revisit every equation that reads or defines ``v``."""
        producer = self.index.producers.get(v)
        for e in (*self.index.users.get(v, ()), *(() if producer is None else (producer,))):
            if e not in self.queued:
                self.queued.add(e)
                self.queue.append(e)

    def _record(self, e: int, met: _Met) -> None:
        """The one conflict path: the first conflict per (equation, axis) is kept."""
        if (e, self.axis) not in self.recorded:
            self.recorded.add((e, self.axis))
            eqn = self.state.program.eqns[e]
            self.state.conflicts.append(Conflict(self.axis, e, f"{eqn.prim} at {eqn.source or '?'}: {met.reason}",
                                                 met.kind, met.value, met.dim, self.label, met.within,
                                                 met.within and self.intended))

    def _origin(self, v: Var | None) -> str:
        return "?" if v is None else self.state.origin.get((v.id, self.axis), "?")

    # -- one equation -------------------------------------------------------------------
    def _visit(self, e: int) -> Iterator[_Met]:
        """Settle the factor the axis tiles at equation ``e`` and push it to every dim made of
        it; yield each conflict met on the way."""
        if e in self.stops:
            return      # a tag this tactic stops at: each side keeps its own tiling
        st, axis, prim = self.state, self.axis, self.state.program.eqns[e].prim
        rule, F = self.index.rules[e], st.eqn_factors[e]
        wanted = self._wanted(e)
        current = next((f for f, ax in F.items() if axis in ax), None)
        if current is None:
            if not wanted:
                return
            if len(wanted) > 1:
                (_, v1), (_, v2) = list(wanted.items())[:2]
                yield _Met("disagree", f"{v1} (from {self._origin(v1)}) and {v2} (from {self._origin(v2)}) want "
                           f"different factors tiled by {axis!r}; left untiled", v2, None,
                           v1 in self.mine and v2 in self.mine)
                return
            ((f, src),) = wanted.items()
            have = F.get(f, ())
            if f in rule.blocked and prim == ROW:
                yield _Met("loop-dim", f"{src} (from {self._origin(src)}) tiles the iteration dim of a loop's stacked "
                           f"operand by {axis!r}", src, 0, True)
                return
            if f in rule.blocked or rule.sizes[f] % (st.mesh.group_size(have) * st.mesh.axis_size(axis)):
                return   # the factor cannot take the axis: the values keep their own tiling
            F[f] = have + (axis,)
            # every operand/result dim made of this factor must express the new tiling as blocks
            if not self._blocks_everywhere(e, f):
                F[f] = have
                yield _Met("not-block", f"tiling factor of size {rule.sizes[f]} by {axis!r} is not a block layout here",
                           src)
                return
            self.took.add(e)
            current, why = f, f"{self.label} via {prim} from {src}"
        else:
            for f, v in wanted.items():
                if f != current:
                    holder = self._holder(e, current)
                    yield _Met("other-factor", f"{v} (from {self._origin(v)}) wants another factor tiled by {axis!r} "
                               f"than the one the equation has" + (f" (from {self._origin(holder)})" if holder else ""),
                               v, None, v in self.mine and e in self.took)
            why = f"{self.label} via {prim}"
        for k, d in self.index.factor_dims[e].get(current, ()):
            met = self._push(e, k, d, why)
            if met:
                yield met

    def _wanted(self, e: int) -> dict[int, Var]:
        """factor -> the first operand/result whose tiling by the axis lands on that factor."""
        st, rule = self.state, self.index.rules[e]
        out: dict[int, Var] = {}
        for v, factors in self.index.slots[e]:
            for d, da in enumerate(st.value_dims[v]):
                if self.axis in da:
                    f = factor_of_axis(st.mesh, rule.sizes, factors[d], da, self.axis)
                    if f is not None:
                        out.setdefault(f, v)
        return out

    def _holder(self, e: int, f: int) -> Var | None:
        """An operand/result of ``e`` whose dim made of factor ``f`` is tiled by the axis."""
        return next((x for x, fs in self.index.slots[e] for d, da in enumerate(self.state.value_dims[x])
                     if self.axis in da and f in fs[d]), None)

    def _blocks_everywhere(self, e: int, f: int) -> bool:
        F, sizes, slots = self.state.eqn_factors[e], self.index.rules[e].sizes, self.index.slots[e]
        return all(dim_axes(F, sizes, slots[k][1][d], self.state.mesh) is not None
                   for k, d in self.index.factor_dims[e][f])

    def _push(self, e: int, k: int, d: int, why: str) -> _Met | None:
        """Tile dim ``d`` of slot ``k`` of equation ``e`` as the equation's factors say; the
        conflict if it cannot, or None (done, or nothing to do)."""
        st, axis = self.state, self.axis
        v, factors = self.index.slots[e][k]
        dims = st.value_dims[v]
        if axis in dims[d]:
            return None
        w = dim_axes(st.eqn_factors[e], self.index.rules[e].sizes, factors[d], st.mesh)
        here = e in self.took
        if any(axis in x for x in dims):
            return _Met("two-dims", f"{v} already uses {axis!r} on another dim (from {self._origin(v)})", v, d,
                        here and v in self.mine)
        if axis in st.pinned.get(v, ()):
            return _Met("pinned", f"{v} is pinned REPLICATED on {axis!r}", v, d)
        if w is None or dims[d] + (axis,) != w:
            return _Met("order", f"{v} dim {d} is tiled {dims[d]}, the equation wants {w}", v, d)
        q = self.index.producers.get(v)
        if q is not None and q != e:
            accepts, blocker_mine = self._producer_accepts(q, v, d, w)
            if not accepts:
                # never tile a value in a way its own producer cannot compute: the consumer
                # reshards it instead (e.g. x + y.T with x and y tiled alike: one all_to_all)
                return _Met("producer", f"{v} dim {d}: its producer [{q}] {st.program.eqns[q].prim} cannot tile it "
                            f"by {axis!r}", v, d, here and blocker_mine)
        st.value_dims[v] = dims[:d] + (w,) + dims[d + 1:]
        st.origin[(v.id, axis)] = why
        self.mine.add(v)
        self._enqueue(v)
        return None

    def _producer_accepts(self, q: int, v: Var, d: int, new_axes: tuple[str, ...]) -> tuple[bool, bool]:
        """Could equation ``q`` (which defines ``v``) take the axis on the factor behind dim ``d``
        of ``v``, given what its other operands and results already say? And if not, was what
        stops it decided by this tactic (False when the rule itself forbids it)?"""
        st, axis, rule = self.state, self.axis, self.index.rules[q]
        if st.program.eqns[q].prim == "tag":
            return True, False      # a tag is a reshard point: its result may be tiled apart from its operand
        F, slots, mesh = st.eqn_factors[q], self.index.slots[q], st.mesh
        f = factor_of_axis(mesh, rule.sizes, slots[self.index.result_slot[v]][1][d], new_axes, axis)
        if f is None or f in rule.blocked:
            return False, False
        cur = next((g for g, ax in F.items() if axis in ax), None)
        if cur is not None:
            return cur == f, q in self.took
        if rule.sizes[f] % (mesh.group_size(F.get(f, ())) * mesh.axis_size(axis)):
            return False, False
        for x, fs in slots:
            if x is v:
                continue
            for dd, da in enumerate(st.value_dims[x]):
                if axis in da:
                    g = factor_of_axis(mesh, rule.sizes, fs[dd], da, axis)
                    if g is not None and g != f:
                        return False, x in self.mine
        return True, False
