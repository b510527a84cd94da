"""What every scenario's training step shares: parameter initialisation from a scenario's shapes and
kinds, Adam's state and update (float32 moments, bias-corrected), and the step that differentiates a
loss and applies the update (``loss, params, opt = step(params, opt, batch)``).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from partir_emu.errors import ScenarioError
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

def adam_layout(param_shapes: dict) -> dict:
    """Adam's state as a nested dict of ``(shape, dtype)``: float32 moments shaped like the parameters
    and an int32 count (what :func:`adam_init` makes)."""
    moments = map_leaves(param_shapes, lambda s: (tuple(s), np.float32))
    return {"mu": moments, "nu": dict(moments), "count": ((), np.int32)}

def train_step(loss_fn: Any, *, lr: float, grads_only: bool = False, microbatches: int = 1,
               value_and_grad: Any = None) -> Any:
    """``(params, opt, batch) -> (loss, new_params, new_opt)``: value_and_grad of ``loss_fn`` then
    :func:`adam_update`; with ``grads_only`` stopped before the optimizer: ``-> (loss, grads)``.

    ``microbatches = K > 1`` is gradient accumulation: the batch's leading dim ``B`` is cut into K
    micro-batches of ``B / K`` rows, a ``lax.scan`` runs the forward and backward pass on each (so
    one micro-batch's activations are live at a time), the losses and gradients are summed in the
    carry and divided by K, and the optimizer steps once. Micro-batch ``j`` holds rows
    ``j, K + j, 2K + j, ...``: the batch is reshaped ``[B] -> [B/K, K]`` and its two dims swapped, so
    a batch sharding of ``B`` stays on every micro-batch's rows (each device holds its own slice of
    every micro-batch, as data-parallel accumulation does) instead of one micro-batch per device
    group. The mean over K equal micro-batches of their mean losses is the batch's mean loss.

    ``value_and_grad(params, batch) -> (loss, grads)``, when given, replaces ``jax.value_and_grad(loss_fn)``
    (a schedule that computes its gradient itself: ``scenarios.transformer.pipeline_1f1b``).
    """
    import jax
    import jax.numpy as jnp

    def grads_of(params, batch):
        if value_and_grad is not None:
            return value_and_grad(params, batch)
        if microbatches == 1:
            return jax.value_and_grad(loss_fn)(params, batch)
        k = microbatches

        def split(x):
            if x.shape[0] % k:
                raise ScenarioError(f"microbatches={k} does not divide the batch dim {x.shape[0]}; "
                                    "choose a batch that is a multiple of microbatches")
            return jnp.swapaxes(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1)

        def body(acc, micro):
            loss, grads = jax.value_and_grad(loss_fn)(params, micro)
            return (acc[0] + loss, jax.tree.map(jnp.add, acc[1], grads)), None

        micro = jax.tree.map(split, batch)
        # the loss's own dtype (float64 when the verdict runs the reference under jax_enable_x64)
        loss_type = jax.eval_shape(loss_fn, params, jax.tree.map(lambda x: x[0], micro))
        zero = (jnp.zeros((), loss_type.dtype), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(body, zero, micro)
        return loss / k, jax.tree.map(lambda g: g / np.asarray(k, g.dtype), grads)

    def step(params, opt, batch):
        loss, grads = grads_of(params, batch)
        if grads_only:
            return loss, grads
        new_params, new_opt = adam_update(grads, opt, params, lr=lr)
        return loss, new_params, new_opt

    return step

def op_scope(name: str):
    """``jax.named_scope("kernel:op.NAME")``: the equations inside are one framework op (PyTorch's
    ``F.layer_norm``, ``F.gelu``, a fused Adam step, ...), one kernel under an eager stack
    (``hwmodels.compute.fusion``); XLA stacks ignore the tag. It never changes what is computed."""
    import jax

    return jax.named_scope(f"kernel:op.{name}")


def adam_update(grads: Any, state: dict, params: Any, *, lr: float = 1e-3, b1: float = 0.9,
                b2: float = 0.999, eps: float = 1e-8) -> tuple[Any, dict]:
    """One Adam step with bias correction. Returns ``(new_params, new_state)``."""
    import jax
    import jax.numpy as jnp

    # one framework op (PyTorch's fused / multi-tensor Adam step): one kernel under an eager stack
    with op_scope("adam"):
        count = state["count"] + jnp.int32(1)
        t = count.astype(jnp.float32)
        # b ** t written as exp(t * log b): only exp and mul, no pow.
        bc1 = 1.0 - jnp.exp(t * np.float32(math.log(b1)))
        bc2 = 1.0 - jnp.exp(t * np.float32(math.log(b2)))
        mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state["mu"], grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * (g * g), state["nu"], grads)
        new_params = jax.tree.map(lambda p, m, v: p - lr * (m / bc1) / (jnp.sqrt(v / bc2) + eps), params, mu, nu)
        return new_params, {"mu": mu, "nu": nu, "count": count}
