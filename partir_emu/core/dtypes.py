"""IR dtype names → numpy dtypes, for the runtime (which never imports jax).

``bfloat16`` (and the other ml_dtypes types) need the optional ``ml_dtypes``
package; it ships with jax, so it is present wherever jax was, and a rank
without it gets a clear error only if a program actually uses such a dtype.
"""
from __future__ import annotations

import functools

import numpy as np

from partir_emu.errors import ArtifactError, EmulationError

# The dtype names an IR value may carry: jax's array dtypes. A saved program naming anything else
# (``object``, a structured or sub-array type, a string type) was not written by partir_emu.
IR_DTYPES = frozenset({
    "bool", "int4", "int8", "int16", "int32", "int64", "uint4", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "bfloat16", "complex64", "complex128",
    "float4_e2m1fn", "float8_e3m4", "float8_e4m3", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e4m3b11fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"})


def check_name(name: object, where: str) -> str:
    """``name`` if it is one of :data:`IR_DTYPES`, else :class:`ArtifactError` naming it and ``where``."""
    if not isinstance(name, str) or name not in IR_DTYPES:
        raise ArtifactError(f"{where}: dtype {str(name)[:40]!r} is not an array dtype of jax "
                            f"(one of {', '.join(sorted(IR_DTYPES)[:6])}, …); the file was not written by partir_emu")
    return name


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


def is_low_float(dt: np.dtype) -> bool:
    """A float narrower than float32 (bfloat16, float16, float8_*). CPUs have no arithmetic for
    these: XLA CPU computes each op in float32 and rounds its result to the narrow type, and the
    numpy impls do the same (ml_dtypes' own ufuncs already round after each op)."""
    return is_float(dt) and dt.itemsize < 4


# -- arrays in files: ml_dtypes arrays are saved by numpy as raw void ('|V2'); store a name ----------
DTYPES_KEY = "__dtypes__"   # .npz entry: JSON {key: dtype name} for the arrays stored as raw bits


def storable(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``arrays`` ready for ``np.savez`` without pickles: an ml_dtypes array (``dtype.kind == 'V'``)
    is stored as unsigned ints of its width and its dtype name goes to the ``DTYPES_KEY`` entry."""
    import json  # why: only writers of files need it
    out: dict[str, np.ndarray] = {}
    names: dict[str, str] = {}
    for k, x in arrays.items():
        x = np.asarray(x)
        if x.dtype.kind == "V" and x.dtype.fields is None:
            names[k] = x.dtype.name
            x = np.ascontiguousarray(x).view(f"u{x.dtype.itemsize}")
        out[k] = x
    if names:
        out[DTYPES_KEY] = np.asarray(json.dumps(names))
    return out


def restored(z: np.lib.npyio.NpzFile, key: str) -> np.ndarray:
    """Entry ``key`` of an .npz written from :func:`storable`, with its ml_dtypes dtype back."""
    x = z[key]
    if not x.dtype.isnative:        # written on a big-endian machine: the same numbers, in this one's order
        x = x.astype(x.dtype.newbyteorder("="))
    if DTYPES_KEY in z.files:
        import json  # why: only readers of files need it
        name = json.loads(str(z[DTYPES_KEY][()])).get(key)
        if name is not None:
            dt = np_dtype(name)
            if dt.itemsize != x.dtype.itemsize:
                raise EmulationError(f"array {key!r} is stored as {x.dtype} but named {name}: the file is corrupt")
            x = x.view(dt)
    return x


def array_files(z: np.lib.npyio.NpzFile) -> list[str]:
    """The array entries of an .npz from :func:`storable` (without ``DTYPES_KEY``)."""
    return [k for k in z.files if k != DTYPES_KEY]
