"""PRNG key arrays in a traced function: their physical form in the partir IR.

jax types a key array ``key<fry>[S]``; the partir IR, the numpy interpreter and the rules see its
key data ``uint32[S, 2]`` (what ``jax.random.key_data`` returns), so that every layer below the
trace stays free of jax types. The ``random_*`` entries in :mod:`partir_emu.primitives.bits` take
and return that form. Layout primitives applied to key arrays (a slice of ``split``'s keys, a
squeeze, a broadcast...) get their parameters extended by the trailing key-data dim here.

Only jax's default key implementation (``threefry2x32``) is supported: another one (``rbg``,
``unsafe_rbg``) makes the primitive unsupported, named with its implementation.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax._src import core as jax_core

from partir_emu.primitives.bits import IMPL_NAME

# Layout primitives whose parameters can be extended to the trailing key-data dim.
_LAYOUT = {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "slice", "concatenate", "transpose",
           "rev", "stack", "unstack", "copy", "copy_p"}


def is_key(aval: Any) -> bool:
    dt = getattr(aval, "dtype", None)
    return dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.prng_key)


def physical_aval(aval: Any) -> Any:
    """``key<fry>[S]`` -> ``uint32[S, 2]``; any other aval unchanged."""
    return jax_core.physical_aval(aval) if is_key(aval) else aval


def physical_value(value: Any) -> Any:
    """A constant key array as its key data; any other value unchanged."""
    if is_key(value):
        return np.asarray(jax.random.key_data(value))
    return value


def _impl_name(impl: Any) -> str:
    return str(getattr(impl, "name", impl))


def physical_params(name: str, params: dict, in_avals: Sequence[Any], out_avals: Sequence[Any]) -> dict | str:
    """The (raw) parameters of an equation on physical key arrays, or the reason it cannot be
    expressed on them (a string naming the primitive for the unsupported report)."""
    keys_in = [a for a in in_avals if is_key(a)]
    keys_out = [a for a in out_avals if is_key(a)]
    if not keys_in and not keys_out:
        return params
    impls = {_impl_name(a.dtype._impl) for a in keys_in + keys_out}
    if impls != {IMPL_NAME}:
        return f"{name} (PRNG key implementation {', '.join(sorted(impls))}; only {IMPL_NAME} is supported)"
    if name.startswith("random_") or name == "threefry2x32":
        return {k: (IMPL_NAME if k == "impl" else v) for k, v in params.items()}
    if name not in _LAYOUT:
        return f"{name} (on a PRNG key array)"
    return _extend_layout(name, dict(params), (keys_in or keys_out)[0].ndim, out_avals[0].ndim)


def _extend_layout(name: str, p: dict, ndim_in: int, ndim_out: int) -> dict | str:
    """Parameters of a layout primitive extended by one trailing, untouched dim."""
    if name == "broadcast_in_dim":
        p["shape"] = (*p["shape"], 2)
        p["broadcast_dimensions"] = (*p["broadcast_dimensions"], len(p["shape"]) - 1)
    elif name == "reshape":
        if p.get("dimensions") is not None:
            return "reshape (with dimensions, on a PRNG key array)"
        p["new_sizes"] = (*p["new_sizes"], 2)
    elif name == "squeeze":
        p["dimensions"] = tuple(d % ndim_in for d in p["dimensions"])
    elif name == "expand_dims":
        p["dimensions"] = tuple(d % ndim_out for d in p["dimensions"])
    elif name == "slice":
        p["start_indices"] = (*p["start_indices"], 0)
        p["limit_indices"] = (*p["limit_indices"], 2)
        if p.get("strides") is not None:
            p["strides"] = (*p["strides"], 1)
    elif name == "transpose":
        p["permutation"] = (*p["permutation"], len(p["permutation"]))
    elif name in ("stack", "unstack"):
        p["axis"] = p["axis"] % (ndim_out if name == "stack" else ndim_in)
    return p
