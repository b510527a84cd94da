"""Claims about predictions, as assertions whose failure message names the figure.

Each ``assert_*`` raises :class:`ClaimFailed` (an ``AssertionError``, so pytest reports it as a
failed test and plain scripts stop) with the configurations, the figures and the margin, e.g.::

    bp+mp+z3 is not 10 % faster than bp+z3: 0.4123 s vs 0.4410 s (6.5 % faster)

They take :class:`~partir_emu.app.claims.prediction.Prediction` values; ``assert_verified`` takes what a
run returns (``fn.verify(...)``'s Verdict, a run report dict with ``"verified"``).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from partir_emu.app.claims.prediction import Prediction
from partir_emu.errors import UsageError

GIB = 2 ** 30
_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


class ClaimFailed(AssertionError):
    """A claim about a prediction does not hold; the message says which figure and by how much."""


def parse_bytes(value: int | float | str) -> float:
    """``16e9``, ``"16GB"`` (10^9) or ``"16GiB"`` (2^30) as bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS and unit != "":
        raise UsageError(f"hbm={value!r}: write bytes as a number or with a unit: 16GB, 16GiB, 512MiB")
    return float(m.group(1)) * _UNITS.get(unit, 1)


def _t(s: float) -> str:
    return f"{s * 1e3:.4g} ms" if s < 1 else f"{s:.4g} s"


def assert_faster(a: Prediction, b: Prediction, by: float = 0.0) -> None:
    """``a``'s step is at least ``by`` (a fraction: 0.10 = 10 %) shorter than ``b``'s."""
    __tracebackhide__ = True          # pytest: show the claim's message, not this frame
    if not 0 <= by < 1:
        raise UsageError(f"assert_faster: by={by!r} is a fraction of b's step in [0, 1), e.g. 0.10 for 10 %")
    gain = 1 - a.step_s / b.step_s
    if a.step_s > (1 - by) * b.step_s:
        what = f"{100 * gain:.1f} % faster" if gain >= 0 else f"{-100 * gain:.1f} % slower"
        raise ClaimFailed(f"{a.label} is not {100 * by:g} % faster than {b.label}: step {_t(a.step_s)} vs "
                          f"{_t(b.step_s)} ({what})")


def assert_fits(r: Prediction, hbm: int | float | str | None = None) -> None:
    """The step fits in ``hbm`` per device (default: the chip's HBM), counting what the stack's
    allocator and reserved memory need beside the peak (``needed_bytes``)."""
    __tracebackhide__ = True          # pytest: show the claim's message, not this frame
    limit = float(r.hbm_bytes) if hbm is None else parse_bytes(hbm)
    need = max(float(r.needed_bytes), float(r.peak_bytes))
    if need > limit:
        raise ClaimFailed(f"{r.label} does not fit: needs {need / GIB:.3f} GiB per device (peak "
                          f"{r.peak_bytes / GIB:.3f} GiB) of {limit / GIB:.3f} GiB")


def assert_within(r: Prediction, measured_s: float, rel: float = 0.08) -> None:
    """The predicted step is within ``rel`` (a fraction) of a measured step time in seconds."""
    __tracebackhide__ = True          # pytest: show the claim's message, not this frame
    if measured_s <= 0 or rel < 0:
        raise UsageError(f"assert_within: measured_s={measured_s!r} must be > 0 s and rel={rel!r} >= 0")
    err = (r.step_s - measured_s) / measured_s
    if abs(err) > rel:
        raise ClaimFailed(f"{r.label}: predicted step {_t(r.step_s)} is {100 * err:+.1f} % from the measured "
                          f"{_t(measured_s)} (allowed {100 * rel:g} %)")


def _sum_kind(counts: Mapping[str, int], key: str) -> int:
    if "@" in key:
        return int(counts.get(key, 0))
    return sum(n for k, n in counts.items() if k.split("@", 1)[0] == key)


def assert_collectives(r: Prediction, expected: Mapping[str, int], *, only: bool = False) -> None:
    """Each key of ``expected`` (``"all_reduce@batch"``, or a kind alone, ``"all_gather"``, for its
    count over every axis) has that count; with ``only``, no other collective kind/axes is present."""
    __tracebackhide__ = True          # pytest: show the claim's message, not this frame
    lines = [f"{k}: expected {n}, got {_sum_kind(r.collectives, k)}" for k, n in expected.items()
             if _sum_kind(r.collectives, k) != n]
    if only:
        named = set(expected)
        lines += [f"{k}: not expected, got {n}" for k, n in r.collectives.items()
                  if k not in named and k.split("@", 1)[0] not in named]
    if lines:
        raise ClaimFailed(f"{r.label}: collectives differ\n  " + "\n  ".join(lines))


def assert_verified(run: Any) -> None:
    """A run verified against ``jax.jit``: ``fn.verify(...)``'s Verdict, or a run report (a dict
    with ``"verified"``, as ``partir-emu run --report`` writes)."""
    __tracebackhide__ = True          # pytest: show the claim's message, not this frame
    if isinstance(run, Mapping):
        ok, why = run.get("verified"), run.get("verdict") or run.get("worst") or ""
        if ok is None:
            raise UsageError("assert_verified: the report has no 'verified' key (is it a run report?)")
    elif hasattr(run, "verified"):
        ok = run.verified
        why = run.summary() if hasattr(run, "summary") else repr(run)
    else:
        raise UsageError(f"assert_verified: {type(run).__name__} is neither a Verdict nor a run report dict")
    if not ok:
        raise ClaimFailed(f"the run did not verify against jax.jit: {why}")


__all__ = ["ClaimFailed", "assert_collectives", "assert_faster", "assert_fits", "assert_verified", "assert_within",
           "parse_bytes"]
