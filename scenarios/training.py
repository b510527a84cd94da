"""What every scenario's training step shares: parameter initialisation from a scenario's shapes and
kinds, Adam's state and update (float32 moments, bias-corrected), and the step that differentiates a
loss and applies the update (``loss, params, opt = step(params, opt, batch)``).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from scenarios.trees import map_leaves


def init_params(shapes: dict, rng: np.random.Generator) -> dict:
    """Parameters for a nested dict of shapes: leaves named ``scale`` are ones, other vectors
    (biases, norm biases) zeros, matrices and kernels ~ N(0, 1/fan_in) with fan_in the product of
    all dims but the last (a matrix's rows, a conv kernel's window × input channels)."""
    def init(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name == "scale":
            return np.ones(shape, np.float32)
        if len(shape) == 1:
            return np.zeros(shape, np.float32)
        return (rng.standard_normal(shape) / math.sqrt(math.prod(shape[:-1]))).astype(np.float32)

    def walk(tree: dict) -> dict:
        return {k: walk(v) if isinstance(v, dict) else init(k, tuple(v)) for k, v in tree.items()}
    return walk(shapes)

def adam_init(params: Any) -> dict:
    """``{"mu": zeros like params, "nu": zeros like params, "count": int32 0}``.

    Works on numpy arrays (returns numpy, without importing jax: MPI ranks build
    their inputs this way) and on jax arrays/tracers (returns jax).
    """
    def leaves(t):
        return [x for v in t.values() for x in leaves(v)] if isinstance(t, dict) else [t]

    if all(isinstance(x, np.ndarray) for x in leaves(params)):
        def zeros(t):
            return map_leaves(t, lambda x: np.zeros(x.shape, x.dtype)) if isinstance(t, dict) \
                else np.zeros(t.shape, t.dtype)
        return {"mu": zeros(params), "nu": zeros(params), "count": np.zeros((), np.int32)}
    import jax
    import jax.numpy as jnp
    return {"mu": jax.tree.map(jnp.zeros_like, params), "nu": jax.tree.map(jnp.zeros_like, params),
            "count": jnp.zeros((), jnp.int32)}

def train_step(loss_fn: Any, *, lr: float, grads_only: bool = False) -> Any:
    """``(params, opt, batch) -> (loss, new_params, new_opt)``: value_and_grad of ``loss_fn`` then
    :func:`adam_update`; with ``grads_only`` stopped before the optimizer: ``-> (loss, grads)``."""
    import jax

    def step(params, opt, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        if grads_only:
            return loss, grads
        new_params, new_opt = adam_update(grads, opt, params, lr=lr)
        return loss, new_params, new_opt

    return step

def adam_update(grads: Any, state: dict, params: Any, *, lr: float = 1e-3, b1: float = 0.9,
                b2: float = 0.999, eps: float = 1e-8) -> tuple[Any, dict]:
    """One Adam step with bias correction. Returns ``(new_params, new_state)``."""
    import jax
    import jax.numpy as jnp

    count = state["count"] + jnp.int32(1)
    t = count.astype(jnp.float32)
    # b ** t written as exp(t * log b): only exp and mul, no pow.
    bc1 = 1.0 - jnp.exp(t * np.float32(math.log(b1)))
    bc2 = 1.0 - jnp.exp(t * np.float32(math.log(b2)))
    mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state["mu"], grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * (g * g), state["nu"], grads)
    new_params = jax.tree.map(lambda p, m, v: p - lr * (m / bc1) / (jnp.sqrt(v / bc2) + eps), params, mu, nu)
    return new_params, {"mu": mu, "nu": nu, "count": count}
