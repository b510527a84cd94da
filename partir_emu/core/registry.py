"""The primitive registry: everything partir_emu knows about one primitive, in one entry.

A :class:`Primitive` holds every facet of one primitive that some layer needs:

``rule``        its sharding (factor) rule, used by propagation and lowering
                (None for the SPMD-only primitives the lowering itself emits);
``impl``        its numpy implementation with ``jax.lax`` semantics, run per device
                by the interpreter (``impl(*operands, **params)``);
``per_device``  instead of ``impl``, for primitives whose value depends on where they
                run (``all_slice``, ``to_partial``, ``axis_index``):
                ``per_device(*operands, mesh, device, **params)``;
``cost``        ``(flops, hbm_bytes)`` of one equation on local shapes, unfused;
``kind``        the op kind the hardware models file it under (one of :data:`KINDS`);
``localize``    how lowering rewrites its parameters from global to local shapes
                (None: the parameters do not spell out sizes);
``traceable``   whether ``compiler.trace`` accepts it from a jaxpr;
``communicates``whether it moves data between devices (the collectives that the
                runtime and the hardware models handle themselves);
``summands``    for a primitive that sums (contractions, reductions, scatter-add, ...), the
                operand positions whose elements are the terms of its sums or their factors:
                its ``impl`` is linear in each of them, so ``impl`` of their squares is the sum
                of the squared terms per result element (the verdict's rounding model,
                :mod:`partir_emu.runtime.rounding`). Empty for everything else.

The entries are defined in :mod:`partir_emu.primitives`, one module per family; importing
that package fills the registry (so consumers read it through the names that package
re-exports). Adding a primitive means adding one entry there (a test
checks that every traceable primitive has every facet).

This module imports nothing but the core.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from partir_emu.core.factors import FactorRule
from partir_emu.core.ir import Eqn
from partir_emu.errors import UnsupportedPrimitiveError

KINDS = ("matmul", "elementwise", "reduction", "memory", "collective", "free")

RuleFn = Callable[[Eqn], FactorRule]
ImplFn = Callable[..., Any]
CostFn = Callable[[Eqn], tuple[float, float]]
LocalizeFn = Callable[[Eqn, Sequence[Any], Sequence[Any]], dict]   # (eqn, local operands, local results)


@dataclass(frozen=True)
class Primitive:
    name: str
    kind: str
    rule: RuleFn | None = None
    impl: ImplFn | None = None
    per_device: ImplFn | None = None
    cost: CostFn | None = None
    localize: LocalizeFn | None = None
    traceable: bool = True
    communicates: bool = False
    summands: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"primitive {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if self.impl is not None and self.per_device is not None:
            raise ValueError(f"primitive {self.name!r}: give impl or per_device, not both")


_REGISTRY: dict[str, Primitive] = {}


def register(*prims: Primitive) -> None:
    """Add entries; a name can be registered once."""
    for p in prims:
        if p.name in _REGISTRY:
            raise ValueError(f"primitive {p.name!r} is registered twice")
        _REGISTRY[p.name] = p


def lookup(name: str, where: str = "") -> Primitive:
    """The entry of ``name``, or :class:`UnsupportedPrimitiveError` naming it and where it came from."""
    try:
        return _REGISTRY[name]
    except KeyError:
        at = f" at {where}" if where else ""
        raise UnsupportedPrimitiveError(f"primitive {name!r}{at} is not supported by partir_emu "
                                        f"(it has no entry in partir_emu.primitives)") from None


def get(name: str) -> Primitive | None:
    return _REGISTRY.get(name)


def registered() -> Mapping[str, Primitive]:
    """Every entry, by name (read-only view)."""
    return _REGISTRY


def names(**facets: Any) -> Iterator[str]:
    """Names of the entries whose attributes equal ``facets`` (e.g. ``traceable=True``)."""
    for n, p in _REGISTRY.items():
        if all(getattr(p, k) == v for k, v in facets.items()):
            yield n
