"""JAX function + example pytrees → partir IR :class:`Program`.

This is the compiler module that imports jax (with its helpers ``trace_keys``, PRNG key arrays
in their physical form, and ``trace_unsupported``, the report of every unsupported primitive at
once). It walks the closed jaxpr,
inlines nested calls (jit/pjit, closed_call, custom_jvp/custom_vjp, remat) and
normalizes primitive parameters to plain Python data, so that everything
downstream (rules, lowering, the numpy interpreter, the hardware models, the
file format) is free of jax types.

Inputs are named by pytree path with the function's argument name first
(``params/layer_3/mlp/w_in``); outputs by their path (``0``, ``1/layer_3/...``).
"""
from __future__ import annotations

import enum
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import source_info_util
from jax.extend import core as jcore

from partir_emu.compiler.tracing.idioms import find_idioms
from partir_emu.compiler.tracing.keys import physical_aval, physical_params, physical_value
from partir_emu.compiler.tracing.loops import empty_as_zeros, select_cond, trace_scan, trace_while
from partir_emu.compiler.tracing.positional import REDUCTIONS, named_axes, positional_reduction
from partir_emu.compiler.tracing.unsupported import UnsupportedReport
from partir_emu.core.analysis import dead_code_elimination
from partir_emu.core.ir import Eqn, Literal, Program, Var
from partir_emu.errors import TraceError, UnsupportedPrimitiveError
from partir_emu.primitives import get

# Call-like primitives that are inlined, and where their body lives.
_CALL_PARAMS = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
    "checkpoint": "jaxpr", "remat": "jaxpr", "remat2": "jaxpr", "custom_lin": None,
}

# Identities that only tell jax something (``checkpoint_name``: which values a remat policy saves,
# decided by jax before we see the jaxpr): their output is their input.
_IDENTITY = frozenset({"name"})

# Parameters that carry no meaning for us (layout, sharding hints, jaxprs of
# reductions whose kind is in the primitive name). Dropped during normalization.
# Control flow (see trace_loops: scan as one loop equation, cond as a select over its branches).
_CONTROL = {"scan": trace_scan, "while": trace_while, "cond": select_cond, "empty": empty_as_zeros, "empty2": empty_as_zeros}

_DROP = {"sharding", "out_sharding", "precision", "accumulation_type", "update_jaxpr", "update_consts",
         "weak_type", "out_dtype", "algorithm", "transpose_algorithm"}


def normalize_param(v: Any) -> Any:
    """jax parameter value → ints, floats, bools, strings, tuples, dicts, None."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, enum.Enum):
        return v.name
    if isinstance(v, jcore.Primitive):  # select_and_scatter_add's select_prim: by name ("ge")
        return v.name
    if hasattr(v, "_fields"):  # NamedTuple: Gather/ScatterDimensionNumbers
        return {f: normalize_param(getattr(v, f)) for f in v._fields}
    if isinstance(v, (tuple, list)):
        return tuple(normalize_param(x) for x in v)
    if isinstance(v, np.ndarray) and v.ndim == 0:
        return normalize_param(v.item())
    try:
        return np.dtype(v).name
    except TypeError:
        pass
    if hasattr(v, "name") and isinstance(v.name, str) and "dtype" in type(v).__name__.lower():
        return np.dtype(v).name
    raise TraceError(f"cannot normalize primitive parameter {v!r} of type {type(v).__name__}")


def _dtype_name(aval) -> str:
    return np.dtype(aval.dtype).name


def _path_str(path) -> str:
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(str(k.name))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return "/".join(parts)


def input_names(fn: Callable, args: Sequence[Any], arg_names: Sequence[str] | None = None) -> list[str]:
    if arg_names is None:
        try:
            params = [p.name for p in inspect.signature(fn).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            params = []
        arg_names = [params[i] if i < len(params) else f"arg{i}" for i in range(len(args))]
    names = []
    for name, a in zip(arg_names, args):
        leaves, _ = jax.tree_util.tree_flatten_with_path(a)
        for path, _ in leaves:
            p = _path_str(path)
            names.append(f"{name}/{p}" if p else name)
    return names


class _Builder:
    def __init__(self) -> None:
        self.next_id = 0
        self.eqns: list[Eqn] = []
        self.consts: list[tuple[Var, np.ndarray]] = []
        self.unsupported = UnsupportedReport()   # raised by trace() once the whole function is seen
        self.call_sites: list[Any] = []           # source infos of the calls being inlined, outermost first

    def new_var(self, aval) -> Var:
        aval = physical_aval(aval)   # a PRNG key array is its uint32 key data
        v = Var(self.next_id, tuple(int(d) for d in aval.shape), _dtype_name(aval))
        self.next_id += 1
        return v

    def shape_of(self, v: Any) -> tuple[tuple[int, ...], str]:
        """The IR shape and dtype of a jaxpr variable (PRNG keys in their physical form)."""
        aval = physical_aval(v.aval)
        return tuple(int(d) for d in aval.shape), _dtype_name(aval)

    def const(self, value: Any) -> Var | Literal:
        arr = np.asarray(physical_value(value))
        if arr.ndim == 0 and arr.dtype.kind in "biuf":
            return Literal(arr.item(), arr.dtype.name)
        v = Var(self.next_id, tuple(arr.shape), arr.dtype.name)
        self.next_id += 1
        self.consts.append((v, np.array(arr)))
        return v

    def inline(self, jaxpr, consts: Sequence[Any], args: Sequence[Var | Literal], outer: str = "",
               outer_stack: str = "") -> list[Var | Literal]:
        env: dict[Any, Var | Literal] = {}
        for cv, c in zip(jaxpr.constvars, consts):
            env[cv] = self.const(c)
        for iv, a in zip(jaxpr.invars, args):
            env[iv] = a

        def read(x):
            if isinstance(x, jcore.Literal):
                return self.const(x.val)
            return env[x]

        for e in jaxpr.eqns:
            name = e.primitive.name
            ins = [read(x) for x in e.invars]
            if name in _CALL_PARAMS:
                key = _CALL_PARAMS[name]
                body = e.params.get(key) if key else None
                if body is None:
                    raise UnsupportedPrimitiveError(f"call primitive {name!r} at {_where(e) or outer} has no body "
                                                    "to inline")
                where = _where(e) or outer
                stack = _stack(e, outer_stack)
                self.call_sites.append(e.source_info)   # a nested traceback starts at its call
                if hasattr(body, "jaxpr"):  # ClosedJaxpr
                    results = self.inline(body.jaxpr, body.consts, ins, where, stack)
                else:
                    results = self.inline(body, [], ins, where, stack)
                self.call_sites.pop()
                for ov, o in zip(e.outvars, results):
                    env[ov] = o
                continue
            if name in _IDENTITY:
                env.update(zip(e.outvars, ins))
                continue
            if name in _CONTROL:
                where = _where(e) or outer
                stack = _stack(e, outer_stack)
                self.call_sites.append(e.source_info)
                results = _CONTROL[name](self, e, ins, where, stack, _kernel(stack), self.shape_of)
                self.call_sites.pop()
                env.update(zip(e.outvars, results))
                continue
            where = _where(e) or outer
            if name in REDUCTIONS:      # psum & co. over a vmapped axis: a reduction (tracing/positional.py)
                why = named_axes(e)
                if why:
                    self.unsupported.add(why, [e.source_info, *reversed(self.call_sites)], where)
                    env.update(zip(e.outvars, [self.new_var(ov.aval) for ov in e.outvars]))
                else:
                    env.update(zip(e.outvars, positional_reduction(self, e, ins, where,
                                                                   _kernel(_stack(e, outer_stack)))))
                continue
            entry = get(name)
            raw = physical_params(name, dict(e.params), [x.aval for x in e.invars], [v.aval for v in e.outvars])
            outs = [self.new_var(ov.aval) for ov in e.outvars]
            if entry is None or not entry.traceable or isinstance(raw, str):
                # keep going: the report names every unsupported primitive of the function at once
                self.unsupported.add(raw if isinstance(raw, str) else name,
                                     [e.source_info, *reversed(self.call_sites)], where)
                env.update(zip(e.outvars, outs))
                continue
            params = {k: normalize_param(v) for k, v in raw.items() if k not in _DROP}
            self.eqns.append(Eqn(name, tuple(ins), tuple(outs), params, where,
                                 _kernel(_stack(e, outer_stack))))
            for ov, o in zip(e.outvars, outs):
                env[ov] = o
        return [read(x) for x in jaxpr.outvars]


_KERNEL = re.compile(r"kernel:([A-Za-z0-9_.-]+)")


def _stack(e, outer: str) -> str:
    """An equation's full name stack: a nested jaxpr's stacks are relative to its call's."""
    own = str(getattr(e.source_info, "name_stack", ""))
    return f"{outer}/{own}" if outer else own


def _kernel(stack: str) -> str:
    """The hand-fused kernel of an equation with name stack ``stack``: the innermost ``kernel:NAME``
    (``jax.named_scope``), as ``NAME/bwd`` when the gradient made it (under ``transpose(``, and not
    in a rematerialised forward recomputation), else ""."""
    found = _KERNEL.findall(stack)
    if not found:
        return ""
    tail = stack.rsplit("rematted_computation", 1)[-1]
    return found[-1] + ("/bwd" if "transpose(" in tail else "")


def _where(e) -> str:
    try:
        return source_info_util.summarize(e.source_info)
    except Exception:  # source info is best-effort only
        return ""


def trace(fn: Callable, *args: Any, arg_names: Sequence[str] | None = None) -> Program:
    """Trace ``fn(*args)`` (args are pytrees of arrays or ShapeDtypeStructs) into a Program."""
    names = input_names(fn, args, arg_names)
    try:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    except UnsupportedPrimitiveError:
        raise
    except (TypeError, ValueError) as exc:
        raise TraceError(f"tracing {getattr(fn, '__name__', fn)!r} failed: {exc}") from exc
    b = _Builder()
    inputs = [b.new_var(v.aval) for v in closed.jaxpr.invars]
    assert len(inputs) == len(names), (len(inputs), len(names))
    outs = b.inline(closed.jaxpr, closed.consts, inputs)
    b.unsupported.raise_if_any(getattr(fn, "__name__", repr(fn)))
    leaves, _ = jax.tree_util.tree_flatten_with_path(out_shape)
    out_names = [_path_str(p) or "out" for p, _ in leaves]
    eqns, consts = dead_code_elimination(b.eqns, b.consts, outs)
    # jnp.roll's slices and concatenation (and their transpose) as one rotate, partitionable along the
    # rolled dim; a loop's accumulated zero-based scatter-add in place (compiler/tracing/idioms.py)
    return find_idioms(Program(tuple(inputs), tuple(names), tuple(eqns), tuple(outs), tuple(out_names),
                                  tuple(consts)))
