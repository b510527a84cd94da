"""A deep MLP regression step: ``layers`` blocks of two linears with gelu, MSE loss, Adam.

Block ``i`` (``params/layer_{i}/...``)::

    h = gelu(x @ w_in + b_in)           w_in [d_in, hidden], b_in [hidden]
    x = h @ w_out + b_out               w_out [hidden, d_in] (last block: [hidden, d_out])
    x = gelu(x)                         (not after the last block)

Loss: ``mean((x - y) ** 2)`` with ``batch/x`` [batch, d_in], ``batch/y`` [batch, d_out].

Parameter count (closed form, :func:`param_count`)::

    layers * (d_in*hidden + hidden) + (layers-1) * (hidden*d_in + d_in) + hidden*d_out + d_out

Model FLOPs of one training step (:func:`model_flops`, the numerator of MFU): ``6 * N * batch``
with ``N`` the parameters that take part in matmuls (the weight matrices; biases are elementwise),
i.e. 2 FLOPs per weight per example forward and 4 backward; no elementwise FLOPs::

    N = layers*d_in*hidden + (layers-1)*hidden*d_in + hidden*d_out

Presets: ``tiny`` (emulation, 1,880 params), ``small`` (emulation, 494,016),
``full`` (simulation only, 1,073,905,664 ≈ 1.07 B params).

Megatron (``mp``): every block is a column/row pair: ``w_in`` dim 1, ``b_in``
dim 0, ``w_out`` dim 0; ``b_out`` replicated.
"""
from __future__ import annotations

import math

import numpy as np

from scenarios.common import Config, ParamKind, Scenario
from scenarios.strategies import make_strategies
from scenarios.training import train_step

SIZE_NAMES = ("batch", "d_in", "hidden", "d_out", "layers")

PRESETS: dict[str, Config] = {
    "tiny": dict(batch=8, d_in=16, hidden=32, d_out=8, layers=2),
    "small": dict(batch=64, d_in=128, hidden=512, d_out=64, layers=4),
    "full": dict(batch=2048, d_in=4096, hidden=16384, d_out=4096, layers=8),
}

# The last block's w_out/b_out are [hidden, d_out]/[d_out]: a kind may cover several
# shapes; strategies check every one of them.
PARAM_KINDS = (
    ParamKind("layer_*/w_in", 2, mp_dim=1),
    ParamKind("layer_*/b_in", 1, mp_dim=0),
    ParamKind("layer_*/w_out", 2, mp_dim=0),
    ParamKind("layer_*/b_out", 1, mp_dim=None),
)


def _width_out(cfg: Config, i: int) -> int:
    return cfg["d_out"] if i == cfg["layers"] - 1 else cfg["d_in"]


def param_shapes(cfg: Config) -> dict:
    return {
        f"layer_{i}": {
            "w_in": (cfg["d_in"], cfg["hidden"]),
            "b_in": (cfg["hidden"],),
            "w_out": (cfg["hidden"], _width_out(cfg, i)),
            "b_out": (_width_out(cfg, i),),
        }
        for i in range(cfg["layers"])
    }


def batch_shapes(cfg: Config) -> dict:
    return {"x": ((cfg["batch"], cfg["d_in"]), np.float32),
            "y": ((cfg["batch"], cfg["d_out"]), np.float32)}


def param_count(cfg: Config) -> int:
    L, d, h, o = cfg["layers"], cfg["d_in"], cfg["hidden"], cfg["d_out"]
    return L * (d * h + h) + (L - 1) * (h * d + d) + h * o + o


def model_flops(cfg: Config) -> int:
    L, d, h, o = cfg["layers"], cfg["d_in"], cfg["hidden"], cfg["d_out"]
    return 6 * (L * d * h + (L - 1) * h * d + h * o) * cfg["batch"]


def make_params(cfg: Config, rng: np.random.Generator) -> dict:
    out = {}
    for i, shapes in enumerate(param_shapes(cfg).values()):
        layer = {}
        for name, shape in shapes.items():
            if name.startswith("w"):
                layer[name] = (rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32)
            else:
                layer[name] = np.zeros(shape, np.float32)
        out[f"layer_{i}"] = layer
    return out


def make_batch(cfg: Config, rng: np.random.Generator) -> dict:
    return {name: rng.standard_normal(shape).astype(dtype) for name, (shape, dtype) in batch_shapes(cfg).items()}


def gelu(x):
    """gelu, tanh approximation."""
    import jax.numpy as jnp

    c = np.float32(math.sqrt(2.0 / math.pi))
    return 0.5 * x * (1.0 + jnp.tanh(c * (x + 0.044715 * (x * x * x))))


def make_step(cfg: Config, *, lr: float = 1e-2, grads_only: bool = False):
    """The training step ``(params, opt, batch) -> (loss, new_params, new_opt)``; with
    ``grads_only`` the same step stopped before the optimizer: ``-> (loss, grads)``."""
    import jax.numpy as jnp

    layers = cfg["layers"]

    def loss_fn(params, batch):
        x = batch["x"]
        for i in range(layers):
            p = params[f"layer_{i}"]
            h = gelu(x @ p["w_in"] + p["b_in"])
            x = h @ p["w_out"] + p["b_out"]
            if i < layers - 1:
                x = gelu(x)
        err = x - batch["y"]
        return jnp.mean(err * err)

    return train_step(loss_fn, lr=lr, grads_only=grads_only)


SCENARIO = Scenario(
    name="mlp",
    description="deep MLP regression (gelu, MSE, Adam)",
    size_names=SIZE_NAMES,
    presets=PRESETS,
    simulation_only=frozenset({"full"}),
    make_step=make_step,
    param_shapes=param_shapes,
    batch_shapes=batch_shapes,
    make_params=make_params,
    make_batch=make_batch,
    param_count=param_count,
    model_flops=model_flops,
    param_kinds=PARAM_KINDS,
    strategies=make_strategies(PARAM_KINDS, param_shapes),
)

__all__ = ["SCENARIO", "PRESETS", "SIZE_NAMES", "param_count", "model_flops", "param_shapes", "make_step"]
