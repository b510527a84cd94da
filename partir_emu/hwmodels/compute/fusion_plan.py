"""A fusion grouping measured: the :class:`FusionPlan` of one program under one compiler variant
(:func:`measure`: each group's HBM bytes across its boundary, its FLOPs, its dots), the hardware
independent arrays :mod:`.kernel_times` prices. The grouping itself is :mod:`.fusion`'s; a grouping is
shared by the programs of one structure (:class:`Groupings`, below), each measured on its own.

The GEMM shape of a matmul-kind equation, and what a flash-attention kernel's dots say about it:

- :func:`dot_dims`: ``(batch, M, N, K)`` of a ``dot_general`` (its batch, free and contracting
  dimensions) or of a convolution's implicit GEMM;
- :func:`score_len` / :func:`head_width`: the score length ``s`` and head width ``d`` of a dot inside
  a flash-attention kernel (``q·kᵀ`` is s×d·d×s, ``p·v`` s×s·s×d; the backward's likewise), which the
  measured attention-kernel rates are looked up by (:mod:`.attention_kernels`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from partir_emu.core.ir import Program, Var
from partir_emu.hwmodels.compute.costs import op_kind
from partir_emu.hwmodels.machine.specs import FP8_DTYPES, MATMUL_16BIT_DTYPES
from partir_emu.primitives.conv import conv_gemm_dims
from partir_emu.primitives.costs import buffer_bytes

CHEAP, LOOP, REDUCE, DOT, OPAQUE = range(5)          # what a primitive can do in a fusion (fusion_class)
FLASH_KERNEL = "flash_attention"        # the Eqn.kernel tag of a flash-attention core (its backward: ".../bwd")


def score_len(m: float, n: float, k: float) -> float:
    """The score length of a flash-attention dot: the dimension it has twice (``q·kᵀ``: M = N = s;
    ``p·v`` and the backward's: one of M, N and K is the head width, the other two are s)."""
    return m if m in (n, k) else n if n == k else max(m, n, k)


def head_width(m: float, n: float, k: float, s: int) -> float:
    """The head width of a flash-attention dot with score length ``s``: its dimension other than s
    (``q·kᵀ``: K; ``p·v``: N); s itself when every dimension is s."""
    others = [d for d in (m, n, k) if d != s]
    return min(others) if others else s


def dot_dims(e) -> tuple[int, int, int, int]:
    if e.prim == "conv_general_dilated":   # the other matmul-kind primitive: its implicit GEMM
        return conv_gemm_dims(e)
    lhs, rhs = e.inputs[0], e.inputs[1]
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    prod = math.prod                 # exact on ints (dims are ints)
    b = int(prod([lhs.shape[i] for i in lb]))
    k = int(prod([lhs.shape[i] for i in lc]))
    m = int(prod([s for i, s in enumerate(lhs.shape) if i not in lc and i not in lb]))
    nn = int(prod([s for i, s in enumerate(rhs.shape) if i not in rc and i not in rb]))
    return b, m, nn, k


@dataclass(frozen=True)
class FusionPlan:
    """The groups of one program under one compiler variant (hardware independent arrays)."""

    group_of: np.ndarray       # per equation: its group, -1 for a duplicated cheap op
    last: np.ndarray           # per group: its last equation (where its time lands)
    rep: np.ndarray            # per group: the equation its time is reported under (its dominant kind)
    members: np.ndarray        # per group: number of equations
    bytes: np.ndarray          # per group: HBM bytes across its boundary
    vec_flops: np.ndarray      # per group: FLOPs on the vector units
    work: np.ndarray           # per group: does it launch a kernel (moves bytes or computes)?
    hand_kernels: int          # groups formed by an Eqn.kernel tag
    dot_group: np.ndarray      # per dot: its group
    dot_flops: np.ndarray
    dot_f32: np.ndarray        # per dot: priced at the f32 matrix rate (else the 16-bit one)
    dot_fp8: np.ndarray        # per dot: both operands FP8, priced at the FP8 rate (HardwareSpec.fp8_matmul_rate)
    dot_dims: np.ndarray       # per dot: (batch, M, N, K), shape (dots, 4)
    causal_seq: np.ndarray     # per group: the score length s of a hand-fused flash-attention kernel, else 0
    flash_head_dim: np.ndarray  # per group: the head width d of that kernel's dots (s×d operands), else 0

    @property
    def num_groups(self) -> int:
        return len(self.last)

    def summary(self, unfused_bytes: float) -> dict[str, float]:
        """What the report prints: kernels launched, fused groups, hand kernels, bytes saved."""
        fused = float(self.bytes.sum())
        return {"kernels": int(self.work.sum()), "fused_groups": int((self.members > 1).sum()),
                "hand_kernels": self.hand_kernels, "unfused_bytes": float(unfused_bytes), "fused_bytes": fused,
                "bytes_saved": float(unfused_bytes) - fused}


def measure(program: Program, flops: np.ndarray, byts: np.ndarray, cls: Sequence[int], gid: Sequence[int],
             reads: Sequence[tuple], tags: Sequence[str]) -> FusionPlan:
    """Dense group numbers, boundary bytes, FLOPs and the dots of a grouping."""
    eqns = program.eqns
    n = len(eqns)
    dense: dict[int, int] = {}
    group_of = np.array([dense.setdefault(g, len(dense)) if g >= 0 else -1 for g in gid], dtype=np.int64)
    G = len(dense)
    gl = group_of.tolist()
    prod_group: dict[int, int] = {}
    for i, e in enumerate(eqns):
        for o in e.outputs:
            prod_group[o.id] = gl[i]
    opaque = [False] * G
    for i in range(n):
        if gl[i] >= 0 and cls[i] == OPAQUE:
            opaque[gl[i]] = True                 # its own cost rule (in-place updates, sort, collectives)
    ext: dict[int, dict[int, float]] = {}        # group -> var id -> bytes read from outside
    written: dict[int, tuple[int, float]] = {}   # var id -> (producer group, bytes)
    size: dict[int, int] = {}                    # var id -> bytes of its buffer
    group_of_var, size_get = prod_group.get, size.get
    for i in range(n):
        g = gl[i]
        if g < 0:
            continue
        outside = ext.get(g)
        if outside is None:
            outside = ext[g] = {}
        for v, amount in reads[i] or _plain_reads(eqns[i]):
            vid = v.id
            pg = group_of_var(vid, -1)
            if pg == g:
                continue
            full = size_get(vid)
            if full is None:
                full = size[vid] = buffer_bytes(v.shape, v.dtype)
            if pg >= 0:
                written[vid] = (pg, full)
            prev = outside.get(vid, 0.0)
            outside[vid] = full if amount < 0 or prev >= full else min(full, prev + amount)
    for out in program.outputs:                  # a Var or a Literal (never written by a group)
        if type(out) is Var and prod_group.get(out.id, -1) >= 0:
            written[out.id] = (prod_group[out.id], buffer_bytes(out.shape, out.dtype))
    gbytes = np.zeros(G)
    for g, outside in ext.items():               # (a group's reads summed in the order they were made)
        if not opaque[g]:
            for b in outside.values():
                gbytes[g] += b
    for pg, b in written.values():
        if not opaque[pg]:
            gbytes[pg] += b
    ga = group_of[group_of >= 0]
    fl = flops[group_of >= 0]
    for i in range(n):
        if gl[i] >= 0 and opaque[gl[i]]:
            gbytes[gl[i]] += byts[i]
    return _plan(program, group_of, ga, fl, gbytes, cls, tags)


def _plain_reads(e) -> tuple:
    return tuple((a, -1) for a in e.inputs if type(a) is Var)


def _plan(program: Program, group_of: np.ndarray, ga: np.ndarray, fl: np.ndarray, gbytes: np.ndarray,
          cls: Sequence[int], tags: Sequence[str]) -> FusionPlan:
    eqns = program.eqns
    G = len(gbytes)
    idx = np.flatnonzero(group_of >= 0)
    last = np.zeros(G, dtype=np.int64)
    last[ga] = idx                                 # ascending idx: the last write wins
    members = np.bincount(ga, minlength=G)
    kinds = [op_kind.get(eqns[i].prim, "") for i in idx.tolist()]
    is_dot = np.array([k == "matmul" for k in kinds], dtype=bool)
    vec_flops = np.bincount(ga[~is_dot], weights=fl[~is_dot], minlength=G)
    # the equation a group's time is reported under: its dot, else its last reduction, else its last
    # elementwise op, else its last equation (by_op_kind attributes a group to its dominant kind)
    prio = {"matmul": 3, "reduction": 2, "elementwise": 1}
    best = [-1] * G
    rep = last.copy()
    for i, g, k in zip(idx.tolist(), ga.tolist(), kinds):
        p = prio.get(k, 0)
        if p and p >= best[g] and not (p == 3 and best[g] == 3):
            best[g] = p
            rep[g] = i
    dots = idx[is_dot].tolist()
    dims = np.array([dot_dims(eqns[i]) for i in dots], dtype=np.float64).reshape(-1, 4)
    fp8 = np.array([eqns[i].inputs[0].dtype in FP8_DTYPES and eqns[i].inputs[1].dtype in FP8_DTYPES for i in dots],
                   dtype=bool)
    narrow = MATMUL_16BIT_DTYPES | FP8_DTYPES       # (an FP8 x bf16 product runs at the bf16 rate)
    f32 = np.array([eqns[i].inputs[0].dtype not in narrow for i in dots], dtype=bool)
    dot_flops = fl[is_dot]
    work = (gbytes > 0) | (np.bincount(ga, weights=fl, minlength=G) > 0)
    hand = len({g for g, i in zip(ga.tolist(), idx.tolist()) if tags[i]})
    causal = np.zeros(G, dtype=np.int64)
    head = np.zeros(G, dtype=np.int64)
    for i, g, row in zip(dots, ga[is_dot].tolist(), dims.tolist()):
        if tags[i].split("/", 1)[0] == FLASH_KERNEL:
            s = int(score_len(row[1], row[2], row[3]))
            causal[g] = max(causal[g], s)
            head[g] = max(head[g], int(head_width(row[1], row[2], row[3], s)))
    return FusionPlan(group_of, last, rep, members, gbytes, vec_flops, work, hand,
                      ga[is_dot], dot_flops, f32, fp8.reshape(-1), dims, causal, head)


# -- groupings shared by programs of one structure --------------------------------------------------
# Fusion groupings shared by programs of one structure: what a study's meshes of one strategy have.
#
# The grouping of :func:`.fusion.fuse` (which equations make one kernel) reads of a program its
# structure only: each equation's primitive, ``Eqn.kernel`` tag and number of outputs, where each
# operand comes from (which output of which equation, which program input or constant, or a literal)
# and the program's outputs; and, where a matmul epilogue may take an elementwise consumer, whether
# the consumer's operands are bias-sized (:func:`.fusion._reads_only`, the one question about
# shapes). A model lowered with one strategy on meshes of other sizes (``partir-emu study --mesh
# auto``: ``batch=128,model=2`` .. ``batch=8,model=32``) gives programs of one structure and other
# shapes. :class:`Groupings` keeps the grouping of each (structure, compiler variant) made so far;
# a program of that structure takes it when its answers to the bias-size questions the grouping
# asked are the same (checked), and only the measuring (bytes, FLOPs, dots: shapes) is done for it.
# The plan is the one the program's own grouping gives (``tests/integration/test_fusion_share.py``).

_MAX_ENTRIES = 16           # (structure, variant) groupings kept; then afresh
_MAX_PROGRAMS = 8           # programs whose structure is kept (each kept alive with it); then afresh


def bias_sized(e) -> tuple[bool, ...]:
    """Per operand of ``e``: does :func:`.fusion._reads_only` let it pass as bias-sized (a literal, a
    scalar, or no larger than one row of ``e``'s output)?"""
    out = e.outputs[0].shape
    row = out[-1] if out else 1
    return tuple(type(a) is not Var or len(a.shape) == 0 or math.prod(a.shape) <= row for a in e.inputs)


@dataclass(frozen=True)
class Grouping:
    """One grouping as another program of the structure can take it."""

    cls: list[int]
    gid: list[int]
    tags: list[str]
    reads: list[tuple]                      # per equation: (operand slot, reads a slice?) of each value read
    shaped: dict[int, tuple[bool, ...]]     # equations whose bias-size question was asked: the answers


class Groupings:
    """The groupings kept, by compiler variant and program structure (module docstring); one per
    :class:`~partir_emu.hwmodels.analytical.Analyzer`, given to the fusion caches of its programs."""

    def __init__(self) -> None:
        self._by: dict[tuple, tuple[tuple, Grouping]] = {}
        # per program (by identity, kept alive here) its structure: each compiler variant asks, and a
        # study walks its programs once per chip
        self._structures: dict[int, tuple[Program, tuple | None, int, dict[int, tuple]]] = {}

    def clear(self) -> None:
        self._by.clear()
        self._structures.clear()

    def _structure(self, program: Program) -> tuple[tuple | None, int, dict[int, tuple]]:
        """(the structure, its hash, each value's slot by Var id); the structure is None when a value has
        no slot. Kept for the last :data:`_MAX_PROGRAMS` programs."""
        hit = self._structures.get(id(program))
        if hit is not None and hit[0] is program:
            return hit[1], hit[2], hit[3]
        slot: dict[int, tuple] = {v.id: ("in", m) for m, v in enumerate(program.inputs)}
        slot.update((v.id, ("const", m)) for m, (v, _) in enumerate(program.consts))
        sig: list[tuple] = []
        key: tuple | None = None
        try:
            for j, e in enumerate(program.eqns):
                sig.append((e.prim, e.kernel, len(e.outputs),
                            tuple(slot[a.id] if type(a) is Var else None for a in e.inputs)))
                for s, o in enumerate(e.outputs):
                    slot[o.id] = (j, s)
            key = (tuple(sig), tuple(slot[o.id] if type(o) is Var else None for o in program.outputs))
        except KeyError:                     # an operand defined nowhere: no structure to share
            key = None
        h = hash(key)
        if len(self._structures) >= _MAX_PROGRAMS:
            self._structures.clear()
        self._structures[id(program)] = (program, key, h, slot)
        return key, h, slot

    def find(self, program: Program, variant: tuple) -> tuple[list[int], list[int], list[str], list[tuple]] | None:
        """``(cls, gid, tags, reads)`` of ``program`` from a kept grouping of its structure, or None."""
        key, h, slot = self._structure(program)
        hit = self._by.get((variant, h)) if key is not None else None
        if hit is None or hit[0] != key:
            return None
        g = hit[1]
        eqns = program.eqns
        if any(bias_sized(eqns[i]) != answers for i, answers in g.shaped.items()):
            return None
        return g.cls, g.gid, g.tags, _reads_of(program, g.reads)

    def keep(self, program: Program, variant: tuple, cls: list[int], gid: list[int], tags: list[str],
             reads: list[tuple], shaped: set[int]) -> None:
        """Keep ``program``'s grouping (``shaped``: the equations whose bias-size question it asked)."""
        key, h, slot = self._structure(program)
        if key is None:
            return
        if len(self._by) >= _MAX_ENTRIES:
            self._by.clear()
        eqns = program.eqns
        out = [tuple((slot[v.id], amount != -1) for v, amount in rd) if rd else () for rd in reads]
        self._by[(variant, h)] = (key, Grouping(cls, gid, tags, out, {i: bias_sized(eqns[i]) for i in shaped}))


def _reads_of(program: Program, reads: list[tuple]) -> list[tuple]:
    """A kept grouping's reads as ``program``'s values: (Var, bytes of the slice read, or -1: whole)."""
    eqns, inputs, consts = program.eqns, program.inputs, program.consts
    out: list[tuple] = []
    for i, rd in enumerate(reads):
        if not rd:
            out.append(())
            continue
        row = []
        for s, part in rd:
            a, b = s
            v = eqns[a].outputs[b] if type(a) is int else inputs[b] if a == "in" else consts[b][0]
            if part:
                o = eqns[i].outputs[0]
                row.append((v, buffer_bytes(o.shape, o.dtype)))
            else:
                row.append((v, -1))
        out.append(tuple(row))
    return out
