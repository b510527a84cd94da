"""Mixed precision in the scenarios' models, one rule for all: the compute dtype a config asks for,
a cast that emits no equation when it is not needed, and "at least float32" for statistics.

A float32 step run under jax's 64-bit mode (the verdict's float64 reference) must compute in
float64 throughout, so nothing here ever names float32 explicitly as a target.
"""
from __future__ import annotations

from typing import Any

from scenarios.common import Config


def compute_dtype(cfg: Config) -> Any:
    """bfloat16 with ``precision=bf16`` and ``precision=fp8`` (FP8 matmuls inside bfloat16 activations,
    as Transformer Engine runs them: :mod:`scenarios.fp8`); None (keep the inputs' own dtype) otherwise:
    never an explicit float32, so the same step run under jax's 64-bit mode (the verdict's float64
    reference) computes in float64 throughout instead of rounding back to float32 at every cast."""
    import jax.numpy as jnp

    return jnp.bfloat16 if cfg.get("precision", "f32") in ("bf16", "fp8") else None


# precision -> the precision of the step whose float64 run is the verdict's reference: a bf16 step's
# casts to bfloat16 would still round under x64, so its reference drops them (precision=f32). An fp8
# step is its own reference: its quantisers (and the bfloat16 casts around them) are roundings the
# step is defined by and x64 keeps them, while the dots accumulate, and the master weights, Adam and
# the amax bookkeeping compute, in float64 (statistics of bfloat16 values stay float32: :func:`wide`);
# without the bfloat16 casts the quantisers' inputs would differ from every bf16 run's at 1-3 % of the
# elements by a whole FP8 step (docs/verdict.md, "FP8")
REFERENCE_PRECISION = {"bf16": "f32"}


def reference_config(cfg: Config) -> Config:
    """The config whose step, run in float64, is the verdict's reference for ``cfg``'s step."""
    ref = REFERENCE_PRECISION.get(str(cfg.get("precision", "f32")))
    return cfg if ref is None else {**cfg, "precision": ref}


def as_dtype(x: Any, dtype: Any) -> Any:
    """``x`` in ``dtype`` (None: unchanged); no equation at all when it already is."""
    return x if dtype is None or x.dtype == dtype else x.astype(dtype)


def wide(x: Any) -> Any:
    """``x`` in at least float32 (float64 stays float64: see :func:`compute_dtype`)."""
    import jax.numpy as jnp

    return as_dtype(x, jnp.promote_types(x.dtype, jnp.float32))


__all__ = ["REFERENCE_PRECISION", "as_dtype", "compute_dtype", "reference_config", "wide"]
