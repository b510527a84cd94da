"""A prediction as a value a test can assert on: :class:`Prediction`, its figures and collective counts.

A claim about a partitioning ("bp+mp+z3 beats bp+z3 by 10 % on 512 v4 chips", "this fits in 16
GiB", "the collective counts do not change") is a statement about :class:`Prediction` values;
:func:`partir_emu.testing.predict` makes them (:mod:`.model`).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from partir_emu.core.mesh import Mesh
from partir_emu.errors import UsageError

TIME_FIGURES = ("step_s", "compute_s", "exposed_comm_s")
FIGURES = (*TIME_FIGURES, "peak_bytes", "flops_per_device", "fits", "collectives")


@dataclass(frozen=True)
class Prediction:
    """What the analytical model says of one configuration (figures of :data:`FIGURES`), the inputs
    that made it, and the full report (``report``: :class:`~partir_emu.hwmodels.report.SimReport`)."""

    label: str                      # e.g. "transformer bp+z3 {'batch': 8} on 8 x tpu-v4 (xla)"
    inputs: dict[str, Any]
    step_s: float
    compute_s: float
    exposed_comm_s: float
    peak_bytes: int                 # per device
    needed_bytes: float             # the peak with the stack's allocator and reserved memory
    hbm_bytes: int
    fits: bool
    flops_per_device: float
    collectives: dict[str, int]     # "all_reduce@batch" -> how many one step executes
    report: Any = field(repr=False, compare=False)

    def figures(self) -> dict[str, Any]:
        """The figures a baseline snapshots (:mod:`partir_emu.app.claims.baselines`)."""
        return {k: (dict(self.collectives) if k == "collectives" else getattr(self, k)) for k in FIGURES}


def as_mesh(mesh: Any) -> Mesh:
    if isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, Mapping):
        return Mesh(tuple((str(k), int(v)) for k, v in mesh.items()))
    if isinstance(mesh, str):
        return Mesh.parse(mesh)
    raise UsageError(f"predict: mesh {mesh!r} is neither a Mesh, a dict of axis sizes nor text like 'batch=8,model=2'")


def as_overrides(settings: Any) -> str | None:
    if settings is None or isinstance(settings, str):
        return settings
    if isinstance(settings, Mapping):
        return ",".join(f"{k}={v}" for k, v in settings.items())
    raise UsageError(f"predict: set={settings!r} is neither text like 'batch=8,layers=2' nor a dict")


def collective_key(prim: str, axes: Any) -> str:
    return f"{prim}@{','.join(axes)}"


def count_collectives(spmd: Any) -> dict[str, int]:
    """``{"all_reduce@batch": n, ...}``: the communicating collectives one run executes (a loop's
    once per iteration), by kind and mesh axes."""
    return dict(sorted(Counter(collective_key(e.prim, e.params["axes"]) for e in spmd.collectives()).items()))


__all__ = ["FIGURES", "TIME_FIGURES", "Prediction", "as_mesh", "as_overrides", "collective_key", "count_collectives"]
