"""conv_general_dilated: XLA's convolution, with the dilations, padding and group counts that
its gradients use.

Roles come from ``dimension_numbers`` (``lhs_spec``, ``rhs_spec``, ``out_spec``: the positions of
batch, feature and spatial dims), never from the layout, because the gradient convs swap them:
jax's weight gradient uses the input's batch dim as the *feature* (contracting) dim and its
channels as the *batch* dim (with ``batch_group_count = G`` for a grouped forward conv), and its
input gradient dilates the cotangent (``lhs_dilation = stride``). With ``C`` lhs features,
``G = feature_group_count`` and ``B = batch_group_count`` (one of them is 1):

- rhs has ``O`` output features and ``I = C / G`` input features; output feature ``o`` belongs to
  group ``o // (O / (G·B))``, which reads lhs features ``[g·I, (g+1)·I)`` (feature groups) or lhs
  batch rows ``[g·N/B, (g+1)·N/B)`` (batch groups); the result has ``N / B`` batch rows.

Rule (factors, major→minor in compound dims): batch ``n`` shared by lhs batch and result batch;
input feature ``i`` shared by lhs feature and rhs input feature, a *contraction* (tiling it makes
the result a pending sum); output feature ``o`` shared by rhs output feature and result feature.
A group count ``> 1`` adds a group factor ``g``, major in lhs feature ``(g, i)`` (or lhs batch
``(g, n)``) and in both output-feature dims ``(g, o)``: tiling ``g`` runs whole groups per device
(depthwise convs shard by channel) and lowering localizes the group count.

Spatial dims, per dim ``k`` (stride ``s``, lhs dilation ``d``, low padding ``lo``, dilated kernel
``K = (k-1)·rhs_dilation + 1``):

- a window of one element with stride 1, no padding and no lhs dilation is per-element (lhs and
  result share its factor, as a 1×1 conv's); a single output covering the whole unpadded,
  undilated lhs dim with an equally long kernel is a contraction (lhs and rhs share it);
- *halo dims* (``FactorRule.halo``): when ``out·s == lhs·d`` the blocks of the lhs and of the result
  line up (stride-1 'SAME', stride-``s`` 'SAME' with ``s | n``, ``k == s`` 'VALID', and the input
  gradients of those, which dilate the cotangent by ``s``): lhs dim ``(f, a)`` and result dim
  ``(f, c)`` share the major factor ``f`` (``a``, ``c`` minor and untiled), the rhs dim is blocked.
  When instead ``rhs·rhs_dilation == lhs·d`` (the *weight gradient*, whose rhs is the cotangent
  sliding over the input with ``rhs_dilation`` = the forward stride) lhs and rhs share ``f``, a
  contraction: tiling it leaves each device a pending sum of the kernel gradient.
  Device ``j`` of ``b`` owns lhs elements at padded positions ``lo + j·S + t·d`` (``S`` = block ·
  ``d``) and its outputs read ``[j·S, (j+1)·S + reach)`` with ``reach = K - s`` (forward) or
  ``(out-1)·s + 1 - rhs_dilation`` (weight gradient); it needs ``⌊lo/d⌋`` elements of device
  ``j-1`` and ``⌈(reach-lo)/d⌉`` of device ``j+1``, exchanged by ``collective_permute`` and
  concatenated, then runs the conv with the padding of the extended block
  (:class:`~partir_emu.primitives.window.HaloDim`, :mod:`partir_emu.compiler.lowering.halo`). The outer
  devices receive zeros, which is the conv's zero padding. ``f`` is coarse enough that a halo
  never exceeds one neighbour's block;
- every other spatial dim ('VALID' with ``k > s``, whose output is shorter than ``lhs/s``) is
  blocked, separately in lhs, rhs and result: tiling it gathers the lhs.

Numerics: bfloat16/float16 operands are multiplied and summed in float32, as XLA CPU does; the
interpreter rounds the result. Cost: ``2 · result elements · kernel window · I`` FLOPs on the matrix
unit (kind ``matmul``); bytes = operands + result. :func:`conv_gemm_dims` gives the hardware models
the conv's implicit GEMM (groups, M, N, K) for their matrix-unit efficiency.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from partir_emu.core.dtypes import is_low_float, np_dtype
from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.core.registry import Primitive, register
from partir_emu.errors import EmulationError
from partir_emu.primitives.costs import Cost, elems, in_bytes, out_bytes
from partir_emu.primitives.dot import matmul
from partir_emu.primitives.window import HaloDim, halo_split, split_dims, window_view


def _specs(p: Mapping[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    dn = p["dimension_numbers"]
    return tuple(dn["lhs_spec"]), tuple(dn["rhs_spec"]), tuple(dn["out_spec"])


# -- rule -------------------------------------------------------------------------------------------
def _compound(b: RuleBuilder, *factors: int | None) -> tuple[int, ...]:
    """A dim made of ``factors`` (major→minor), leaving out absent and size-1 ones."""
    kept = tuple(f for f in factors if f is not None and b.sizes[f] > 1)
    return kept or (b.new(1),)


def _geometry(eqn: Eqn) -> tuple[RuleBuilder, list, list, list, list[HaloDim]]:
    lhs, rhs = eqn.inputs
    out = eqn.outputs[0]
    p = eqn.params
    ls, rs, os_ = _specs(p)
    G, B = int(p["feature_group_count"]), int(p["batch_group_count"])
    groups = max(G, B)
    b = RuleBuilder()
    ld: list = [None] * lhs.ndim
    rd: list = [None] * rhs.ndim
    od: list = [None] * out.ndim
    g = b.new(groups) if groups > 1 else None
    n = b.new(out.shape[os_[0]])
    ld[ls[0]], od[os_[0]] = _compound(b, g if B > 1 else None, n), _compound(b, n)
    i = b.new(rhs.shape[rs[1]])
    ld[ls[1]], rd[rs[1]] = _compound(b, g if G > 1 else None, i), _compound(b, i)
    o = b.new(rhs.shape[rs[0]] // groups)
    rd[rs[0]] = od[os_[1]] = _compound(b, g, o)
    halos: list[HaloDim] = []
    for k in range(len(ls) - 2):
        ln, kn, on = lhs.shape[ls[2 + k]], rhs.shape[rs[2 + k]], out.shape[os_[2 + k]]
        stride, pad = p["window_strides"][k], tuple(p["padding"][k])
        ldil, rdil = p["lhs_dilation"][k], p["rhs_dilation"][k]
        plain = pad == (0, 0) and ldil == 1
        fwd_reach = (kn - 1) * rdil + 1 - stride          # lhs rows a block's windows read past the next block
        wgrad_reach = (on - 1) * stride + 1 - rdil          # the same when the rhs slides over the lhs
        if plain and kn == 1 and stride == 1:                       # per-element (1×1 window)
            f = b.new(ln)
            ld[ls[2 + k]], rd[rs[2 + k]], od[os_[2 + k]] = (f,), (b.new(1),), (f,)
        elif plain and rdil == 1 and on == 1 and ln == kn:          # one window over the whole dim
            f = b.new(ln)
            ld[ls[2 + k]], rd[rs[2 + k]], od[os_[2 + k]] = (f,), (f,), (b.new(1),)
        elif (split := halo_split(ln, on, stride, ldil, pad[0], fwd_reach)) is not None:   # output rows ↔ lhs rows
            f, ld[ls[2 + k]], od[os_[2 + k]] = split_dims(b, split)
            rd[rs[2 + k]] = (b.new(kn, blocked=True),)
            halos.append(HaloDim(f, 0, ls[2 + k], k, pad[0], ldil, fwd_reach))
        elif (split := halo_split(ln, kn, rdil, ldil, pad[0], wgrad_reach)) is not None:  # weight gradient
            f, ld[ls[2 + k]], rd[rs[2 + k]] = split_dims(b, split)
            od[os_[2 + k]] = (b.new(on, blocked=True),)
            halos.append(HaloDim(f, 0, ls[2 + k], k, pad[0], ldil, wgrad_reach))
        else:
            ld[ls[2 + k]] = (b.new(ln, blocked=True),)
            rd[rs[2 + k]] = (b.new(kn, blocked=True),)
            od[os_[2 + k]] = (b.new(on, blocked=True),)
    return b, ld, rd, od, halos


def conv_rule(eqn: Eqn) -> FactorRule:
    b, ld, rd, od, halos = _geometry(eqn)
    return b.rule([ld, rd], [od], halo=frozenset(h.factor for h in halos))


def conv_halos(eqn: Eqn) -> list[HaloDim]:
    """The spatial dims of ``eqn`` whose factor may be tiled with a halo exchange of the lhs."""
    return _geometry(eqn)[4]


# -- impl -------------------------------------------------------------------------------------------
def _conv(lhs: np.ndarray, rhs: np.ndarray, *, window_strides: Sequence[int], padding: Sequence[Sequence[int]],
          lhs_dilation: Sequence[int], rhs_dilation: Sequence[int], dimension_numbers: dict,
          feature_group_count: int = 1, batch_group_count: int = 1,
          preferred_element_type: str | None = None, **_: Any) -> np.ndarray:
    """``lax.conv_general_dilated`` by im2col and one batched matmul over the groups."""
    ls, rs, os_ = _specs({"dimension_numbers": dimension_numbers})
    lhs, rhs = np.asarray(lhs), np.asarray(rhs)
    if preferred_element_type is not None:
        dt = np_dtype(preferred_element_type)
        lhs, rhs = lhs.astype(dt, copy=False), rhs.astype(dt, copy=False)
    if is_low_float(lhs.dtype) or is_low_float(rhs.dtype):   # XLA CPU sums these in float32
        lhs, rhs = lhs.astype(np.float32), rhs.astype(np.float32)
    x = np.transpose(lhs, ls)          # (N, C, *S)
    w = np.transpose(rhs, rs)          # (O, I, *K)
    nsp = x.ndim - 2
    G, B = int(feature_group_count), int(batch_group_count)
    N, C, n_out, n_in = x.shape[0], x.shape[1], w.shape[0], w.shape[1]
    groups = max(G, B)
    if C != G * n_in or N % B or n_out % groups:
        raise EmulationError(f"conv_general_dilated: lhs {lhs.shape} and rhs {rhs.shape} do not fit "
                             f"feature_group_count={G}, batch_group_count={B}")
    ksp = w.shape[2:]
    patches = window_view(x, (1, 1, *ksp), (1, 1, *window_strides), ((0, 0), (0, 0), *map(tuple, padding)),
                          (1, 1, *lhs_dilation), (1, 1, *rhs_dilation), 0)
    osp = patches.shape[2:2 + nsp]     # patches: (N, C, *out_spatial, 1, 1, *K)
    patches = patches.reshape(B, N // B, G, n_in, *osp, *ksp)
    sp = tuple(range(4, 4 + nsp))
    kk = tuple(range(4 + nsp, 4 + 2 * nsp))
    cols = np.transpose(patches, (0, 2, 1, *sp, 3, *kk)).reshape(groups, (N // B) * math.prod(osp), -1)
    mat = w.reshape(groups, n_out // groups, -1).transpose(0, 2, 1)
    res = matmul(cols, mat)         # (groups, N/B · out_spatial, O/groups)
    res = res.reshape(groups, N // B, *osp, n_out // groups)
    res = np.moveaxis(res, (0, 1, 2 + nsp), (1, 0, 2)).reshape(N // B, n_out, *osp)
    return np.transpose(res, np.argsort(os_))


# -- cost and localisation --------------------------------------------------------------------------
def conv_gemm_dims(e: Eqn) -> tuple[int, int, int, int]:
    """The implicit GEMM of a conv: ``(groups, M, N, K)`` with ``M`` = result batch × spatial,
    ``N`` = output features per group, ``K`` = input features per group × kernel window."""
    ls, rs, os_ = _specs(e.params)
    rhs, out = e.inputs[1], e.outputs[0]
    groups = max(int(e.params["feature_group_count"]), int(e.params["batch_group_count"]))
    o = out.shape[os_[1]]
    k = rhs.shape[rs[1]] * math.prod(rhs.shape[d] for d in rs[2:])
    return groups, elems(out) // max(o, 1), o // groups, k


def conv_cost(e: Eqn) -> Cost:
    g, m, n, k = conv_gemm_dims(e)
    return float(2 * g * m * n * k), float(in_bytes(e) + out_bytes(e))


def conv_localize(e: Eqn, ins: Sequence[Any], outs: Sequence[Any]) -> dict:
    """The group counts for the local blocks (a tiled group factor runs fewer groups per device)."""
    p = dict(e.params)
    ls, rs, os_ = _specs(p)
    if p["feature_group_count"] > 1:
        p["feature_group_count"] = ins[0].shape[ls[1]] // ins[1].shape[rs[1]]
    if p["batch_group_count"] > 1:
        p["batch_group_count"] = ins[0].shape[ls[0]] // outs[0].shape[os_[0]]
    return p


register(Primitive("conv_general_dilated", kind="matmul", rule=conv_rule, impl=_conv, cost=conv_cost,
                   localize=conv_localize, summands=(0, 1)))
