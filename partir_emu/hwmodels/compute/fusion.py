"""How the chip's compiler would run the per-device program: equations grouped into fused kernels,
each priced by the HBM traffic across its boundary and its FLOPs.

The SPMD program is never changed: fusion is a view the cost model takes of it.

Grouping (:func:`fuse`, one pass in program order, hardware independent; the spec's
``[compiler]`` table picks one of a few variants, see :mod:`.efficiency`):

- **loop fusion**: elementwise ops and layout ops (reshape, convert, transpose, slicing, concatenate,
  pad, gather, ...) join the groups of their producers, as XLA's producer–consumer fusion does;
- **reductions are roots**: a reduction takes its producers in, then its group is closed: its
  result (and any value of the group read later) leaves the group through HBM;
- **cheap producers are duplicated**: ``broadcast_in_dim``, ``iota`` and ``axis_index`` whose every
  user fuses them are recomputed inside each consumer group (consumers read the broadcast's
  *input*); used by an op that cannot fuse them (or a program output) they are written once;
- **matmuls**: with ``matmul_operand_fusion`` open elementwise/layout producer groups join the dot
  (XLA:TPU); ``matmul_epilogue = "elementwise"`` lets any elementwise consumer join the dot's group
  (XLA:TPU output fusion), ``"bias_activation"`` only consumers that read no other full-size tensor
  (bias add, relu, gelu: cuBLASLt epilogues); no group holds two dots;
- **hand-fused kernels**: equations tagged with the same ``Eqn.kernel`` form one group per
  connected region whatever their kinds (dots included): one kernel;
- **eager** (``CompilerSpec.eager``: a stack without a compiler, PyTorch eager): each framework op is
  one kernel. The program marks which equations make one op with ``Eqn.kernel`` tags ``op.NAME``
  (a LayerNorm, a GELU, a cross-entropy: the scenario code wraps them in
  ``jax.named_scope("kernel:op.NAME")``, as the PyTorch code it stands for calls ``F.layer_norm``);
  each tagged region is one group, every untagged elementwise op or reduction is a group of its own
  (``x + y`` is one kernel), a dot takes at most one bias add (``matmul_epilogue = "bias"``), and
  views (reshape, transpose, broadcast, slice) cost nothing: their readers read what they view.
  Other stacks ignore ``op.`` tags (XLA fuses across them), except the ops a stack runs as
  hand-written kernels (``CompilerSpec.hand_ops``, from the stack's ``hand_fused``: Megatron's fused
  LayerNorm and scale-mask-softmax): each such region is one kernel, its backward another;
- everything else (communicating collectives, sort, cumulative ops, in-place updates) is its own
  group priced by its unfused cost rule, and breaks the groups it reads; so is a ``loop`` equation
  (no cost of its own here: its body's groups are formed within the body, :mod:`partir_emu.hwmodels.pricing`);
- a group whose value has been read by an equation outside it is closed (nothing joins it later):
  this keeps every group a single step of the schedule (no group both before and after another op).

A value crosses a boundary once per reader group (read) and once in all (written, by its producer's
group, if any other group or the program's outputs read it). Slicing ops read only the region they keep.

Measuring them: :mod:`.fusion_plan` (which also keeps a grouping for the programs of one structure:
another mesh of one strategy is grouped as the first was, :class:`.fusion_plan.Groupings`); pricing
them: :mod:`.kernel_times`.

Not modelled: multi-output (sibling) fusion of reductions over the same input, recomputation of
elementwise producers into several consumer groups (XLA duplicates cheap ones; only broadcast/iota are
here), fusion-size limits and register pressure, caches (L2 reuse between kernels), TPU's overlap of
MXU and VPU work inside a fusion, and whether a particular XLA version pattern-matches a GELU.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from partir_emu.core.ir import Program, Var
from partir_emu.hwmodels.compute.costs import op_kind
from partir_emu.hwmodels.compute.efficiency import CompilerSpec
from partir_emu.hwmodels.compute.fusion_plan import (
    CHEAP,
    DOT,
    FLASH_KERNEL,
    LOOP,
    OPAQUE,
    REDUCE,
    FusionPlan,
    Groupings,
    measure,
)
from partir_emu.primitives.costs import buffer_bytes

OP_PREFIX = "op."                       # an Eqn.kernel tag of one framework op: a kernel under eager stacks only
# what an eager framework runs as views of its operand (no kernel): PyTorch's view/expand/narrow/permute
_VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "transpose", "broadcast_in_dim", "slice", "stop_gradient",
                    "all_slice", "to_partial", "copy", "copy_p"})


def hand_tag(kernel: str, eager: bool, hand_ops: frozenset[str] = frozenset()) -> str:
    """The hand-fused kernel an ``Eqn.kernel`` tag makes: any tag under an eager stack; under a
    compiler, a tag that is not a framework op's (``flash_attention``), or an ``op.NAME`` tag whose
    op the stack runs as a hand-written kernel (``NAME`` in ``hand_ops``; ``op.NAME/bwd``: its backward)."""
    if eager or not kernel.startswith(OP_PREFIX):
        return kernel
    return kernel if kernel[len(OP_PREFIX):].split("/", 1)[0] in hand_ops else ""
_CHEAP = frozenset({"broadcast_in_dim", "iota", "axis_index"})
_REDUCE = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                     "argmax", "argmin"})
_LAYOUT = frozenset({"reshape", "convert_element_type", "squeeze", "expand_dims", "slice", "dynamic_slice",
                     "copy", "copy_p", "stop_gradient", "reduce_precision", "transpose", "concatenate", "pad",
                     "rev", "all_slice", "to_partial", "stack", "unstack", "split", "gather"})
_SLICING = frozenset({"slice", "dynamic_slice", "gather", "all_slice"})


def fusion_class(prim: str) -> int:
    """CHEAP | LOOP | REDUCE | DOT | OPAQUE: what a primitive can do in a fusion."""
    if prim in _CHEAP:
        return CHEAP
    if prim in _REDUCE:
        return REDUCE
    if prim == "dot_general":
        return DOT
    if prim in _LAYOUT or op_kind.get(prim) == "elementwise":
        return LOOP
    return OPAQUE


class FusionCache:
    """The fusion plans of one program, one per compiler variant, built when first asked for (an
    explicit memo; :class:`~partir_emu.hwmodels.analytical.ProgramCosts` holds one so the DES and the analytical model
    price the same groups)."""

    __slots__ = ("_program", "_flops", "_bytes", "_plans", "shared")

    def __init__(self, program: Program, flops: np.ndarray, byts: np.ndarray) -> None:
        self._program = program
        self._flops = flops
        self._bytes = byts
        self._plans: dict[tuple, FusionPlan] = {}
        self.shared: Groupings | None = None        # groupings of programs of one structure (an Analyzer's)

    def plan(self, compiler: CompilerSpec) -> FusionPlan:
        key = compiler.variant
        p = self._plans.get(key)
        if p is None:
            p = self._plans[key] = fuse(self._program, self._flops, self._bytes, compiler, self.shared)
        return p


# -- grouping ----------------------------------------------------------------------------------------
class _Groups:
    """Union-find over groups with each root's state: open (may still take members), its dot, its tag."""

    __slots__ = ("parent", "open", "dot", "tag")

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.open: list[bool] = []
        self.dot: list[int] = []
        self.tag: list[str] = []

    def find(self, g: int) -> int:
        parent = self.parent
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    def union(self, g: int, r: int) -> None:
        """Merge root ``r`` into root ``g``."""
        self.parent[r] = g
        if self.dot[r] >= 0:
            self.dot[g] = self.dot[r]


def _transparent(program: Program, cls: Sequence[int], operand_fusion: bool, tags: Sequence[str]) -> list[bool]:
    """Cheap ops duplicated into their consumers: every user fuses them and no output is a program output."""
    eqns = program.eqns
    users = program.users()
    outs = {o.id for o in program.outputs if type(o) is Var}
    t = [False] * len(eqns)
    for i in range(len(eqns) - 1, -1, -1):
        e = eqns[i]
        if cls[i] != CHEAP or tags[i]:
            continue
        ok = True
        for o in e.outputs:
            if o.id in outs:
                ok = False
            for u in users.get(o, ()):
                cu = cls[u]
                if not (t[u] or cu == LOOP or cu == REDUCE or tags[u] or (cu == DOT and operand_fusion)):
                    ok = False
        t[i] = ok
    return t


def _group(program: Program, cls: Sequence[int], transparent: Sequence[bool], compiler: CompilerSpec,
           tags: Sequence[str], shaped: set[int]) -> tuple[list[int], _Groups, list[tuple]]:
    """Assign every non-transparent equation a group (program order). Returns (group root per equation,
    the groups, each equation's expanded inputs as (var, read bytes or -1 for whole). ``shaped`` gets
    the equations whose operands' sizes a decision read (:func:`_reads_only`)."""
    eqns = program.eqns
    prod: dict[int, int] = {}
    gs = _Groups()
    gid = [-1] * len(eqns)
    reads: list[tuple] = [()] * len(eqns)
    memo: dict[int, list] = {}
    epilogue, operand, eager = compiler.matmul_epilogue, compiler.matmul_operand_fusion, compiler.eager
    parent = gs.parent
    gopen, gdot, gtag = gs.open, gs.dot, gs.tag
    for i, e in enumerate(eqns):
        for o in e.outputs:
            prod[o.id] = i
        if transparent[i]:
            continue
        prim = e.prim
        reads[i], cand = _reads_and_sources(e, eqns, prod, transparent, memo, gid, gs)
        # communication breaks a kernel; so does a loop (its body is priced on its own: a fusion boundary)
        tag = tags[i] if prim != "loop" and op_kind.get(prim) != "collective" else ""
        g = len(parent)                                       # a new group (its own root, open)
        parent.append(g)
        gopen.append(True)
        gdot.append(-1)
        gtag.append(tag)
        c = cls[i]
        # eager: an untagged op is one kernel (a dot's bias add joins the dot, then closes it)
        close_self = c in (REDUCE, OPAQUE, CHEAP) or (c == DOT and epilogue == "none") or (eager and c != DOT)
        if c == DOT:
            gdot[g] = i
        dot_taken = False
        for r in cand:
            if tag:
                ok = gtag[r] == tag and gopen[r]
            elif c == OPAQUE or c == CHEAP or not gopen[r] or gtag[r]:
                ok = False
            elif c == DOT:
                ok = operand and gdot[r] < 0
            elif gdot[r] >= 0:
                ok = c == LOOP and not dot_taken and (
                    epilogue == "elementwise"
                    or ((epilogue == "bias_activation" or (epilogue == "bias" and e.prim == "add"))
                        and _asked(shaped, i) and _reads_only(e, r, gs, gid, prod, transparent)))
                dot_taken = dot_taken or ok
            else:
                ok = not eager
            if ok:
                gs.union(g, r)
            else:
                gopen[r] = False           # read from outside: closed
        if close_self and not tag:
            gopen[g] = False
        gid[i] = g
    return [gs.find(g) if g >= 0 else -1 for g in gid], gs, reads


def _asked(shaped: set[int], i: int) -> bool:
    shaped.add(i)
    return True


def _reads_and_sources(e, eqns, prod: dict[int, int], transparent: Sequence[bool], memo: dict[int, list],
                       gid: list[int], gs: _Groups) -> tuple[tuple, set[int]]:
    """:func:`_expanded_reads` of ``e`` (its own reads made here, a duplicated cheap op's expansion kept
    in ``memo``), and the groups (roots) of the equations that produce them, in the order read."""
    partial = -1
    if e.prim in _SLICING:
        o = e.outputs[0]
        partial = buffer_bytes(o.shape, o.dtype)
    parent, find, get = gs.parent, gs.find, prod.get
    rd: list = []
    cand = set()
    k = -1
    for a in e.inputs:
        k += 1
        if type(a) is not Var:
            continue
        p = get(a.id)
        if p is None:
            rd.append((a, partial if k == 0 else -1))
            continue
        if transparent[p]:
            x = memo.get(p)
            if x is None:
                x = memo[p] = list(_expanded_reads(eqns[p], eqns, prod, transparent, memo))
            for t in x:
                rd.append(t)
                q = get(t[0].id)
                if q is not None:
                    r = gid[q]
                    cand.add(r if parent[r] == r else find(r))
            continue
        rd.append((a, partial if k == 0 else -1))
        r = gid[p]
        cand.add(r if parent[r] == r else find(r))            # most groups are their own root
    return tuple(rd), cand


def _expanded_reads(e, eqns, prod: dict[int, int], transparent: Sequence[bool], memo: dict[int, list]) -> tuple:
    """The values an equation reads from memory: its Var operands, through duplicated cheap ops to their
    inputs (``memo``: each cheap op's expansion, computed once). Each as (var, bytes read or -1 for the
    whole buffer; slicing ops read what they keep of their first operand)."""
    partial = -1
    if e.prim in _SLICING:
        o = e.outputs[0]
        partial = buffer_bytes(o.shape, o.dtype)
    out: list = []
    get = prod.get
    for k, a in enumerate(e.inputs):
        if type(a) is not Var:
            continue
        p = get(a.id)
        if p is not None and transparent[p]:
            x = memo.get(p)
            if x is None:
                x = memo[p] = list(_expanded_reads(eqns[p], eqns, prod, transparent, memo))
            out.extend(x)
        else:
            out.append((a, partial if k == 0 else -1))
    return tuple(out)


def _reads_only(e, r: int, gs: _Groups, gid: list[int], prod: dict[int, int], transparent: Sequence[bool]) -> bool:
    """Does ``e`` read nothing full-size but group ``r``'s values? Literals, duplicated broadcasts and
    bias-sized values (no larger than one row of the output: scalars, a bias vector) aside."""
    out = e.outputs[0].shape
    row = out[-1] if out else 1
    for a in e.inputs:
        if type(a) is not Var or len(a.shape) == 0 or math.prod(a.shape) <= row:
            continue
        p = prod.get(a.id)
        if p is None or not (transparent[p] or gs.find(gid[p]) == r):
            return False
    return True


def fuse(program: Program, flops: np.ndarray, byts: np.ndarray, compiler: CompilerSpec,
         shared: Groupings | None = None) -> FusionPlan:
    """Group ``program``'s equations as ``compiler`` would and measure each group (``flops``, ``byts``: the
    unfused per-equation costs; an equation that cannot fuse keeps its own). Without loop fusion every
    equation is its own group at its own cost (the unfused roofline). ``shared``: groupings of programs
    of one structure (:class:`.fusion_plan.Groupings`), taken when they serve and given this one's."""
    eqns = program.eqns
    n = len(eqns)
    if not compiler.loop_fusion:
        return measure(program, flops, byts, [OPAQUE] * n, list(range(n)), [()] * n, [""] * n)
    hit = shared.find(program, compiler.variant) if shared is not None else None
    if hit is not None:
        cls, gid, tags, reads = hit
        return measure(program, flops, byts, cls, gid, reads, tags)
    eager = compiler.eager
    by_prim: dict[str, int] = {}               # fusion_class per primitive, asked once each
    cls = []
    for e in eqns:
        c = by_prim.get(e.prim)
        if c is None:
            c = by_prim[e.prim] = CHEAP if eager and e.prim in _VIEWS else fusion_class(e.prim)
        cls.append(c)
    tag_of: dict[str, str] = {}                 # hand_tag per Eqn.kernel tag (a few distinct ones)
    own = []
    for e in eqns:
        t = tag_of.get(e.kernel)
        if t is None:
            t = tag_of[e.kernel] = hand_tag(e.kernel, eager, compiler.hand_ops)
        own.append(t)
    # eager: a view is free whoever reads it (a GEMM takes a strided or transposed operand too)
    transparent = _transparent(program, cls, compiler.matmul_operand_fusion or eager, own)
    shaped: set[int] = set()
    gid, gs, reads = _group(program, cls, transparent, compiler, own, shaped)
    tags = [gs.tag[g] if g >= 0 else "" for g in gid]
    if shared is not None:
        shared.keep(program, compiler.variant, cls, gid, tags, reads, shaped)
    return measure(program, flops, byts, cls, gid, reads, tags)


__all__ = ["CHEAP", "DOT", "FLASH_KERNEL", "LOOP", "OP_PREFIX", "OPAQUE", "REDUCE", "FusionCache", "FusionPlan",
           "fuse", "fusion_class", "hand_tag"]
