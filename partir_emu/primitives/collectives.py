"""The SPMD primitives that lowering emits (never traced from a jaxpr), and ``tag``, the one traced
primitive that is about partitioning.

- The communicating collectives (``all_gather``, ``all_reduce``, ``reduce_scatter``,
  ``all_to_all``, ``collective_permute``; :data:`partir_emu.core.spmd.COMM_PRIMS`, the file
  format's vocabulary, whose docstring gives each one's meaning and params) have no impl here:
  the meshes run them, and the communication model prices them (cost 0 here).
- The local ones run per device without traffic, so their value depends on the device:
  ``all_slice`` keeps block ``group_index`` of ``dim``; ``to_partial`` keeps the value on
  group member 0 and zeros elsewhere; ``axis_index`` is this device's index along mesh axes
  (int32).
- ``tag`` (:func:`partir_emu.compiler.tracing.tag.tag`) is the identity, with the identity's factor
  rule; it names a value so that a tactic can stop there (``ManualPartition(stop_at=...)``), and the
  lowering turns it into a reshard from its operand's tiling to its result's, so it is never in an
  SPMD program. Free: no FLOPs, no bytes.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.core.mesh import Mesh
from partir_emu.core.registry import Primitive, register
from partir_emu.core.spmd import COMM_PRIMS
from partir_emu.errors import EmulationError
from partir_emu.primitives.costs import copy_cost, free_cost, read_what_you_keep_cost


def _all_slice(x: np.ndarray, mesh: Mesh, device: int, *, axes: Sequence[str], dim: int, **_: Any) -> np.ndarray:
    p = mesh.group_size(axes)
    n, r = divmod(x.shape[dim], p)
    if r:
        raise EmulationError(f"all_slice over {tuple(axes)} (group of {p}) of a dim of size {x.shape[dim]}: "
                             f"not divisible")
    i = mesh.group_index(device, axes)
    idx = [slice(None)] * x.ndim
    idx[dim] = slice(i * n, (i + 1) * n)
    return np.array(x[tuple(idx)])  # a real copy: the block is a buffer of its own


def _to_partial(x: np.ndarray, mesh: Mesh, device: int, *, axes: Sequence[str], **_: Any) -> np.ndarray:
    return x if mesh.group_index(device, axes) == 0 else np.zeros_like(x)


def _axis_index(mesh: Mesh, device: int, *, axes: Sequence[str] = (), axis: str | None = None,
                **_: Any) -> np.ndarray:
    return np.asarray(mesh.group_index(device, (axis,) if axis is not None else tuple(axes)), np.int32)


def tag_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    dims = b.fresh_dims(eqn.outputs[0].shape)
    return b.rule([dims], [dims], linear=True)


def _tag(x: np.ndarray, **_: Any) -> np.ndarray:
    return x


register(
    *(Primitive(name, kind="collective", cost=free_cost, traceable=False, communicates=True)
      for name in COMM_PRIMS),
    Primitive("all_slice", kind="memory", per_device=_all_slice, cost=read_what_you_keep_cost, traceable=False),
    Primitive("to_partial", kind="memory", per_device=_to_partial, cost=copy_cost, traceable=False),
    Primitive("axis_index", kind="free", per_device=_axis_index, cost=free_cost, traceable=False),
    Primitive("tag", kind="free", rule=tag_rule, impl=_tag, cost=free_cost),
)
