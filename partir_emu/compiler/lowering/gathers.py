"""Rematerialise parameter all-gathers once per pass: ZeRO-3 as PyTorch FSDP runs it (the gathered
parameters are freed after the forward and gathered again for the backward).

Under ZeRO-3 a parameter is stored sharded and all-gathered where it is used. The lowering
gathers each value once and lets every reader share it, so a gathered parameter would live from
its forward use to its backward use — the whole step, which is the memory ZeRO-3 exists to save.
This pass runs on the lowered (local-shape) program and gives each *use cluster* its own copy.

**Gather chains.** A value is *rematerialisable* if it is a program input or constant, or is made
by an equation in :data:`CHAIN_PRIMS` (all-gathers and cheap local layout/precision ops: casts,
reshapes, transposes, broadcasts, slices) all of whose operands are rematerialisable. The chain
of such a value is *gathered* if it contains an ``all_gather``. Gathered chains (with the local
ops they start from, e.g. the bf16 cast of the f32 master shard) are not kept where the lowering
put them: each is emitted right before the first equation of each use cluster that reads it, and
that copy is shared by the cluster's other readers. Chains without a gather are left alone.

**Use clusters** (the rule). An equation's cluster is its *pass*:

* ``forward``: lowered from a global equation at or before the last one that a *primal output*
  needs (the loss). Primal outputs are the outputs not mirrored to the step's state
  (``state_outputs`` of :func:`partir_emu.compiler.lowering.lower.lower`), or without ``state_outputs``
  the rank-0 outputs;
* ``backward``: everything after it — the gradient, a ``jax.checkpoint`` recomputation (which
  jax emits right before the layer's gradient, so the recompute and the gradient of a layer
  share one gather, as an FSDP unit's backward does) and the optimizer.

So a parameter is gathered at most once per pass, freed after its last forward use and gathered
again for the backward pass, whether or not it is cast or reshaped first. Program outputs form a
cluster of their own. The pass boundary, not a distance in equations, decides: a distance would
have to be tuned per model and size, while the boundary is where a training step's activation
memory usually peaks. Within a pass a copy lives from its first reader to its last (a tied embedding stays
gathered through the forward); with ``remat`` a copy spans one layer's recompute and gradient. When no primal output is known (e.g. a function returning only gradients)
the pass cannot tell forward from backward and every reading equation is its own cluster (a
gather per use, the most frugal choice for memory).

**Casts move first.** A narrowing ``convert_element_type`` (f32 → bf16) of a gathered value that
nothing else reads is moved before the gather (and the layout ops between them), so the gather
moves the bf16 bytes: the cast is elementwise, so both orders compute the same bits.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

from partir_emu.core.ir import Atom, Eqn, Program, Var, itemsize

CHAIN_PRIMS = frozenset({
    "all_gather", "all_slice", "convert_element_type", "reshape", "transpose", "broadcast_in_dim",
    "squeeze", "expand_dims", "copy", "copy_p", "slice", "rev", "reduce_precision",
})
# ops that commute with an elementwise cast (they only move or replicate elements)
_LAYOUT_PRIMS = CHAIN_PRIMS - {"convert_element_type", "reduce_precision", "copy", "copy_p"}

FORWARD, BACKWARD, OUTPUTS = "forward", "backward", "outputs"


def last_primal_eqn(program: Program, primal_outputs: Sequence[int]) -> int | None:
    """The index of the last global equation that one of the ``primal_outputs`` (output indices)
    depends on (in SSA order: the last of their producers); None if they depend on none."""
    prod = program.producers()
    outs = [program.outputs[k] for k in primal_outputs]
    return max((prod[o] for o in outs if isinstance(o, Var) and o in prod), default=None)


def primal_outputs(program: Program, state_outputs: dict[str, str] | None) -> list[int]:
    """Output indices that the forward pass computes (see the module docstring)."""
    if state_outputs:
        return [k for k, n in enumerate(program.output_names) if n.partition("/")[0] not in state_outputs]
    return [k for k, o in enumerate(program.outputs) if isinstance(o, Var) and o.ndim == 0]


def primal_cone(program: Program, primal_outputs: Sequence[int]) -> frozenset[int]:
    """The indices of the equations that the ``primal_outputs`` (output indices) depend on. On the
    flat program of :mod:`..loop_view` the link equations carry the dependence through loops, so a
    loop body's equations are in the cone exactly when the forward pass needs them (a gradient
    accumulation body's forward pass, not its backward pass)."""
    prod = program.producers()
    seen: set[int] = set()
    stack = [prod[o] for k in primal_outputs for o in (program.outputs[k],) if isinstance(o, Var) and o in prod]
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        stack += [prod[a] for a in program.eqns[i].inputs if isinstance(a, Var) and a in prod]
    return frozenset(seen)


def body_clusters(body: Program, origin: Sequence[int], cone: frozenset[int]) -> list[Hashable] | None:
    """The use clusters of a lowered loop body (``origin``: the flat global equation of each body
    equation) whose iteration runs a forward *and* a backward pass, as a gradient-accumulation body
    does: its forward pass ends at the last equation of the primal ``cone`` that reads a gathered
    value (the body's own outputs are sums into carries, computed after its backward pass, so the
    last producer of a primal output would put the whole body in the forward pass). None when the
    body reads gathered values in one pass only: a forward layer, or a backward layer whose recompute
    and gradient share their gathers (as an FSDP unit's backward does)."""
    _, gathered = gathered_chains(body)
    readers = [j for j, e in enumerate(body.eqns)
               if not (e.outputs and e.outputs[0] in gathered) and any(a in gathered for a in e.inputs if isinstance(a, Var))]
    forward = [origin[j] for j in readers if origin[j] in cone]
    if not forward or all(origin[j] in cone or origin[j] <= max(forward) for j in readers):
        return None
    return pass_clusters(origin, max(forward))


def pass_clusters(origin: Sequence[int], boundary: int | None) -> list[Hashable]:
    """The use cluster of each lowered equation, from the global equation it was lowered for
    (``origin``) and the last forward global equation (``boundary``; None: one per equation)."""
    if boundary is None:
        return list(range(len(origin)))
    return [FORWARD if g <= boundary else BACKWARD for g in origin]


def cast_before_gather(program: Program) -> tuple[Program, list[int]]:
    """Move each narrowing cast of a gathered value above the gather (see the module docstring);
    also return, per new equation, the index of the equation it stands for."""
    producer = program.producers()
    readers = {v: len(us) for v, us in program.users().items()}
    for o in program.outputs:   # a program output has a reader outside the equations
        if isinstance(o, Var):
            readers[o] = readers.get(o, 0) + 1
    drop: set[int] = set()
    at: dict[int, list[Eqn]] = {}          # convert index -> the equations replacing it
    nid = program.next_id()
    for i, e in enumerate(program.eqns):
        if e.prim != "convert_element_type" or not isinstance(e.inputs[0], Var):
            continue
        (y,), x = e.outputs, e.inputs[0]
        if itemsize(y.dtype) >= itemsize(x.dtype):
            continue
        path: list[int] = []
        while (x in producer and readers.get(x) == 1 and program.eqns[producer[x]].prim in _LAYOUT_PRIMS
               and len(program.eqns[producer[x]].outputs) == 1 and isinstance(program.eqns[producer[x]].inputs[0], Var)):
            path.append(producer[x])
            nxt = program.eqns[producer[x]].inputs[0]
            assert isinstance(nxt, Var)          # checked by the loop condition
            x = nxt
        if not any(program.eqns[j].prim == "all_gather" for j in path):
            continue
        cur = Var(nid, x.shape, y.dtype)
        nid += 1
        new = [Eqn(e.prim, (x,), (cur,), e.params, e.source, e.kernel)]
        for j in reversed(path):
            lay = program.eqns[j]
            out = y if j == path[0] else Var(nid, lay.outputs[0].shape, y.dtype)
            nid += out is not y
            new.append(Eqn(lay.prim, (cur, *lay.inputs[1:]), (out,), lay.params, lay.source, lay.kernel))
            cur = out
        drop.update(path)
        at[i] = new
    eqns: list[Eqn] = []
    origin: list[int] = []
    for i, e in enumerate(program.eqns):
        if i in drop:
            continue
        rep = at.get(i, [e])
        eqns += rep
        origin += [i] * len(rep)
    return dataclasses.replace(program, eqns=tuple(eqns)), origin


def rematerialise_gathers(program: Program, clusters: Sequence[Hashable]) -> Program:
    """``program`` with each gathered chain emitted once per use cluster (``clusters[i]``: the
    cluster of equation ``i``), right before the cluster's first reader."""
    return _Remat(program, clusters).run()


def gathered_chains(program: Program) -> tuple[dict[Var, Eqn], set[Var]]:
    """The rematerialisable values' producers (module docstring, *gather chains*) and the values that
    are emitted per use cluster: each gathered value and the chain values it is made from."""
    producer: dict[Var, Eqn] = {}
    gathered: set[Var] = set()           # values of gathered chains
    remat: set[Var] = set(program.inputs) | {v for v, _ in program.consts}
    for e in program.eqns:
        vs = [a for a in e.inputs if isinstance(a, Var)]
        if e.prim in CHAIN_PRIMS and len(e.outputs) == 1 and vs and all(a in remat for a in vs):
            (o,) = e.outputs
            remat.add(o)
            producer[o] = e
            if e.prim == "all_gather" or any(a in gathered for a in vs):
                gathered.add(o)
    deferred: set[Var] = set()
    stack = list(gathered)
    while stack:
        v = stack.pop()
        if v in producer and v not in deferred:
            deferred.add(v)
            stack += [a for a in producer[v].inputs if isinstance(a, Var)]
    return producer, deferred


class _Remat:
    def __init__(self, program: Program, clusters: Sequence[Hashable]) -> None:
        assert len(clusters) == len(program.eqns)
        self.p, self.clusters = program, clusters
        self.next_id = program.next_id()
        self.producer, self.deferred = gathered_chains(program)
        self.memo: dict[tuple[Var, Hashable], Var] = {}
        self.copied: set[Var] = set()        # deferred values emitted at least once
        self.eqns: list[Eqn] = []

    def run(self) -> Program:
        for i, e in enumerate(self.p.eqns):
            if e.outputs and e.outputs[0] in self.deferred:
                continue
            ins = tuple(self.get(a, self.clusters[i], e.kernel) for a in e.inputs)
            self.eqns.append(e if ins == e.inputs else dataclasses.replace(e, inputs=ins))
        outs = tuple(self.get(o, OUTPUTS, "") for o in self.p.outputs)
        return dataclasses.replace(self.p, eqns=tuple(self.eqns), outputs=outs)

    def get(self, a: Atom, cluster: Hashable, kernel: str) -> Atom:
        """The copy of ``a`` for ``cluster``, emitting its chain the first time the cluster reads it.
        The first copy of a value is its own equation and Var; a later copy is a new Var, tagged
        with the hand-fused kernel of the reader it is emitted for (``kernel``)."""
        if not isinstance(a, Var) or a not in self.deferred:
            return a
        key = (a, cluster)
        if key not in self.memo:
            e = self.producer[a]
            ins = tuple(self.get(x, cluster, kernel) for x in e.inputs)
            if a in self.copied:
                out = Var(self.next_id, a.shape, a.dtype)
                self.next_id += 1
                e = dataclasses.replace(e, kernel=kernel)
            else:
                out = a
                self.copied.add(a)
            self.eqns.append(dataclasses.replace(e, inputs=ins, outputs=(out,)))
            self.memo[key] = out
        return self.memo[key]
