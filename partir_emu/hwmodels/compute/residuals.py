"""What a software stack keeps between the forward and the backward pass: buffer lifetimes by policy.

The program a JAX training step lowers to holds every residual jax's autodiff saves: each
intermediate of an elementwise chain that the backward reads (GELU's ``x³`` and ``tanh``, a
LayerNorm's centred input in float32, an upcast copy of a bf16 tensor, ...). That is what runs
when XLA executes the program as written: policy ``"program"`` is the program-order liveness of
:func:`partir_emu.core.analysis.liveness` with every value in HBM (the convention the in-process
runtime measures on real arrays); policy ``"residuals"`` (what the hardware model prices for XLA)
has the same lifetimes, but the values a hand-fused kernel makes and only it reads (a flash
kernel's ``s × s`` scores and probabilities) stay in on-chip memory (:func:`on_chip`), as they
do in the kernel the tag stands for.

A stack of hand-written fused kernels does not keep them: PyTorch autograd saves the *inputs* of
each kernel and its backward kernel recomputes the elementwise intermediates from them (a fused
bias-GELU saves its input, a LayerNorm kernel its input and the per-row mean and rstd, a flash
kernel q, k, v, its output and the log-sum-exp); the activation memory of such a stack is
arXiv 2205.05198's ``34·s·b·h`` bytes per layer without recomputation. Policy
``"kernel_inputs"`` models that on the same program (hand kernels' values on chip as above):

- an elementwise or layout value (:func:`partir_emu.hwmodels.compute.fusion.fusion_class` LOOP or
  CHEAP) read after the elementwise region it was made in (a use past the next dot, reduction,
  collective or opaque op) only by elementwise ops and reductions (a backward kernel that can
  recompute it inline) is *recomputed* by those later readers from its **anchors**: the
  non-elementwise values (dot, reduction and opaque outputs, program inputs) its elementwise chain
  starts from. A value a GEMM or a hand-written kernel reads later is that kernel's input: kept;
- it is recomputed only if keeping its anchors that long costs no more than the value itself
  (anchors that are program inputs, or live then anyway, cost nothing): a bf16 upcast to float32
  is recomputed from the bf16 value; a value summed from many layers' outputs is kept;
- its own lifetime then ends at its last use inside its region, and its anchors live until the
  value's last use.

Only lifetimes change: FLOPs and the time of the recomputation are not added (an elementwise
recomputation fused into a backward kernel costs vector FLOPs next to the kernel's matmuls).
"""
from __future__ import annotations

from partir_emu.core.analysis import Liveness, liveness
from partir_emu.core.ir import Program, Var
from partir_emu.hwmodels.compute.costs import nbytes_of
from partir_emu.hwmodels.compute.fusion import CHEAP, LOOP, REDUCE, fusion_class, hand_tag
from partir_emu.hwmodels.compute.stack import POLICIES

MAX_ANCHORS = 8             # a chain that starts from more values than this is kept, not recomputed


def on_chip(program: Program, policy: str = "program") -> frozenset[int]:
    """The values that never reach HBM under ``policy``: those a hand-fused kernel (``Eqn.kernel``)
    makes and only the same kernel reads (a flash kernel's ``s × s`` scores live in on-chip
    memory). Under ``"program"`` (the runtime's convention) none."""
    if policy == "program":
        return frozenset()
    out: set[int] = set()
    readers: dict[int, set[str]] = {}
    # a framework op's tag (``op.``) says how an eager stack launches kernels, not what it keeps:
    # what it saves for the backward is the policy's (its internals are never lifetimes' business)
    tags = [hand_tag(e.kernel, False) for e in program.eqns]
    if not any(tags):                # no hand-fused kernel (most programs): nothing stays on chip
        return frozenset()
    for e, t in zip(program.eqns, tags):
        for a in e.inputs:
            if type(a) is Var:
                readers.setdefault(a.id, set()).add(t)
    outputs = {o.id for o in program.outputs if type(o) is Var}
    for e, t in zip(program.eqns, tags):
        if t:
            out.update(o.id for o in e.outputs if o.id not in outputs and readers.get(o.id) == {t})
    return frozenset(out)


def saved_liveness(program: Program, policy: str = "program") -> Liveness:
    """The buffer lifetimes of ``program`` when its stack keeps what ``policy`` says (module docstring)."""
    if policy in ("program", "residuals"):
        return liveness(program)
    if policy != "kernel_inputs":
        raise ValueError(f"unknown saved-activations policy {policy!r}; one of program, {', '.join(POLICIES)}")
    lv = liveness(program)
    eqns = program.eqns
    end = len(eqns)
    classes = [fusion_class(e.prim) for e in eqns]
    elementwise = [c in (CHEAP, LOOP) for c in classes]
    fusible = [c in (CHEAP, LOOP, REDUCE) and not hand_tag(e.kernel, False)        # can recompute inline
               for c, e in zip(classes, eqns)]
    producer: dict[int, int] = {}
    var: dict[int, Var] = {v.id: v for v in lv.initial}
    uses: dict[int, list[int]] = {}
    for i, e in enumerate(eqns):
        for a in e.inputs:
            if type(a) is Var:
                uses.setdefault(a.id, []).append(i)
        for o in e.outputs:
            producer[o.id] = i
            var[o.id] = o
    boundary = [end] * end            # boundary[i]: the first non-elementwise equation after i
    b = end
    for i in range(end - 1, -1, -1):
        boundary[i] = b
        if not elementwise[i]:
            b = i
    anchors_of: dict[int, frozenset[int] | None] = {}
    kept: set[int] = set()          # elementwise values stored for later readers: chains anchor on them

    def anchors(vid: int) -> frozenset[int] | None:
        # asked at the equation making vid: every producer of its chain has been decided by then
        if vid in anchors_of:
            return anchors_of[vid]
        out: set[int] = set()
        for a in eqns[producer[vid]].inputs:
            if type(a) is not Var:
                continue
            p = producer.get(a.id)
            sub = anchors(a.id) if p is not None and elementwise[p] and a.id not in kept else frozenset((a.id,))
            if sub is None or len(out | sub) > MAX_ANCHORS:
                anchors_of[vid] = None
                return None
            out |= sub
        anchors_of[vid] = frozenset(out)
        return anchors_of[vid]

    last = dict(lv.last_use)
    initial = {v.id for v in lv.initial}
    for i, e in enumerate(eqns):
        if not elementwise[i]:
            continue
        for o in e.outputs:
            t = last.get(o.id)
            if t is None or t == end or t < boundary[i]:
                continue                          # unread, a program output, or read only in its region
            if not all(fusible[j] for j in uses[o.id] if j >= boundary[i]):
                kept.add(o.id)                    # a GEMM or a hand kernel reads it later: it is that kernel's input
                continue
            anc = anchors(o.id)
            # what keeping the anchors until t costs beyond what is live then anyway (inputs, and
            # anchors read at t or later for themselves)
            if anc is None or sum(nbytes_of(var[x]) for x in anc
                                  if x not in initial and last.get(x, -1) < t) > nbytes_of(o):
                kept.add(o.id)
                continue
            for x in anc:
                last[x] = max(last.get(x, t), t)
            last[o.id] = max([j for j in uses[o.id] if j < boundary[i]], default=i)
    return _released(lv, last, var, eqns, end)


def _released(lv: Liveness, last: dict[int, int], var: dict[int, Var], eqns, end: int) -> Liveness:
    """A :class:`Liveness` for the last uses ``last`` (outputs never read go right after their equation)."""
    after: list[list[Var]] = [[] for _ in range(end)]
    for vid, i in last.items():
        if i != end and i >= 0:
            after[i].append(var[vid])
    for i, e in enumerate(eqns):
        for o in e.outputs:
            if o.id not in last:
                after[i].append(o)
    # an input whose only reads were moved stays as it was: at_start is the never-read inputs
    return Liveness(lv.initial, last, lv.at_start, tuple(tuple(a) for a in after))
