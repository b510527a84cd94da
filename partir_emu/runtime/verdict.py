"""Is a partitioned run correct? A verdict a numerics expert would accept, on any correct BLAS.

A partitioned program sums in a different order than the unpartitioned one, so its float
results differ by rounding; an optimizer such as Adam (``m / sqrt(v)`` ≈ ``sign(g)`` for tiny
gradients) can amplify those differences element by element, and which elements it amplifies
depends on the summation order (so on the GEMM kernel: OpenBLAS's Haswell, SkylakeX and
Prescott kernels each give other elements). A fixed tolerance, or a bound of "k times
``jax.jit``'s own error", then calls correct runs wrong on some machine: ``jax.jit`` is one other
order, and whether it happened to flip the element we flipped is chance. So the verdict asks
instead whether our error is one that correct runs reach, element by element:

- the **reference** is the unpartitioned step computed in float64 (``ref64``) from the same
  inputs; the **correct runs** are ``jax.jit`` in the program's own precision and the
  unpartitioned program run in :func:`partir_emu.runtime.rounding.other_orders`: every sum's
  rounding drawn anew at α = 32 times the statistical size a sum of its terms can have in any
  order, in antithetic pairs (that module's docstring derives the size);
- per float output, element ``i``: ``reach_i = max over the correct runs |run_i − ref64_i|``, how
  far rounding alone moves it; our ``excess_i = max(|ours_i − ref64_i| − reach_i, 0)``, the part
  of our error that no correct run explains;
- the output passes if ``‖excess‖ ≤ allowance = c · u · sqrt(K) · ‖ref64‖ + ‖reach‖ / α``
  (Euclidean norms over the tensor; ``u`` the unit roundoff of the output's dtype, 2⁻²⁴ for
  float32; ``K`` the longest reduction in the program; ``c = 8``; α = 1 when jax.jit is the only
  correct run): a few elements where our rounding went further than every correct run are
  allowed for, a systematic error is not;
- integer and bool outputs must equal the baseline exactly; non-finite values must sit where
  the reference has them.

**Near zero: the absolute terms.** ``c · u · sqrt(K) · ‖ref64‖`` is the part of the error that
scales with the output. It says nothing useful about an output whose exact value is below the
rounding of the terms it is computed from: a gradient that is zero in exact arithmetic (a key
bias: softmax ignores a constant added to a query's scores), Adam's moments of it, the embedding
row of a token no batch holds after weight decay. float64 gives ~1e-23 for such an element, every
float32 run ~1e-14 (measured, HF BERT's key bias: ``mu`` 7e-14 against 5e-23), so ``‖ref64‖``
is noise, an allowance relative to it is zero, and one element where our rounding goes past
every correct run fails the output (an output can be *all* rounding). The error of such a value
is only meaningful relative to the rounding of its terms, which the correct runs measure:
``‖reach‖ / α`` is one correct order's rounding, normwise (the other orders inject α times the
statistical size), and our excess beyond every run may be as large. For an output that is not
noise it adds what correct orders differ by, ~1e-6 of ``‖ref64‖`` (and, where Adam flipped
elements in the runs, ``1/α`` of their flips' norm: about ``n_flips / α²`` more flips); a wrong
partitioning is off by a fraction of ``‖ref64‖`` itself.

The same holds at the bottom of the float range. The standard model of arithmetic has an
absolute term there, ``fl(x op y) = (x op y)(1 + δ) + η`` with ``|η| ≤ λ``, the dtype's smallest
normal number, when results below it are flushed to zero (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., §2.1; ``|η| ≤ u·λ`` with gradual underflow), and correct runs
differ exactly there: XLA on CPU flushes subnormal results to zero, numpy keeps them, float64
holds them as ordinary numbers (Adam's second moment of a noise gradient, ``(1 − β₂)·g²``, is
~1e-45: 0 in jax.jit, a subnormal in our run). So every element's reach is at least
``UNDERFLOW_C · λ`` (the flushes of the few operations that chain into it; 9e-38 in float32,
untouched by anything above). The report's relative figures are taken against
``max(‖ref64‖, ‖reach‖)``: relative to the output, or to rounding where the output is rounding
(before, BERT's key-bias moments printed relative errors of 1e8 to 1e17).

A wrong partitioning (a missing all_reduce, a max for a sum, a block in the wrong place, a wrong
halo) is off by a fraction of the output's own norm on whole blocks of elements, where correct
runs reach 1e-6 of it: orders of magnitude above the allowance (tests check that it still fails by
far). The per-element reach is what makes Adam's amplification harmless: an element within
rounding of a flip is flipped, one way or the other, by the antithetic runs.

**Low precision (bfloat16).** ``u_low`` is the unit roundoff of the lowest-precision float the
program computes in (:func:`compute_precision` scans every equation's dtypes), not the output's:
a mixed-precision step has bfloat16 matmuls and activations but float32 outputs (loss, master
weights, Adam state), and a float32 allowance would fail correct runs. For such a program

- the reference must not be the program itself run with x64: its casts to bfloat16 still round
  under x64, so that "reference" repeats jax.jit's bfloat16 roundings and ``‖jit − ref64‖`` came
  out at 3e-8 on a bf16 MLP step while the step's real bfloat16 noise is ~1e-2. The app layer
  (:meth:`partir_emu.app.experiment.Experiment.high_precision_step`) runs the same step without
  the casts (``precision=f32``) in float64 instead; then ``‖jit − ref64‖`` is the bfloat16 error
  jax.jit itself makes (measured: 0.8–1.8e-2 on the MLP step, up to 0.35 on the tiny transformer);
- the allowance is ``c · max(u·sqrt(K), u_low) · ‖ref64‖`` plus the largest normwise error of a
  correct run: a value within a sum's rounding of a bfloat16 rounding boundary rounds one way or
  the other, in every run at other elements (the per-element reach covers few of ours), and XLA
  fuses elementwise chains and keeps some bfloat16 intermediates in float32, so its roundings are
  not ours either; products and jnp sums of bfloat16 accumulate in float32, so ``u_low`` enters
  without ``sqrt(K)``;
- the ``ceil(n · u_low)`` largest elements of the excess are left out (one element in 256 for
  bfloat16, at least one, never more than an eighth of the output: a loss or a small bias is
  checked whole): Adam turns a gradient element within bfloat16 rounding of zero into a full
  ``±lr`` step, and on small tensors one such flip is a large part of the norm (measured: one
  flipped element of a 16-element zero-initialised bias of the tiny transformer, normwise error
  0.5, while its gradient agreed with float64 to 1.7e-2 like jax.jit's).

The left-out elements are counted among those rounding moves (some correct run differs from
``ref64`` there), not the whole output: an FP8 amax history has one new entry in front of copies
every run makes exactly, and ``ceil(1024/256)`` trimmed elements hid a wrong amax.

**FP8.** A quantisation ``clip(v·s, ±max).astype(float8)`` (:mod:`scenarios.fp8`) is a rounding the
step is defined by: its scale is an input (delayed scaling), XLA and ml_dtypes round it alike, and
the reference keeps it (an fp8 step is its own reference, run under x64: the quantisers and the
bfloat16 casts around them round, the dots accumulate and the bookkeeping computes in float64). The
FP8 values are then read by dots that accumulate wider (products of FP8 numbers are exact in
float32), so FP8 is not a precision the program computes in: :func:`compute_precision` counts an
FP8 dtype only where an equation computes its result in it (not a conversion, a copy or a max),
and the program is judged by its other floats (bfloat16: the low-precision rules above). What
differs between correct runs is where a sum's rounding moves a value across a quantisation
boundary: one FP8 step at that element (2⁻³–2⁻² relative), at other elements in every run, which
the per-element reach and the whole-run term cover as for bfloat16. A reference without the
bfloat16 casts quantises other values than every bf16 run at many elements: jax.jit's Adam moments
were 8–16 % (median over outputs, 3 seeds) from it, against 6–7 % from the step itself, and a
gradient amax taken as a sum over 2 devices passed.

Strict mode (:func:`judge_strict`) is for the step stopped before the optimizer (loss and
gradients, where nothing amplifies rounding): every element within ``rtol=1e-5, atol=1e-6`` of
``jax.jit``'s, as ``numpy.allclose``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from partir_emu.core.ir import Eqn, Program
from partir_emu.core.loops import LOOP, walk
from partir_emu.errors import EmulationError
from partir_emu.primitives import get
from partir_emu.runtime.rounding import ALPHA

ALLOWANCE_C = 8.0      # constant of the reduction-length allowance
STRICT_RTOL, STRICT_ATOL = 1e-5, 1e-6
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8,
                 "float8_e4m3fn": 2.0 ** -4, "float8_e5m2": 2.0 ** -3}
# the smallest normal number λ of each float dtype (bfloat16 has float32's exponent range)
SMALLEST_NORMAL = {"float64": 2.0 ** -1022, "float32": 2.0 ** -126, "float16": 2.0 ** -14, "bfloat16": 2.0 ** -126,
                   "float8_e4m3fn": 2.0 ** -6, "float8_e5m2": 2.0 ** -14}
# FP8 formats: a program that only quantises to them (module docstring, "FP8") does not compute in them
QUANTISED = frozenset(n for n in UNIT_ROUNDOFF if n.startswith("float8"))
_EXACT_COLLECTIVE_OPS = ("max", "min")      # an all_reduce / reduce_scatter that selects, never rounds
UNDERFLOW_C = 8.0      # an element's reach is at least UNDERFLOW_C·λ (module docstring, "Underflow")


@dataclass(frozen=True)
class References:
    """What a run is judged against, all in the program's output order: ``jit``, the unpartitioned
    ``jax.jit`` in the program's precision; ``ref64``, the same step in float64; ``others``, the
    unpartitioned program in other summation orders (:func:`partir_emu.runtime.rounding.other_orders`)."""

    jit: list[np.ndarray]
    ref64: list[np.ndarray]
    others: tuple[list[np.ndarray], ...] = ()


@dataclass(frozen=True)
class OutputCheck:
    """One output against the float64 reference (norms relative to ``‖ref64‖``)."""

    name: str
    ok: bool
    err: float            # ‖ours − ref64‖
    baseline_err: float   # ‖jit − ref64‖
    reach: float          # ‖reach‖: how far the correct runs are from ref64, element by element
    excess: float         # ‖max(|ours − ref64| − reach, 0)‖: our error that no correct run explains
    bound: float          # the allowance on the excess
    max_abs_err: float    # max |ours − ref64|
    worst_index: tuple[int, ...]
    ours_at_worst: float
    ref_at_worst: float

    def to_json(self) -> dict:
        return {"name": self.name, "ok": self.ok, "err": self.err, "baseline_err": self.baseline_err,
                "reach": self.reach, "excess": self.excess, "bound": self.bound, "max_abs_err": self.max_abs_err,
                "worst_index": list(self.worst_index), "ours_at_worst": self.ours_at_worst,
                "ref_at_worst": self.ref_at_worst}

    @property
    def over(self) -> float:
        """``excess / bound``: above 1 the output fails."""
        if self.bound > 0:
            return self.excess / self.bound
        return math.inf if self.excess > 0 else 0.0


@dataclass(frozen=True)
class Verdict:
    verified: bool
    outputs: tuple[OutputCheck, ...]
    reduction_length: int
    criterion: str = "elementwise reach of correct runs vs float64, normwise allowance"
    # what the float64 reference computed in: "float64", or where the step narrowed floats under x64
    # (a module's dtype, an explicit cast), e.g. "float32 in 669 of 1651 equations"
    reference: str = "float64"

    @property
    def worst(self) -> OutputCheck | None:
        """The failing output furthest over its bound, else the one closest to it."""
        if not self.outputs:
            return None
        return max(self.outputs, key=lambda c: (not c.ok, c.over))

    @property
    def max_abs_err(self) -> float:
        return max((c.max_abs_err for c in self.outputs), default=0.0)

    @property
    def max_err(self) -> float:
        return max((c.err for c in self.outputs), default=0.0)

    @property
    def max_baseline_err(self) -> float:
        return max((c.baseline_err for c in self.outputs), default=0.0)

    def to_json(self) -> dict:
        w = self.worst
        return {"verified": self.verified, "criterion": self.criterion, "reference": self.reference,
                "max_err": self.max_err, "max_baseline_err": self.max_baseline_err,
                "max_abs_err": self.max_abs_err, "reduction_length": self.reduction_length,
                "worst_output": w.name if w else "", "worst": w.to_json() if w else None,
                "outputs": [c.to_json() for c in self.outputs]}

    def summary(self) -> str:
        w = self.worst
        if w is None:
            return "verified: yes (no outputs)"
        head = "verified: yes" if self.verified else "verified: NO"
        if self.reference != "float64":     # the reference is only as exact as the narrowest float it used
            head += f" (the float64 reference computed in {self.reference}: the step narrows floats under x64)"
        return (f"{head}  worst output {w.name!r}: error {w.err:.2e} vs float64 (jax.jit's own {w.baseline_err:.2e}, "
                f"correct runs reach {w.reach:.2e}); beyond their reach {w.excess:.2e}, allowed {w.bound:.2e}; "
                f"worst element {list(w.worst_index)}: {w.ours_at_worst!r} vs {w.ref_at_worst!r}")


def reduction_length(program: Program) -> int:
    """The longest sum the program computes: contraction sizes of dot_general and of convolutions
    (kernel window × input features), reduced sizes of reduce_sum, the length of cumulative sums
    and the trip count of loops (a carry may accumulate over the iterations), loop bodies
    included (1 if there is none)."""
    longest = 1
    for e, _ in walk(program):
        if e.prim == LOOP:
            n = int(e.params["length"])
        elif e.prim == "conv_general_dilated":
            rhs = e.inputs[1].shape
            n = math.prod(rhs) // rhs[e.params["dimension_numbers"]["rhs_spec"][0]]
        elif e.prim == "dot_general":
            (lc, _), _ = e.params["dimension_numbers"]
            n = math.prod(e.inputs[0].shape[i] for i in lc)
        elif e.prim == "reduce_sum":
            n = math.prod(e.inputs[0].shape[i] for i in e.params["axes"])
        elif e.prim == "cumsum":
            n = e.inputs[0].shape[e.params["axis"]]
        else:
            continue
        longest = max(longest, n)
    return longest


def compute_precision(program: Program) -> str:
    """The lowest-precision float dtype the program computes in (inputs, constants and every
    equation's operands and results), ``"float32"`` if it has no float at all. An FP8 dtype counts
    only where an equation computes its result in it (module docstring, "FP8"): not the result of a
    conversion (a quantisation), of data movement, or of a max; FP8 operands of a ``dot_general`` that
    accumulates in a wider type are read, not computed in."""
    names = {v.dtype for v in program.inputs if v.dtype not in QUANTISED}
    for e, _ in walk(program):
        names.update(a.dtype for a in e.inputs if hasattr(a, "dtype") and a.dtype not in QUANTISED)
        for v in e.outputs:
            if v.dtype not in QUANTISED or _computes_in(e):
                names.add(v.dtype)
    floats = [n for n in names if n in UNIT_ROUNDOFF]
    return max(floats, key=UNIT_ROUNDOFF.__getitem__, default="float32")


def _computes_in(e: Eqn) -> bool:
    """Whether ``e``'s results are rounded arithmetic in their own dtype (not a conversion, not a copy,
    not a selection)."""
    if e.prim == "convert_element_type":
        return False
    entry = get(e.prim)
    if entry is None:
        return True
    if entry.communicates:
        return e.prim in ("all_reduce", "reduce_scatter") and e.params.get("op", "sum") not in _EXACT_COLLECTIVE_OPS
    return entry.kind not in ("memory", "free")


def judge(ours: Sequence[np.ndarray], baseline: Sequence[np.ndarray], ref64: Sequence[np.ndarray],
          names: Sequence[str], reduction_len: int, *, others: Sequence[Sequence[np.ndarray]] = (),
          allowance_c: float = ALLOWANCE_C, precision: str | None = None) -> Verdict:
    """The verdict on ``ours`` given the same outputs from ``jax.jit`` (``baseline``), from the
    float64 reference (``ref64``) and from the correct runs in other orders (``others``, each a list
    of outputs; without them the reach is jax.jit's alone, one other order), all in the program's
    output order. ``precision``: the program's lowest compute precision (:func:`compute_precision`);
    ``u`` is the larger of its unit roundoff and the output's."""
    if not len(ours) == len(baseline) == len(ref64) == len(names) or any(len(o) != len(ours) for o in others):
        raise EmulationError(f"verdict: {len(ours)} outputs, {len(baseline)} baseline, {len(ref64)} reference, "
                             f"{[len(o) for o in others]} in other orders, {len(names)} names: the runs disagree "
                             f"on the program's outputs")
    u_low = UNIT_ROUNDOFF.get(precision or "float64", 2.0 ** -24)
    checks = tuple(_check(np.asarray(o), np.asarray(b), np.asarray(r), [np.asarray(x[j]) for x in others], n,
                          reduction_len, allowance_c, u_low)
                   for j, (o, b, r, n) in enumerate(zip(ours, baseline, ref64, names)))
    return Verdict(all(c.ok for c in checks), checks, reduction_len)


def judge_references(ours: Sequence[np.ndarray], refs: References, names: Sequence[str], reduction_len: int, *,
                     precision: str | None = None) -> Verdict:
    """:func:`judge` against a :class:`References` record."""
    return judge(ours, refs.jit, refs.ref64, names, reduction_len, others=refs.others, precision=precision)


def _check(ours: np.ndarray, base: np.ndarray, ref: np.ndarray, others: list[np.ndarray], name: str, k: int,
           c: float, u_low: float) -> OutputCheck:
    if ours.shape != ref.shape or base.shape != ref.shape or any(x.shape != ref.shape for x in others):
        raise EmulationError(f"output {name!r}: shape {list(ours.shape)}, jax.jit {list(base.shape)}, "
                             f"reference {list(ref.shape)}, other orders {[list(x.shape) for x in others]}")
    if ours.dtype.kind in "biu" or ours.size == 0:
        return _exact(ours, base, name)
    r = np.asarray(ref, dtype=np.float64)
    finite = np.isfinite(r)
    r = np.where(finite, r, 0.0)

    def dev(x: np.ndarray) -> np.ndarray:      # |x − ref64| where the reference is finite
        return np.abs(np.where(finite, np.asarray(x, np.float64), 0.0) - r)

    o = np.asarray(ours, np.float64)
    same_nonfinite = bool(np.array_equal(o[~finite], np.asarray(ref, np.float64)[~finite], equal_nan=True))
    diff = dev(ours)
    # a run that overflowed or made a NaN where float64 is finite says nothing about that element
    runs = [np.nan_to_num(dev(x), nan=0.0, posinf=0.0) for x in (base, *others)]
    u = UNIT_ROUNDOFF.get(ours.dtype.name, 2.0 ** -24)
    floor = UNDERFLOW_C * SMALLEST_NORMAL.get(ours.dtype.name, 2.0 ** -126)    # flushes to zero (docstring)
    reach = np.maximum(np.maximum.reduce(runs), floor)
    excess = np.maximum(diff - reach, 0.0)
    low = u_low > u   # the program computes in a lower precision than this output's
    # Adam's flips happen where rounding moves an element: count those (every correct run equal to
    # ref64 elsewhere: copies, zeros, an amax history's older entries), not the whole output
    moved = int(np.count_nonzero(np.maximum.reduce(runs) > 0))
    trim = min(math.ceil(moved * u_low), max(moved - 1, 0) // 8) if low else 0
    rel = c * max(u * math.sqrt(k), u_low)   # low-precision programs accumulate in float32 (no sqrt(K))
    scale = float(np.linalg.norm(r))
    reach_norm = float(np.linalg.norm(reach))
    # the absolute floor: one correct order's rounding, normwise (the other orders inject ALPHA times it)
    allowed = rel * scale + reach_norm / (ALPHA if others else 1.0)
    if low:   # bfloat16 roundings flip everywhere, at other elements in every run: a whole run's error
        allowed += max(float(np.linalg.norm(x)) for x in runs)
    ex = _norm_without_largest(excess, trim)
    ok = same_nonfinite and bool(np.all(np.isfinite(o[finite]))) and ex <= allowed
    denom = max(scale, reach_norm)      # relative figures: not noise over noise (module docstring)
    worst = np.unravel_index(int(np.argmax(diff)), diff.shape) if diff.size else ()
    return OutputCheck(name, ok, float(np.linalg.norm(diff)) / denom, float(np.linalg.norm(runs[0])) / denom,
                       reach_norm / denom, ex / denom, allowed / denom, float(diff.max()),
                       tuple(int(i) for i in worst), float(ours[worst]), float(ref[worst]))


def _norm_without_largest(x: np.ndarray, n: int) -> float:
    """‖x‖ without its ``n`` largest elements (Adam's sign flips of near-zero low-precision
    gradients, see the module docstring)."""
    if n <= 0:
        return float(np.linalg.norm(x))
    flat = x.ravel()
    return float(np.linalg.norm(np.partition(flat, flat.size - n)[:flat.size - n]))


def _exact(ours: np.ndarray, base: np.ndarray, name: str) -> OutputCheck:
    diff = ours != base
    ok = not bool(diff.any())
    worst = np.unravel_index(int(np.argmax(diff)), diff.shape) if diff.size else ()
    err = float(diff.mean()) if diff.size else 0.0
    return OutputCheck(name, ok, err, 0.0, 0.0, err, 0.0, float(np.abs(ours.astype(np.float64) - base).max(initial=0.0)),
                       tuple(int(i) for i in worst), float(ours[worst]) if diff.size else 0.0,
                       float(base[worst]) if diff.size else 0.0)


def judge_strict(ours: Sequence[np.ndarray], baseline: Sequence[np.ndarray], names: Sequence[str], *,
                 rtol: float = STRICT_RTOL, atol: float = STRICT_ATOL) -> Verdict:
    """Elementwise: every output within ``atol + rtol·|jit|`` of ``jax.jit``'s (``err`` and
    ``bound`` are then the largest ``|ours − jit| / (atol + rtol·|jit|)`` and 1)."""
    if not len(ours) == len(baseline) == len(names):
        raise EmulationError(f"verdict: {len(ours)} outputs, {len(baseline)} baseline, {len(names)} names")
    checks = []
    for o, b, n in zip(map(np.asarray, ours), map(np.asarray, baseline), names):
        if o.shape != b.shape:
            raise EmulationError(f"output {n!r}: shape {list(o.shape)}, jax.jit {list(b.shape)}")
        diff = np.abs(o.astype(np.float64) - b.astype(np.float64))
        ratio = diff / (atol + rtol * np.abs(b.astype(np.float64)))
        worst = np.unravel_index(int(np.nanargmax(ratio)), ratio.shape) if ratio.size else ()
        err = float(np.nanmax(ratio)) if ratio.size else 0.0
        ok = bool(np.allclose(o, b, rtol=rtol, atol=atol, equal_nan=True))
        checks.append(OutputCheck(n, ok, err, 0.0, 0.0, err, 1.0, float(diff.max(initial=0.0)), tuple(int(i) for i in worst),
                                  float(o[worst]) if o.size else 0.0, float(b[worst]) if b.size else 0.0))
    return Verdict(all(c.ok for c in checks), tuple(checks), 0,
                   f"strict: loss and gradients elementwise vs jax.jit (rtol {rtol:g}, atol {atol:g})")
