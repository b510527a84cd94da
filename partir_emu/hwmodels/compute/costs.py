"""The hardware models' view of the primitive registry: what one equation costs, and its kind.

Each primitive's ``cost`` facet (``Eqn → (flops, hbm_bytes)`` on local shapes, unfused; the
conventions are in :mod:`partir_emu.primitives.costs`) and ``kind`` facet live in its entry in
:mod:`partir_emu.primitives`. ``op_kind`` files every primitive under one of :data:`KINDS`
(``matmul``, ``elementwise``, ``reduction``, ``memory``, ``collective``, ``free``) for the report
and for the rate it runs at (matmuls at the chip's matrix peak for their dtype, everything else
at ``vector_flops_per_s``).

``cost_rules`` and ``op_kind`` are plain dicts derived from the registry once, at import (the
registry is filled when :mod:`partir_emu.primitives` is imported, before this module reads it):
the analytical model's per-equation loop indexes them directly.

A primitive without a cost raises :class:`UnsupportedPrimitiveError` naming it.
"""
from __future__ import annotations

from partir_emu.core.ir import Eqn
from partir_emu.core.registry import KINDS, CostFn
from partir_emu.errors import UnsupportedPrimitiveError
from partir_emu.primitives import registered
from partir_emu.primitives.costs import nbytes_of

__all__ = ["KINDS", "cost_rules", "eqn_cost", "nbytes_of", "op_kind"]

cost_rules: dict[str, CostFn] = {n: p.cost for n, p in registered().items() if p.cost is not None}
op_kind: dict[str, str] = {n: p.kind for n, p in registered().items()}


def eqn_cost(e: Eqn) -> tuple[float, float]:
    """``(flops, hbm_bytes)`` of one equation; raises UnsupportedPrimitiveError without a rule."""
    rule = cost_rules.get(e.prim)
    if rule is None:
        raise UnsupportedPrimitiveError(
            f"no cost rule for primitive {e.prim!r} (in `{e}`{', from ' + e.source if e.source else ''}); "
            f"give its entry in partir_emu.primitives a cost (hwmodels.costs.cost_rules is derived from it)")
    return rule(e)
