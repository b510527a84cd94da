"""Special functions numpy lacks (scipy is not a runtime dependency): erf, erfc, erf⁻¹ in float64.

Used by the elementwise entries ``erf``, ``erfc`` and ``erf_inv``; the interpreter casts the
float64 result to the equation's dtype.
"""
from __future__ import annotations

import math

import numpy as np

# Cephes ndtr.c rational approximations, computed in float64 (relative error < 1e-15).
_T = (9.60497373987051638749e0, 9.00260197203842689217e1, 2.23200534594684319226e3,
      7.00332514112805075473e3, 5.55923013010394962768e4)
_U = (3.35617141647503099647e1, 5.21357949780152679795e2, 4.59432382970980127987e3,
      2.26290000613890934246e4, 4.92673942608635921086e4)
_P = (2.46196981473530512524e-10, 5.64189564831068821977e-1, 7.46321056442269912687e0,
      4.86371970985681366614e1, 1.96520832956077098242e2, 5.26445194995477358631e2,
      9.34528527171957607540e2, 1.02755188689515710272e3, 5.57535335369399327526e2)
_Q = (1.32281951154744992508e1, 8.67072140885989742329e1, 3.54937778887819891062e2,
      9.75708501743205489753e2, 1.82390916687909736289e3, 2.24633760818710981792e3,
      1.65666309194161350182e3, 5.57535340817727675546e2)
_R = (5.64189583547755073984e-1, 1.27536670759978104416e0, 5.01905042251180477414e0,
      6.16021097993053585195e0, 7.40974269950448939160e0, 2.97886665372100240670e0)
_S = (2.26052863220117276590e0, 9.39603524938001434673e0, 1.20489539808096656605e1,
      1.70814450747565897222e1, 9.60896809063285878198e0, 3.36907645100081516050e0)


def _polevl(x: np.ndarray, c: tuple[float, ...], monic: bool = False) -> np.ndarray:
    y = x + c[0] if monic else np.full_like(x, c[0])
    for k in c[1:]:
        y = y * x + k
    return y


def _erf_inner(x: np.ndarray) -> np.ndarray:
    xi = np.clip(x, -1.0, 1.0)
    z = xi * xi
    return xi * _polevl(z, _T) / _polevl(z, _U, monic=True)


def _erfc_tail(a: np.ndarray) -> np.ndarray:
    """erfc(|x|) for |x| >= 1 (smaller |x| are clipped to 1; erfc(30) underflows already)."""
    ao = np.clip(a, 1.0, 30.0)
    tail = np.where(ao < 8.0, _polevl(ao, _P) / _polevl(ao, _Q, monic=True),
                    _polevl(ao, _R) / _polevl(ao, _S, monic=True))
    return np.exp(-ao * ao) * tail


def erf64(x: np.ndarray) -> np.ndarray:
    """erf in float64 for any real array (NaN stays NaN, ±inf → ±1)."""
    x = np.asarray(x, np.float64)
    a = np.abs(x)
    outer = np.copysign(1.0 - _erfc_tail(a), x)
    return np.where(a <= 1.0, _erf_inner(x), outer) + np.where(np.isnan(x), x, 0.0)


def erfc64(x: np.ndarray) -> np.ndarray:
    """erfc in float64, accurate in the tail (not computed as 1 - erf there)."""
    x = np.asarray(x, np.float64)
    a = np.abs(x)
    t = _erfc_tail(a)
    outer = np.where(x > 0, t, 2.0 - t)
    return np.where(a <= 1.0, 1.0 - _erf_inner(x), outer) + np.where(np.isnan(x), x, 0.0)


def erf_inv64(x: np.ndarray) -> np.ndarray:
    """erf⁻¹ in float64: Giles' single-precision approximation, then Newton steps."""
    x = np.asarray(x, np.float64)
    w = -np.log((1.0 - x) * (1.0 + x))
    w1 = w - 2.5
    p1: np.ndarray | float = 2.81022636e-08
    for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
              -0.00417768164, 0.246640727, 1.50140941):
        p1 = c + p1 * w1
    w2 = np.sqrt(w) - 3.0
    p2: np.ndarray | float = -0.000200214257
    for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
              0.00943887047, 1.00167406, 2.83297682):
        p2 = c + p2 * w2
    y = np.where(w < 5.0, p1, p2) * x
    finite = np.abs(x) < 1.0
    ys = np.where(finite, y, 0.0)
    for _ in range(2):
        ys = ys - (erf64(ys) - np.where(finite, x, 0.0)) / (2.0 / math.sqrt(math.pi) * np.exp(-ys * ys))
    out = np.where(finite, ys, np.where(np.abs(x) == 1.0, np.copysign(np.inf, x), np.nan))
    return out
