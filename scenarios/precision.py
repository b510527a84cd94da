"""Mixed precision in the scenarios' models, one rule for all: the compute dtype a config asks for,
a cast that emits no equation when it is not needed, and "at least float32" for statistics.

A float32 step run under jax's 64-bit mode (the verdict's float64 reference) must compute in
float64 throughout, so nothing here ever names float32 explicitly as a target.
"""
from __future__ import annotations

from typing import Any

from scenarios.common import Config


def compute_dtype(cfg: Config) -> Any:
    """bfloat16 with ``precision=bf16``; None (keep the inputs' own dtype) with ``precision=f32``:
    never an explicit float32, so the same step run under jax's 64-bit mode (the verdict's float64
    reference) computes in float64 throughout instead of rounding back to float32 at every cast."""
    import jax.numpy as jnp

    return jnp.bfloat16 if cfg.get("precision", "f32") == "bf16" else None


def as_dtype(x: Any, dtype: Any) -> Any:
    """``x`` in ``dtype`` (None: unchanged); no equation at all when it already is."""
    return x if dtype is None or x.dtype == dtype else x.astype(dtype)


def wide(x: Any) -> Any:
    """``x`` in at least float32 (float64 stays float64: see :func:`compute_dtype`)."""
    import jax.numpy as jnp

    return as_dtype(x, jnp.promote_types(x.dtype, jnp.float32))


__all__ = ["as_dtype", "compute_dtype", "wide"]
