"""IR dtype names → numpy dtypes, for the runtime (which never imports jax).

``bfloat16`` (and the other ml_dtypes types) need the optional ``ml_dtypes``
package; it ships with jax, so it is present wherever jax was, and a rank
without it gets a clear error only if a program actually uses such a dtype.
"""
from __future__ import annotations

import functools

import numpy as np

from partir_emu.errors import EmulationError


@functools.cache
def np_dtype(name: str) -> np.dtype:
    """The numpy dtype for an IR dtype name (``"float32"``, ``"bfloat16"``, ...)."""
    try:
        return np.dtype(name)
    except TypeError:
        pass
    try:
        import ml_dtypes  # optional: only programs with bfloat16 / float8 values need it
    except ImportError:
        raise EmulationError(f"dtype {name!r} needs the ml_dtypes package; install it (pip install ml_dtypes)") from None
    try:
        return np.dtype(getattr(ml_dtypes, name))
    except AttributeError:
        raise EmulationError(f"unknown dtype {name!r}") from None


def is_float(dt: np.dtype) -> bool:
    """True for numpy floats and the ml_dtypes floats (bfloat16, float8_*)."""
    return dt.kind == "f" or "float" in dt.name
