"""JAX interop: a strategy found here as ``jax.jit`` shardings, and ``jax.jit`` shardings as a schedule.

``to_jax(lowered)`` turns the in/out shardings of a lowered program into ``NamedSharding``s
on a real ``jax.sharding.Mesh`` with the same axis names and sizes, so the strategy runs
on real hardware in one line::

    sh = pe.jit(step, mesh=mesh, schedule=schedule).lower(*args).to_jax()
    fast = jax.jit(step, in_shardings=sh.in_shardings, out_shardings=sh.out_shardings)   # or sh.jit(step)

The mapping is exact: our sharding lists, per dim, the axes that tile it major→minor, and
devices are numbered row-major over the mesh axes; ``PartitionSpec(("a", "b"))`` means the
same, and :func:`jax_mesh` lays ``jax.devices()`` out row-major in our axis order. A dim
tiled by one axis becomes ``"a"``, by none ``None``. Lowering never leaves an output as a
pending sum (it reduces it first); a partial sharding (only a hand-built SpmdProgram can
carry one) has no ``PartitionSpec`` and is refused with a :class:`~partir_emu.errors.ShardingError`.

``from_partition_specs(specs, mesh)`` goes the other way: it turns the ``PartitionSpec``s a
user would give ``jax.jit`` into a ``ManualPartition`` schedule, one tactic per mesh axis. An
input given a spec is tiled as it says and pinned ``REPLICATED`` on every other axis (as
``jax.jit`` fixes an input's layout); an input given ``None`` or none at all is left to
propagation.

This module imports jax: it is app layer, and is loaded only when asked for
(``Lowered.to_jax``, ``partir_emu.from_partition_specs``).
"""
from __future__ import annotations

import fnmatch
import glob
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from partir_emu.compiler.tactics import REPLICATED, ManualPartition
from partir_emu.compiler.tracing.trace import input_names
from partir_emu.core.mesh import Mesh
from partir_emu.core.sharding import Sharding
from partir_emu.errors import ArgumentError, MeshError, ShardingError

if TYPE_CHECKING:
    from partir_emu.compiler.api import Partitioned as Lowered

__all__ = ["JaxShardings", "to_jax", "jax_mesh", "partition_spec", "partition_specs", "from_partition_specs"]


# -- our shardings -> jax ----------------------------------------------------------------------

def partition_spec(sharding: Sharding, what: str = "value") -> PartitionSpec:
    """The ``PartitionSpec`` of one of our shardings (one entry per dim; major→minor tuples)."""
    if sharding.partial:
        raise ShardingError(f"{what}: sharding {sharding} is a pending sum over {sharding.partial}, which no "
                            "PartitionSpec can express; reduce it first (lowering reduces every output)")
    return PartitionSpec(*[(d[0] if len(d) == 1 else tuple(d)) if d else None for d in sharding.dims])


def partition_specs(lowered: Lowered) -> tuple[dict[str, PartitionSpec], dict[str, PartitionSpec]]:
    """``(input name -> spec, output name -> spec)`` of a lowered program, in program order.
    Needs no jax devices (a parent process can export before a child compiles)."""
    spmd = lowered.spmd
    ins = {n: partition_spec(s, f"input {n!r}") for n, s in zip(spmd.input_names, spmd.in_shardings)}
    outs = {n: partition_spec(s, f"output {n!r}") for n, s in zip(spmd.output_names, spmd.out_shardings)}
    return ins, outs


def jax_mesh(mesh: Mesh, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
    """A ``jax.sharding.Mesh`` with ``mesh``'s axis names and sizes: the first ``mesh.size`` of
    ``devices`` (default ``jax.devices()``) laid out row-major, as our devices are numbered."""
    devs = list(jax.devices() if devices is None else devices)
    if len(devs) < mesh.size:
        raise MeshError(f"{mesh} needs {mesh.size} jax devices but {len(devs)} are available "
                        f"({devs[0].platform if devs else 'none'}); on CPU call "
                        f"jax.config.update('jax_num_cpu_devices', {mesh.size}) before jax first runs, "
                        "or pass devices=")
    sizes = [s for _, s in mesh.axes]
    return jax.sharding.Mesh(np.array(devs[:mesh.size], dtype=object).reshape(sizes), mesh.axis_names)


@dataclass(frozen=True)
class JaxShardings:
    """What ``jax.jit`` needs to run a lowered program's strategy.

    ``in_shardings`` is a tuple with one pytree of ``NamedSharding`` per positional argument
    and ``out_shardings`` a pytree like the function's result, when the pytrees are known
    (a :class:`~partir_emu.api.Lowered` from ``pe.jit(...).lower``, or ``in_tree``/``out_tree``
    given); otherwise both are flat tuples in the program's input/output order (for a function
    of flat arguments). ``in_specs``/``out_specs`` name every leaf's ``PartitionSpec``."""

    mesh: jax.sharding.Mesh
    in_shardings: Any
    out_shardings: Any
    in_specs: dict[str, PartitionSpec]
    out_specs: dict[str, PartitionSpec]

    def jit(self, fn: Callable, **kwargs: Any) -> Any:
        """``jax.jit(fn, in_shardings=..., out_shardings=..., **kwargs)``."""
        return jax.jit(fn, in_shardings=self.in_shardings, out_shardings=self.out_shardings, **kwargs)


def to_jax(lowered: Lowered, devices: Sequence[Any] | jax.sharding.Mesh | None = None, *,
           in_tree: Any = None, out_tree: Any = None) -> JaxShardings:
    """The lowered program's in/out shardings as ``NamedSharding``s for ``jax.jit`` (see
    :class:`JaxShardings`). ``devices``: a ``jax.sharding.Mesh`` with the same axis names and
    sizes, or devices to lay out (default ``jax.devices()``). ``in_tree``/``out_tree`` (treedefs
    of the argument tuple and of the result) default to the ``Lowered``'s own when it has them."""
    mesh = lowered.spmd.mesh
    if isinstance(devices, jax.sharding.Mesh):
        if tuple(devices.shape.items()) != mesh.axes:
            raise MeshError(f"jax mesh {dict(devices.shape)} does not have the axes of {mesh} (names, sizes and "
                            "order must agree); build it with partir_emu.interop.jax_mesh")
        jm = devices
    else:
        jm = jax_mesh(mesh, devices)
    in_specs, out_specs = partition_specs(lowered)
    ins = tuple(NamedSharding(jm, s) for s in in_specs.values())
    outs = tuple(NamedSharding(jm, s) for s in out_specs.values())
    in_tree = in_tree if in_tree is not None else getattr(lowered, "in_tree", None)
    out_tree = out_tree if out_tree is not None else getattr(lowered, "out_tree", None)
    if in_tree is not None:
        ins = jax.tree_util.tree_unflatten(in_tree, ins)
    if out_tree is not None:
        outs = jax.tree_util.tree_unflatten(out_tree, outs)
    return JaxShardings(jm, ins, outs, in_specs, out_specs)


# -- jax PartitionSpecs -> a schedule ----------------------------------------------------------

@dataclass(frozen=True)
class _Entry:
    pattern: str                        # a ManualPartition pattern (exact names are escaped)
    what: str                           # how errors name it
    dims: tuple[tuple[str, ...], ...]   # per dim, the axes that tile it, major→minor


def from_partition_specs(specs: Any, mesh: Mesh | jax.sharding.Mesh, *, args: Sequence[Any] | None = None,
                         fn: Callable | None = None, arg_names: Sequence[str] | None = None) -> list[ManualPartition]:
    """A ``ManualPartition`` schedule that lays the inputs out as ``specs`` say.

    ``specs`` is either a mapping from input name (or glob pattern, tried in order as
    ``ManualPartition`` does) to ``PartitionSpec``, e.g. ``{"params/w1": P(None, "model"),
    "batch/*": P("batch")}``; or what ``jax.jit`` takes as ``in_shardings``: a tuple with one
    pytree (or pytree prefix) of ``PartitionSpec`` per positional argument, named as the tracer
    names them, from ``fn``'s signature or ``arg_names``; or one ``PartitionSpec`` for every input.
    ``None`` leaves leave an input to propagation (in a mapping a ``None`` value is dropped, so a
    later pattern that matches the input still decides it). With ``args`` (example arrays or
    ``jax.ShapeDtypeStruct``s) ranks, divisibility and unmatched patterns are checked here;
    without, lowering checks them for the dims a spec tiles.

    One tactic per mesh axis, in mesh order, except that a dim tiled by ``("a", "b")`` needs
    ``a``'s tactic before ``b``'s (tactics stack axes on a dim in the order they run).
    Unknown axes, an axis used twice, a spec longer than the input's rank: ShardingError
    naming the input and the axis.
    """
    if isinstance(mesh, jax.sharding.Mesh):
        mesh = Mesh(axes=list(mesh.shape.items()))
    entries = _entries(specs, mesh, args, fn, arg_names)
    tactics = []
    for axis in _axis_order(mesh, entries):
        inputs: dict[str, int | Any] = {}
        for e in entries:
            dim = next((k for k, axes in enumerate(e.dims) if axis in axes), None)
            inputs.setdefault(e.pattern, REPLICATED if dim is None else dim)
        tactics.append(ManualPartition(inputs, axis=axis, name=f"spec:{axis}"))
    return tactics


def _entries(specs: Any, mesh: Mesh, args: Sequence[Any] | None, fn: Callable | None,
             arg_names: Sequence[str] | None) -> list[_Entry]:
    """The specs as ``_Entry``s (``None`` specs dropped), each checked against the mesh (and the
    shapes of ``args`` when given)."""
    if isinstance(specs, PartitionSpec):
        specs = {"*": specs}
    if isinstance(specs, Mapping):
        pairs = [(str(k), v, f"pattern {str(k)!r}") for k, v in specs.items()]
    elif isinstance(specs, (tuple, list)):
        pairs = _named_leaves(specs, args, fn, arg_names)
    else:
        raise ArgumentError(f"from_partition_specs: specs must be a dict of input name -> PartitionSpec, a tuple "
                            f"with one pytree of PartitionSpec per argument, or one PartitionSpec; got "
                            f"{type(specs).__name__}")
    out, kept = [], []
    for pattern, spec, what in pairs:
        if spec is None:
            continue
        if not isinstance(spec, PartitionSpec):
            raise ArgumentError(f"from_partition_specs: {what} maps to {spec!r}, which is not a PartitionSpec or None")
        out.append(_Entry(pattern, what, _spec_dims(spec, mesh, what)))
        kept.append(spec)
    if args is not None:
        _check_shapes(out, kept, _shapes(args, fn, arg_names), mesh)
    return out


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _named_leaves(specs: Sequence[Any], args: Sequence[Any] | None, fn: Callable | None,
                  arg_names: Sequence[str] | None) -> list[tuple[str, Any, str]]:
    """``(exact-name pattern, spec, what)`` per input, from a tuple of per-argument specs. With
    ``args`` a spec may stand for a whole subtree (a pytree prefix, as ``jax.jit`` allows)."""
    if fn is None and arg_names is None:
        raise ArgumentError("from_partition_specs: a tuple of per-argument specs needs the argument names: pass fn= "
                            "(its signature names them, as the tracer does) or arg_names=")
    leaves, tree = jax.tree_util.tree_flatten(tuple(specs), is_leaf=_is_spec_leaf)
    if args is None:
        names = input_names(fn, jax.tree_util.tree_unflatten(tree, [object() for _ in leaves]), arg_names)
        return [(glob.escape(n), spec, f"input {n!r}") for n, spec in zip(names, leaves)]
    try:
        subtrees = tree.flatten_up_to(tuple(args))
    except (ValueError, TypeError) as exc:
        raise ArgumentError(f"from_partition_specs: the specs are not a pytree prefix of the arguments: {exc}") from None
    names = iter(input_names(fn, tuple(args), arg_names))
    return [(glob.escape(n), spec, f"input {n!r}") for spec, sub in zip(leaves, subtrees)
            for n in [next(names) for _ in jax.tree_util.tree_leaves(sub)]]


def _shapes(args: Sequence[Any], fn: Callable | None, arg_names: Sequence[str] | None) -> dict[str, tuple[int, ...]]:
    if fn is None and arg_names is None:
        raise ArgumentError("from_partition_specs: args= needs the argument names too: pass fn= or arg_names=")
    names = input_names(fn, tuple(args), arg_names)
    return {n: tuple(np.shape(x)) for n, x in zip(names, jax.tree_util.tree_leaves(tuple(args)))}


def _spec_dims(spec: PartitionSpec, mesh: Mesh, what: str) -> tuple[tuple[str, ...], ...]:
    dims, seen = [], set()
    for k, entry in enumerate(spec):
        if entry is PartitionSpec.UNCONSTRAINED:
            raise ShardingError(f"from_partition_specs: {what}: dim {k} is UNCONSTRAINED in {spec}; give the axes "
                                "(or None), or map the whole input to None to leave it to propagation")
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for a in axes:
            if a not in mesh.axis_names:
                raise ShardingError(f"from_partition_specs: {what}: {spec} names axis {a!r}, which is not in {mesh}; "
                                    f"use one of {list(mesh.axis_names)}")
            if a in seen:
                raise ShardingError(f"from_partition_specs: {what}: {spec} uses axis {a!r} twice; an axis can tile "
                                    "one dim at most")
            seen.add(a)
        dims.append(axes)
    return tuple(dims)


def _check_shapes(entries: Sequence[_Entry], specs: Sequence[PartitionSpec], shapes: Mapping[str, tuple[int, ...]],
                  mesh: Mesh) -> None:
    """Each input against the first entry that matches it (as ``ManualPartition`` resolves them)."""
    claimed: set[str] = set()
    for e, spec in zip(entries, specs):
        hits = [n for n in shapes if n not in claimed and fnmatch.fnmatchcase(n, e.pattern)]
        if not hits and not any(fnmatch.fnmatchcase(n, e.pattern) for n in shapes):
            raise ShardingError(f"from_partition_specs: {e.what} matches no input; inputs are named by pytree path, "
                                f"e.g. {', '.join(list(shapes)[:4])}")
        claimed.update(hits)
        for name in hits:
            shape = shapes[name]
            if len(e.dims) > len(shape):
                raise ShardingError(f"from_partition_specs: {e.what}: {spec} has {len(e.dims)} entries but input "
                                    f"{name!r} has rank {len(shape)} (shape {shape}); drop the extra entries")
            for k, axes in enumerate(e.dims):
                if shape[k] % mesh.group_size(axes):
                    raise ShardingError(f"from_partition_specs: {e.what}: dim {k} of input {name!r} (size {shape[k]}) "
                                        f"is not divisible by axes {axes} of {mesh} (product {mesh.group_size(axes)})")


def _axis_order(mesh: Mesh, entries: Sequence[_Entry]) -> list[str]:
    """Mesh axes in mesh order, except that each ``("a", "b")`` puts ``a`` before ``b``."""
    after: dict[str, set[str]] = {a: set() for a in mesh.axis_names}     # axis -> axes that must come first
    where: dict[tuple[str, str], str] = {}
    for e in entries:
        for axes in e.dims:
            for a, b in zip(axes, axes[1:]):
                after[b].add(a)
                where.setdefault((a, b), e.what)
    order: list[str] = []
    while len(order) < len(mesh.axis_names):
        ready = [a for a in mesh.axis_names if a not in order and after[a] <= set(order)]
        if not ready:
            left = [a for a in mesh.axis_names if a not in order]
            clash = "; ".join(f"{w} puts {a!r} before {b!r}" for (a, b), w in where.items() if a in left and b in left)
            raise ShardingError(f"from_partition_specs: the specs stack axes {left} on dims in contradictory orders "
                                f"({clash}); one schedule stacks the axes of every dim in one order")
        order.append(ready[0])
    return order
