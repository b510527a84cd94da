"""Windowed reductions (pooling): ``reduce_window_sum``/``_max``/``_min`` and
``select_and_scatter_add`` (the gradient of max pooling), plus :func:`window_view`, the window
geometry they share with :mod:`partir_emu.primitives.conv`.

Geometry, as XLA's ReduceWindow: along each dim the operand is first dilated (``base_dilation - 1``
holes between elements), then padded by ``padding`` (lo, hi; negative crops), both filled with the
reduction's identity; a window of ``window_dimensions`` elements spaced ``window_dilation`` apart
starts every ``window_strides`` elements. A dim has ``⌊(n_padded - dilated_window) / stride⌋ + 1``
windows (none if the window does not fit).

Rules: a dim is *per-element* when its window is one element with stride 1, no padding and no base
dilation (the batch and channel dims of NHWC pooling): operand and result share its factor, which
may be tiled. A window dim whose operand and result blocks line up (``out·stride ==
operand·base_dilation``: 2×2 pooling with stride 2, 'SAME' pooling with ``stride | n``) is a *halo
dim*: operand ``(f, a)`` and result ``(f, c)`` share the major factor ``f``, and tiling it makes each
device read ``HaloDim.halos()`` border elements of its neighbours (:class:`HaloDim`, exchanged by
:mod:`partir_emu.compiler.lowering.halo`; none when windows never straddle blocks, e.g. window == stride).
The outer devices' missing neighbour rows are the padding, filled with the reduction's identity
(:func:`window_identity`: ``-inf`` for a max). ``select_and_scatter_add`` (max-pool gradient)
takes a halo dim only when windows never straddle blocks (2×2/stride 2): with overlapping windows
its scatter would need a second, reverse exchange, and a ``-inf`` stand-in for the padding could be
selected where the padding never is; that dim stays blocked. Every other dim ('VALID' pooling with
window > stride, whose output is shorter than ``n/stride``) is blocked: tiling it gathers the
operand.
``reduce_window_sum`` is linear: a pending sum passes through it.

Numerics: ``reduce_window_sum`` of a bfloat16/float16 operand is summed in float32 and rounded
once (XLA CPU may round each add), so it agrees to the narrow type's rounding, not bit for bit.
``select_and_scatter_add`` picks, in each window, the element that ``select_prim`` keeps when the
window is walked in row-major order (``ge``: the first maximum), never a padding position; the
source values are added in row-major window order.

Costs (kind ``reduction``): a window reduction does one operation per window element of each
output; ``select_and_scatter_add`` one comparison per window element and one add per source element.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partir_emu.core.dtypes import is_low_float
from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.core.registry import Primitive, register
from partir_emu.errors import EmulationError
from partir_emu.primitives.costs import Cost, elems, in_bytes, out_bytes

Pads = Sequence[Sequence[int]]


# -- geometry ---------------------------------------------------------------------------------------
def num_windows(n: int, window: int, stride: int, pad: Sequence[int], base: int = 1, wdil: int = 1) -> int:
    """Windows along one dim of size ``n`` (see the module docstring)."""
    padded = (max(n - 1, 0) * base + 1 if n else 0) + pad[0] + pad[1]
    span = (window - 1) * wdil + 1
    return 0 if padded < span else (padded - span) // stride + 1


def window_view(x: np.ndarray, window: Sequence[int], strides: Sequence[int], padding: Pads,
                base_dilation: Sequence[int], window_dilation: Sequence[int], fill: Any) -> np.ndarray:
    """Every window of ``x``: an array of shape ``(*windows_per_dim, *window)`` (a strided view of
    the dilated, padded operand, whose holes and padding hold ``fill``)."""
    x = np.asarray(x)
    nd = x.ndim
    if any(d > 1 for d in base_dilation):
        shape = tuple(max(n - 1, 0) * d + 1 if n else 0 for n, d in zip(x.shape, base_dilation))
        holes = np.full(shape, fill, x.dtype)
        holes[tuple(slice(None, None, d) for d in base_dilation)] = x
        x = holes
    grow = [(max(lo, 0), max(hi, 0)) for lo, hi in padding]
    if any(g != (0, 0) for g in grow):
        x = np.pad(x, grow, constant_values=np.asarray(fill, x.dtype))
    if any(lo < 0 or hi < 0 for lo, hi in padding):   # negative padding crops
        x = x[tuple(slice(-min(lo, 0), x.shape[i] + min(hi, 0)) for i, (lo, hi) in enumerate(padding))]
    span = [(w - 1) * d + 1 for w, d in zip(window, window_dilation)]
    counts = [0 if n < s else (n - s) // st + 1 for n, s, st in zip(x.shape, span, strides)]
    if 0 in counts:
        return np.zeros((*counts, *window), x.dtype)
    view = np.lib.stride_tricks.sliding_window_view(x, span, axis=tuple(range(nd)))
    keep = tuple(slice(None, None, st) for st in strides) + tuple(slice(None, None, d) for d in window_dilation)
    return view[keep]


def _params(p: Mapping[str, Any], ndim: int) -> tuple:
    ones = (1,) * ndim
    return (tuple(p["window_dimensions"]), tuple(p["window_strides"]), tuple(tuple(q) for q in p["padding"]),
            tuple(p.get("base_dilation") or ones), tuple(p.get("window_dilation") or ones))


def _per_element(window: int, stride: int, pad: Sequence[int], base: int) -> bool:
    return window == 1 and stride == 1 and tuple(pad) == (0, 0) and base == 1


# -- halo geometry ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class HaloDim:
    """One window dim whose blocks may be tiled with a halo exchange (see the module docstring).

    Device ``j`` owns operand elements ``[j·m, (j+1)·m)`` of ``operand``'s dim ``dim``; in the dilated,
    padded coordinates they sit at ``lo + j·S + t·dilation`` with ``S = m·dilation``, and the device's
    outputs read positions ``[j·S, (j+1)·S + reach)``."""

    factor: int        # the factor the operand dim shares with the result (or the contracted operand)
    operand: int       # the operand that is extended by its neighbours' border elements
    dim: int           # its dim
    pad_index: int     # which entry of ``params["padding"]`` is this dim's padding
    lo: int            # the dim's low padding
    dilation: int      # spacing of the operand's elements (lhs/base dilation)
    reach: int         # how far a block's windows read past where the next block's windows start

    def halos(self) -> tuple[int, int]:
        """Elements needed from the previous and from the next device (``lo`` and ``hi``)."""
        before = self.lo // self.dilation if self.lo > 0 else 0
        return before, max(0, -(-(self.reach - self.lo) // self.dilation))

    def local_padding(self, m: int) -> tuple[int, int]:
        """The padding of a block of ``m`` own elements extended by the halos: what the local
        equation uses instead of the global padding (negative crops)."""
        before, after = self.halos()
        d = self.dilation
        first = self.lo - before * d
        last = first + (before + m + after - 1) * d
        return first, m * d + self.reach - last - 1


def halo_split(n_in: int, n_out: int, stride: int, dilation: int, lo: int, reach: int) -> tuple[int, int, int] | None:
    """How a window dim of ``n_in`` operand elements and ``n_out`` windows (or contracted elements)
    can be tiled: ``(F, a, c)`` with ``n_in = F·a`` and ``n_out = F·c``, the shared factor ``F`` major,
    the ``a``/``c`` minor parts untiled; None if blocks cannot line up (``n_out·stride != n_in·dilation``).
    ``F`` is the largest that keeps every halo within one neighbour's block (``a·(F_max/F) >= halo``)."""
    if n_in < 1 or n_out < 1 or n_out * stride != n_in * dilation:
        return None
    full = math.gcd(n_in, n_out)
    g = HaloDim(0, 0, 0, 0, lo, dilation, reach)
    need = max(g.halos())
    a = n_in // full
    q = next((q for q in range(1, full + 1) if full % q == 0 and a * q >= need), None)
    if q is None:
        return None
    return full // q, a * q, (n_out // full) * q


def split_dims(b: RuleBuilder, split: tuple[int, int, int]) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """The shared factor and the two compound dims ``(F, a)`` and ``(F, c)`` of a :func:`halo_split`."""
    full, a, c = split
    f = b.new(full)
    return f, tuple(x for x in (f, b.new(a, blocked=True) if a > 1 else None) if x is not None), \
        tuple(x for x in (f, b.new(c, blocked=True) if c > 1 else None) if x is not None)


# -- rules ------------------------------------------------------------------------------------------
def _window_dims(eqn: Eqn, operand: int, zero_halo_only: bool) -> tuple[RuleBuilder, list, list, list[HaloDim]]:
    """Per dim of the windowed operand: (operand factors, result factors); shared per-element
    dims, shared halo dims where blocks line up (only halo-free ones if ``zero_halo_only``), else
    blocked separately."""
    x, out = eqn.inputs[operand], eqn.outputs[0] if eqn.prim != "select_and_scatter_add" else eqn.inputs[0]
    win, st, pad, base, wdil = _params(eqn.params, x.ndim)
    b = RuleBuilder()
    xdims: list[tuple[int, ...]] = []
    odims: list[tuple[int, ...]] = []
    halos: list[HaloDim] = []
    for d, n in enumerate(x.shape):
        if _per_element(win[d], st[d], pad[d], base[d]):
            xdims.append((b.new(n),))
            odims.append(xdims[-1])
            continue
        reach = (win[d] - 1) * wdil[d] + 1 - st[d]
        split = halo_split(n, out.shape[d], st[d], base[d], pad[d][0], reach)
        geo = HaloDim(0, operand, d, d, pad[d][0], base[d], reach)
        if split is not None and not (zero_halo_only and any(geo.halos())):
            f, xd, od = split_dims(b, split)
            xdims.append(xd)
            odims.append(od)
            halos.append(HaloDim(f, operand, d, d, geo.lo, geo.dilation, reach))
        else:
            xdims.append((b.new(n, blocked=True),))
            odims.append((b.new(out.shape[d], blocked=True),))
    return b, xdims, odims, halos


def reduce_window_halos(eqn: Eqn) -> list[HaloDim]:
    """The halo dims of a ``reduce_window_*``."""
    return _window_dims(eqn, 0, False)[3]


def reduce_window_rule(eqn: Eqn) -> FactorRule:
    """Per-element dims shared, halo dims shared (major factor), every other dim blocked."""
    b, xdims, odims, halos = _window_dims(eqn, 0, False)
    return b.rule([xdims], [odims], linear=eqn.prim == "reduce_window_sum", halo=frozenset(h.factor for h in halos))


def select_and_scatter_add_halos(eqn: Eqn) -> list[HaloDim]:
    """Halo dims of ``select_and_scatter_add``: only where windows never straddle blocks."""
    return _window_dims(eqn, 1, True)[3]


def select_and_scatter_add_rule(eqn: Eqn) -> FactorRule:
    """Operands (source, operand) -> result (operand's shape): per-element dims and halo-free
    window dims (windows that tile the blocks) shared by all three; every other dim blocked (the
    source's apart from the operand's and result's)."""
    b, xdims, sdims, halos = _window_dims(eqn, 1, True)
    return b.rule([sdims, xdims], [xdims], halo=frozenset(h.factor for h in halos))


# -- impls ------------------------------------------------------------------------------------------
def window_identity(dt: np.dtype, op: str) -> Any:
    """The identity of ``op`` (sum, max, min) for dtype ``dt``: what a window's padding holds."""
    if op == "sum":
        return 0
    big = op == "min"
    if dt == np.bool_:
        return big
    if np.issubdtype(dt, np.integer):
        info = np.iinfo(dt)
        return info.max if big else info.min
    return np.inf if big else -np.inf


def _reduce_window(op: str) -> Callable[..., np.ndarray]:
    def impl(x: np.ndarray, **p: Any) -> np.ndarray:
        x = np.asarray(x)
        win, st, pad, base, wdil = _params(p, x.ndim)
        view = window_view(x, win, st, pad, base, wdil, window_identity(x.dtype, op))
        axes = tuple(range(x.ndim, 2 * x.ndim))
        if op == "sum":
            acc = np.float32 if is_low_float(x.dtype) else x.dtype
            return np.sum(view, axis=axes, dtype=acc).astype(x.dtype)
        return (np.max if op == "max" else np.min)(view, axis=axes, initial=window_identity(x.dtype, op))
    return impl


_SELECT = {"ge": np.greater_equal, "gt": np.greater, "le": np.less_equal, "lt": np.less}


def _select_and_scatter_add(source: np.ndarray, operand: np.ndarray, *, select_prim: str,
                            window_dimensions: Sequence[int], window_strides: Sequence[int],
                            padding: Pads, **_: Any) -> np.ndarray:
    """XLA SelectAndScatter with a ``select_prim`` select and an add scatter (init 0)."""
    if select_prim not in _SELECT:
        raise EmulationError(f"select_and_scatter_add: select_prim {select_prim!r} is not one of {sorted(_SELECT)}")
    keeps = _SELECT[select_prim]
    operand, source = np.asarray(operand), np.asarray(source)
    nd = operand.ndim
    ones = (1,) * nd
    index = np.arange(operand.size, dtype=np.int64).reshape(operand.shape)
    geo = (tuple(window_dimensions), tuple(window_strides), tuple(tuple(q) for q in padding), ones, ones)
    idx = window_view(index, *geo, fill=-1)
    val = window_view(operand, *geo, fill=0)
    wshape = idx.shape[nd:]
    idx = idx.reshape(*idx.shape[:nd], -1)
    val = val.reshape(*val.shape[:nd], -1)
    sel_idx = np.full(idx.shape[:nd], -1, np.int64)
    sel_val = np.zeros(idx.shape[:nd], operand.dtype)
    for w in range(math.prod(wshape)):   # walk each window in row-major order, as XLA does
        cur_i, cur_v = idx[..., w], val[..., w]
        take = (cur_i >= 0) & ((sel_idx < 0) | ~keeps(sel_val, cur_v))
        sel_idx = np.where(take, cur_i, sel_idx)
        sel_val = np.where(take, cur_v, sel_val)
    acc_dt = np.float32 if is_low_float(source.dtype) else source.dtype
    out = np.zeros(operand.size, acc_dt)
    hit = sel_idx >= 0
    np.add.at(out, sel_idx[hit], source.astype(acc_dt)[hit])
    return out.reshape(operand.shape).astype(source.dtype)


# -- costs ------------------------------------------------------------------------------------------
def reduce_window_cost(e: Eqn) -> Cost:
    return float(elems(e.outputs[0]) * math.prod(e.params["window_dimensions"])), float(in_bytes(e) + out_bytes(e))


def select_and_scatter_add_cost(e: Eqn) -> Cost:
    n = elems(e.inputs[0])
    return float(n * math.prod(e.params["window_dimensions"]) + n), float(in_bytes(e) + out_bytes(e))


register(*(Primitive(f"reduce_window_{op}", kind="reduction", rule=reduce_window_rule, impl=_reduce_window(op),
                     cost=reduce_window_cost, summands=(0,) if op == "sum" else ()) for op in ("sum", "max", "min")),
         Primitive("select_and_scatter_add", kind="reduction", rule=select_and_scatter_add_rule,
                   impl=_select_and_scatter_add, cost=select_and_scatter_add_cost, summands=(0,)))
