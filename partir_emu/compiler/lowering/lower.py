"""Lowering: a sharded Program → one SpmdProgram with explicit collectives.

One interpreter-shaped pass over the equations. Each equation's factor tiling
fixes the sharding it needs of each operand; ``reshard`` moves an operand from
the sharding it has to the one needed with the fewest collectives:

* pending sums not wanted → ``all_reduce``, or ``reduce_scatter`` when the
  target tiles a dim by those very axes (an all_reduce followed by a slice
  on the same axes is never emitted); a pending max/min → ``all_reduce`` with that op;
* axes that tile a dim in the source but not the target → ``all_gather``, or
  ``all_to_all`` when the same axes move to another dim;
* axes the target adds → ``all_slice`` (local, no traffic);
* a pending sum the target needs (a scatter-add accumulator) → ``to_partial``.

Reshardings are cached per (value, target), so a value is moved once however
many equations read it. Then :mod:`.rematerialise_gathers` gives each pass its own
copy of a gathered parameter (ZeRO-3: dropped after its last forward use and
gathered again for the backward pass, cast to the compute precision before the
gather), so the lowering itself never duplicates a collective.
"""
from __future__ import annotations

import math

from partir_emu.compiler.lowering.gathers import (
    cast_before_gather,
    last_primal_eqn,
    pass_clusters,
    primal_cone,
    primal_outputs,
    rematerialise_gathers,
)
from partir_emu.compiler.lowering.halo import lower_spatial
from partir_emu.compiler.lowering.indexed import lower_indexed
from partir_emu.compiler.lowering.loops import drop_unread_reductions, lower_loop
from partir_emu.compiler.lowering.rotate import lower_rotation
from partir_emu.compiler.state import ShardingState, mesh_order
from partir_emu.core.ir import Atom, Eqn, Literal, Program, Var
from partir_emu.core.sharding import Sharding
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import LoweringError
from partir_emu.primitives import localize_params


class Lowerer:
    """One lowering pass: the local program emitted so far and, per global value, its layout and local value."""

    def __init__(self, state: ShardingState) -> None:
        self.state = state
        self.mesh = state.mesh
        self.next_id = state.program.next_id()
        self.eqns: list[Eqn] = []
        self.origin: list[int] = []          # per lowered equation: the global equation it serves
        self.at = 0                          # the global equation being lowered
        self.actual: dict[Var, Sharding] = {}
        self.local: dict[Var, Var] = {}
        self.cache: dict[tuple[Var, Sharding], Var] = {}
        # the global equations the forward pass needs (set by :func:`lower`): a loop body's passes
        self.primal_cone: frozenset[int] = frozenset()
        self.loop_depth = 0                  # how many loop bodies enclose the equation being lowered
        # A pending sum passes through a linear reader only if *every* reader of the value is
        # linear; otherwise it is resolved once and all readers share the resolved value.
        users = state.program.users()
        self.linear_only = {v: all(state.rules[i].linear for i in us) for v, us in users.items()}
        for o in state.program.outputs:
            if isinstance(o, Var):
                self.linear_only[o] = False

    def new_var(self, shape, dtype) -> Var:
        v = Var(self.next_id, tuple(shape), dtype)
        self.next_id += 1
        return v

    def emit(self, prim: str, ins, out_shape, dtype, params, source="") -> Var:
        out = self.new_var(out_shape, dtype)
        self.append(Eqn(prim, tuple(ins), (out,), params, source))
        return out

    def append(self, e: Eqn) -> None:
        self.eqns.append(e)
        self.origin.append(self.at)

    # -- resharding -----------------------------------------------------------------
    def reshard(self, v: Var, target: Sharding, why: str) -> Var:
        src = self.actual[v]
        if src == target:
            return self.local[v]
        key = (v, target)
        if key in self.cache:
            return self.cache[key]
        out = self.cache[key] = self._plan(v, src, target, why)
        return out

    def _plan(self, v: Var, src: Sharding, dst: Sharding, why: str) -> Var:
        mesh = self.mesh
        cur_dims = [tuple(d) for d in src.dims]
        x = self.local[v]

        def step(prim, params, new_dims):
            nonlocal x, cur_dims
            cur_dims = new_dims
            shape = Sharding(tuple(cur_dims)).local_shape(v.shape, mesh)
            x = self.emit(prim, [x], shape, v.dtype, params, why)

        same_op = src.partial_op == dst.partial_op
        resolve = [a for a in src.partial if a not in dst.partial or not same_op]
        new_partial = [a for a in dst.partial if a not in src.partial or not same_op]
        gather, slc = [], []
        for s, t in zip(src.dims, dst.dims):
            k = 0
            while k < min(len(s), len(t)) and s[k] == t[k]:
                k += 1
            gather.append(s[k:])
            slc.append(t[k:])
        # partial axes that the target tiles a dim by, right after the common prefix
        rs: dict[int, tuple[str, ...]] = {}
        for d in range(len(slc) if src.partial_op == "sum" else 0):   # a pending max is all-reduced
            run = []
            for a in slc[d]:
                if a in resolve and not any(a in r for r in rs.values()):
                    run.append(a)
                else:
                    break
            if run:
                rs[d] = tuple(run)
        rest = mesh_order(mesh, [a for a in resolve if not any(a in r for r in rs.values())])
        # the all-reduce of the other pending axes runs on the smaller buffer: before the gathers
        # (still tiled), or after the reduce-scatters when they shrink it more than the gathers grow
        # it: a gradient of a weight sharded over ``fsdp`` and replicated over ``dcn`` is
        # reduce-scattered over fsdp first, and only its shard crosses the slower dcn axis
        grow = math.prod(mesh.axis_size(a) for g in gather for a in g)
        shrink = math.prod(mesh.axis_size(a) for r in rs.values() for a in r)
        late = bool(rest) and shrink > grow
        if rest and not late:
            step("all_reduce", {"axes": rest, "op": src.partial_op}, cur_dims)
        for d in range(len(gather)):
            g = gather[d]
            if not g:
                continue
            to = next((d2 for d2 in range(len(slc)) if d2 != d and not gather[d2] and d2 not in rs
                       and slc[d2][:len(g)] == g), None)
            if to is not None:
                nd = list(cur_dims)
                nd[d] = cur_dims[d][:len(cur_dims[d]) - len(g)]
                nd[to] = cur_dims[to] + g
                step("all_to_all", {"axes": g, "split_dim": to, "concat_dim": d}, nd)
                slc[to] = slc[to][len(g):]
            else:
                nd = list(cur_dims)
                nd[d] = cur_dims[d][:len(cur_dims[d]) - len(g)]
                step("all_gather", {"axes": g, "dim": d}, nd)
            gather[d] = ()
        for d, axes in rs.items():
            nd = list(cur_dims)
            nd[d] = cur_dims[d] + axes
            step("reduce_scatter", {"axes": axes, "dim": d}, nd)
            slc[d] = slc[d][len(axes):]
        if late:
            step("all_reduce", {"axes": rest, "op": src.partial_op}, cur_dims)
        for d in range(len(slc)):
            if slc[d]:
                nd = list(cur_dims)
                nd[d] = cur_dims[d] + slc[d]
                step("all_slice", {"axes": slc[d], "dim": d}, nd)
        if new_partial:
            step("to_partial", {"axes": mesh_order(mesh, new_partial)}, cur_dims)
        assert tuple(cur_dims) == dst.dims, (cur_dims, dst)
        return x

    # -- the pass ---------------------------------------------------------------------
    def run(self, out_targets: dict[int, Sharding] | None = None, boundary: int | None = None) -> SpmdProgram:
        """Lower every equation, then give each pass its own gathered parameters (``boundary``: the
        last global equation of the forward pass, see :mod:`.rematerialise_gathers`)."""
        st, mesh, p = self.state, self.mesh, self.state.program
        in_locals = []
        in_shardings = []
        for v, name in zip(p.inputs, p.input_names):
            s = st.sharding(v)
            s.validate(v.shape, mesh, f"input {name!r}")
            lv = self.new_var(s.local_shape(v.shape, mesh), v.dtype)
            self.actual[v], self.local[v] = s, lv
            in_locals.append(lv)
            in_shardings.append(s)
        consts = []
        body_consts = {v for r in st.index.regions.values() for v, _ in r.loop.params["body"].consts}
        for v, c in p.consts:
            self.actual[v], self.local[v] = Sharding.replicated(v.ndim), v
            if v not in body_consts:      # a body's constants stay in its body
                consts.append((v, c))
        self.lower_range(0, len(p.eqns))
        self.at = len(p.eqns)
        outs: list[Atom] = []
        out_shardings: list[Sharding] = []
        for k, (o, name) in enumerate(zip(p.outputs, p.output_names)):
            if isinstance(o, Literal):
                outs.append(o)
                out_shardings.append(Sharding(()))
                continue
            tgt = (out_targets or {}).get(k) or Sharding(self.actual[o].dims)
            tgt.validate(o.shape, mesh, f"output {name!r}")
            outs.append(self.reshard(o, tgt, f"output {name}"))
            out_shardings.append(tgt)
        prog = Program(tuple(in_locals), p.input_names, tuple(self.eqns), tuple(outs), p.output_names, tuple(consts))
        prog, moved = cast_before_gather(prog)
        kept = drop_unread_reductions(prog)
        if kept is not prog:        # an equation dropped: the origins index the kept ones
            gone = {id(e) for e in prog.eqns} - {id(e) for e in kept.eqns}
            moved = [m for m, e in zip(moved, prog.eqns) if id(e) not in gone]
            prog = kept
        prog = rematerialise_gathers(prog, pass_clusters([self.origin[j] for j in moved], boundary))
        return SpmdProgram(mesh, prog, tuple(in_shardings), tuple(out_shardings),
                           tuple(v.shape for v in p.inputs), tuple(o.shape for o in p.outputs),
                           {"tactics": list(st.tactics_applied)})

    def lower_range(self, start: int, end: int) -> None:
        """Lower global equations ``start..end-1``; a loop region becomes one loop equation."""
        regions, eqns = self.state.index.regions, self.state.program.eqns
        i = start
        while i < end:
            if i in regions:
                lower_loop(self, regions[i])
                i = regions[i].end
                continue
            self.at = i
            self.lower_eqn(i, eqns[i])
            i += 1

    def lower_eqn(self, i: int, e: Eqn) -> None:
        st = self.state
        if e.prim == "tag" and isinstance(e.inputs[0], Var):
            # a reshard point (compiler.tracing.tag): the result keeps the tiling propagation gave it,
            # reached from the operand's by the fewest collectives (an all_to_all where the sides differ)
            (o,) = e.outputs
            self.actual[o] = st.sharding(o)
            self.local[o] = self.reshard(e.inputs[0], self.actual[o], f"tag {e.params['name']!r} at {e.source}")
            return
        rule = st.rules[i]
        F = st.eqn_factors[i]
        used = {a for ax in F.values() for a in ax}
        red = mesh_order(self.mesh, [a for f in rule.reduction for a in F.get(f, ())])
        passthrough: tuple[str, ...] = ()
        if rule.linear:
            partials = {(self.actual[a].partial, self.actual[a].partial_op) if isinstance(a, Var) else ((), "sum")
                        for a in e.inputs}
            if len(partials) == 1 and all(self.linear_only.get(a, False) for a in e.inputs if isinstance(a, Var)):
                ((pp, op),) = partials
                if pp and op == "sum" and not (set(pp) & used):     # only a pending sum is linear
                    passthrough = pp
        ins: list[Atom] = []
        for k, (a, fs) in enumerate(zip(e.inputs, rule.operands)):
            if isinstance(a, Literal):
                ins.append(a)
                continue
            dims = st.dims_from_factors(i, fs) if fs else [()] * a.ndim
            if dims is None:   # propagation never leaves this; keep the invariant loud
                raise LoweringError(f"internal: operand {k} of {e.prim} at {e.source} has no block layout")
            partial = red if k in rule.partial_operands else passthrough
            ins.append(self.reshard(a, Sharding(tuple(dims), partial), f"operand {k} of {e.prim} at {e.source}"))
        outs = []
        for k, o in enumerate(e.outputs):
            s = st.result_sharding(i, k)
            s = s.with_partial(mesh_order(self.mesh, set(s.partial) | set(passthrough)))
            lv = self.new_var(s.local_shape(o.shape, self.mesh), o.dtype)
            self.actual[o], self.local[o] = s, lv
            outs.append(lv)
        if lower_spatial(self, i, e, ins, outs):   # a tiled spatial dim: halo exchange + local eqn
            return
        if lower_indexed(self, i, e, ins, outs):   # a lookup into a tiled dim: masked local lookup
            return
        if lower_rotation(self, i, e, ins, outs):  # a rotation along a tiled dim: collective_permute
            return
        params = localize_params(e, ins, outs)
        self.append(Eqn(e.prim, tuple(ins), tuple(outs), params, e.source, e.kernel))


def lower(state: ShardingState, state_outputs: dict[str, str] | None = None) -> SpmdProgram:
    """Lower the final sharding state. ``state_outputs`` maps an output-name prefix to an
    input-name prefix (``{"1": "params"}``): each such output is given the sharding of the input
    of the same path, as a training step's new state must be laid out like the state it replaces.
    The other outputs (the loss) tell the forward pass from the backward pass, each of which gets its
    own gathered parameters (see :mod:`.rematerialise_gathers`)."""
    p = state.program
    targets: dict[int, Sharding] = {}
    if state_outputs:
        by_name = dict(zip(p.input_names, p.inputs))
        for k, name in enumerate(p.output_names):
            head, _, rest = name.partition("/")
            if head in state_outputs:
                src = f"{state_outputs[head]}/{rest}" if rest else state_outputs[head]
                v = by_name.get(src)
                if v is None:
                    raise LoweringError(f"output {name!r} should mirror input {src!r}, which does not exist")
                if v.shape != p.outputs[k].shape:
                    raise LoweringError(f"output {name!r} {p.outputs[k].shape} cannot mirror input {src!r} {v.shape}")
                targets[k] = state.sharding(v)
    primal = primal_outputs(p, state_outputs)
    lowerer = Lowerer(state)
    if state.index.regions:
        lowerer.primal_cone = primal_cone(p, primal)
    return lowerer.run(targets, last_primal_eqn(p, primal))

