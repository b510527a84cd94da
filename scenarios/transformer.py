"""A decoder-only language-model training step (GPT-style, pre-layernorm), plain JAX.

Forward::

    x = embed/tokens[tokens] + embed/pos                     gather; its gradient is a scatter-add
    per layer i (params/layer_{i}/...):
        h = ln1(x);  q, k, v = h @ attn/w_q, h @ attn/w_k, h @ attn/w_v      [d_model, d_model] each
        split heads -> scores = einsum(q, k) / sqrt(d_head); causal mask (iota >=, where)
        softmax (max subtracted) -> einsum(p, v) -> merge heads -> @ attn/w_o;  x = x + that
        h = ln2(x);  x = x + gelu(h @ mlp/w_in + mlp/b_in) @ mlp/w_out + mlp/b_out
    logits = final_ln(x) @ unembed/w                          [d_model, vocab], untied
    loss = mean cross-entropy(log_softmax(logits), one_hot(targets))

``batch/tokens`` and ``batch/targets`` are int32 [batch, seq]; ``targets`` are
the next tokens (``make_inputs`` draws random tokens and shifts them by one).
Adam (by hand, ``scenarios.common.adam_update``); float32 everywhere. ``remat=1`` wraps
each layer in ``jax.checkpoint`` (the backward pass recomputes the layer's activations;
the compiler inlines the recomputation, so memory and time models see it).

Parameter count (closed form, :func:`param_count`), with d = d_model, f = d_ff::

    vocab*d + seq*d                                  embeddings
    + layers * (4*d*d + 2*d*f + f + d + 4*d)         attention, MLP (+biases), two layernorms
    + 2*d + d*vocab                                  final layernorm, unembedding

Presets: ``tiny`` (emulation, 5,504 params), ``small`` (emulation, 930,560),
``t32`` (simulation only, 2,780,124,160 ≈ 2.78 B), ``t48`` (simulation only,
5,752,510,464 ≈ 5.75 B).

Megatron (``mp``): ``w_q``/``w_k``/``w_v`` and ``mlp/w_in`` column-parallel
(dim 1; ``mlp/b_in`` dim 0), ``w_o`` and ``mlp/w_out`` row-parallel (dim 0);
needs ``heads`` and ``d_model`` divisible by the ``model`` axis.
"""
from __future__ import annotations

import math

import numpy as np

from partir_emu.errors import ScenarioError
from scenarios.common import Config, ParamKind, Scenario, adam_update, make_strategies

SIZE_NAMES = ("batch", "seq", "d_model", "heads", "d_ff", "layers", "vocab", "remat")

PRESETS: dict[str, Config] = {
    "tiny": dict(batch=8, seq=8, d_model=16, heads=4, d_ff=32, layers=2, vocab=32, remat=0),
    "small": dict(batch=16, seq=64, d_model=128, heads=8, d_ff=512, layers=4, vocab=512, remat=0),
    # full sizes recompute each layer's activations in the backward pass (remat=1), as such
    # models are trained: only the residual stream between layers is kept
    "t32": dict(batch=256, seq=2048, d_model=2560, heads=32, d_ff=10240, layers=32, vocab=50304, remat=1),
    "t48": dict(batch=512, seq=2048, d_model=3072, heads=32, d_ff=12288, layers=48, vocab=50304, remat=1),
}

PARAM_KINDS = (
    ParamKind("embed/tokens", 2),
    ParamKind("embed/pos", 2),
    ParamKind("layer_*/ln1/scale", 1),
    ParamKind("layer_*/ln1/bias", 1),
    ParamKind("layer_*/attn/w_q", 2, mp_dim=1),
    ParamKind("layer_*/attn/w_k", 2, mp_dim=1),
    ParamKind("layer_*/attn/w_v", 2, mp_dim=1),
    ParamKind("layer_*/attn/w_o", 2, mp_dim=0),
    ParamKind("layer_*/ln2/scale", 1),
    ParamKind("layer_*/ln2/bias", 1),
    ParamKind("layer_*/mlp/w_in", 2, mp_dim=1),
    ParamKind("layer_*/mlp/b_in", 1, mp_dim=0),
    ParamKind("layer_*/mlp/w_out", 2, mp_dim=0),
    ParamKind("layer_*/mlp/b_out", 1),
    ParamKind("final_ln/scale", 1),
    ParamKind("final_ln/bias", 1),
    ParamKind("unembed/w", 2),
)


def param_shapes(cfg: Config) -> dict:
    d, f, v, s = cfg["d_model"], cfg["d_ff"], cfg["vocab"], cfg["seq"]
    ln = lambda: {"scale": (d,), "bias": (d,)}
    shapes: dict = {"embed": {"tokens": (v, d), "pos": (s, d)}}
    for i in range(cfg["layers"]):
        shapes[f"layer_{i}"] = {
            "ln1": ln(),
            "attn": {"w_q": (d, d), "w_k": (d, d), "w_v": (d, d), "w_o": (d, d)},
            "ln2": ln(),
            "mlp": {"w_in": (d, f), "b_in": (f,), "w_out": (f, d), "b_out": (d,)},
        }
    shapes["final_ln"] = ln()
    shapes["unembed"] = {"w": (d, v)}
    return shapes


def batch_shapes(cfg: Config) -> dict:
    shape = (cfg["batch"], cfg["seq"])
    return {"tokens": (shape, np.int32), "targets": (shape, np.int32)}


def param_count(cfg: Config) -> int:
    d, f, v, s, L = cfg["d_model"], cfg["d_ff"], cfg["vocab"], cfg["seq"], cfg["layers"]
    return v * d + s * d + L * (4 * d * d + 2 * d * f + f + d + 4 * d) + 2 * d + d * v


def make_params(cfg: Config, rng: np.random.Generator) -> dict:
    def init(path: str, shape: tuple[int, ...]) -> np.ndarray:
        leaf = path.rsplit("/", 1)[-1]
        if leaf == "scale":
            return np.ones(shape, np.float32)
        if leaf.startswith("b") and len(shape) == 1:          # bias, b_in, b_out
            return np.zeros(shape, np.float32)
        std = 0.02 if path.startswith("embed") else 1.0 / math.sqrt(shape[0])
        return (std * rng.standard_normal(shape)).astype(np.float32)

    def walk(tree: dict, prefix: str) -> dict:
        return {k: walk(v, f"{prefix}{k}/") if isinstance(v, dict) else init(prefix + k, v)
                for k, v in tree.items()}

    return walk(param_shapes(cfg), "")


def make_batch(cfg: Config, rng: np.random.Generator) -> dict:
    tokens = rng.integers(0, cfg["vocab"], size=(cfg["batch"], cfg["seq"] + 1), dtype=np.int32)
    return {"tokens": np.ascontiguousarray(tokens[:, :-1]), "targets": np.ascontiguousarray(tokens[:, 1:])}


def gelu(x):
    """gelu, tanh approximation."""
    import jax.numpy as jnp

    c = np.float32(math.sqrt(2.0 / math.pi))
    return 0.5 * x * (1.0 + jnp.tanh(c * (x + 0.044715 * (x * x * x))))


def layernorm(x, p, eps: float = 1e-5):
    import jax
    import jax.numpy as jnp

    mean = jnp.mean(x, axis=-1, keepdims=True)
    xc = x - mean
    var = jnp.mean(xc * xc, axis=-1, keepdims=True)
    return xc * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def attention(x, p, heads: int):
    import jax
    import jax.numpy as jnp

    b, s, d = x.shape
    dh = d // heads
    q = (x @ p["w_q"]).reshape(b, s, heads, dh)
    k = (x @ p["w_k"]).reshape(b, s, heads, dh)
    v = (x @ p["w_v"]).reshape(b, s, heads, dh)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * np.float32(1.0 / math.sqrt(dh))
    causal = jax.lax.broadcasted_iota(jnp.int32, (s, s), 0) >= jax.lax.broadcasted_iota(jnp.int32, (s, s), 1)
    scores = jnp.where(causal, scores, np.float32(-1e9))
    m = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    e = jnp.exp(scores - m)
    probs = e / jnp.sum(e, axis=-1, keepdims=True)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
    return out @ p["w_o"]


def make_step(cfg: Config, *, lr: float = 1e-2, grads_only: bool = False):
    """The training step ``(params, opt, batch) -> (loss, new_params, new_opt)``; with
    ``grads_only`` the same step stopped before the optimizer: ``-> (loss, grads)``."""
    import jax
    import jax.numpy as jnp

    layers, heads, vocab = cfg["layers"], cfg["heads"], cfg["vocab"]

    def block(x, p):
        x = x + attention(layernorm(x, p["ln1"]), p["attn"], heads)
        h = layernorm(x, p["ln2"])
        m = p["mlp"]
        return x + (gelu(h @ m["w_in"] + m["b_in"]) @ m["w_out"] + m["b_out"])

    if cfg.get("remat", 0):
        block = jax.checkpoint(block)

    def loss_fn(params, batch):
        tokens = batch["tokens"]
        x = params["embed"]["tokens"][tokens] + params["embed"]["pos"]
        for i in range(layers):
            x = block(x, params[f"layer_{i}"])
        logits = layernorm(x, params["final_ln"]) @ params["unembed"]["w"]
        logp = jax.nn.log_softmax(logits, axis=-1)
        onehot = jax.nn.one_hot(batch["targets"], vocab, dtype=jnp.float32)
        return -jnp.mean(jnp.sum(onehot * logp, axis=-1))

    def step(params, opt, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        if grads_only:
            return loss, grads
        new_params, new_opt = adam_update(grads, opt, params, lr=lr)
        return loss, new_params, new_opt

    return step


def _check_config(cfg: Config) -> None:
    if cfg["d_model"] % cfg["heads"]:
        raise ScenarioError(f"transformer: d_model={cfg['d_model']} is not divisible by heads={cfg['heads']}; "
                            "change --set d_model=... or heads=...")


def _check_mp(cfg: Config, model_size: int) -> None:
    if cfg["heads"] % model_size:
        raise ScenarioError(f"strategy with 'mp': heads={cfg['heads']} is not divisible by the 'model' axis "
                            f"(size {model_size}); Megatron attention shards whole heads")


SCENARIO = Scenario(
    name="transformer",
    description="decoder-only LM training step (causal MHA, gelu MLP, untied unembedding, Adam)",
    size_names=SIZE_NAMES,
    presets=PRESETS,
    simulation_only=frozenset({"t32", "t48"}),
    make_step=make_step,
    param_shapes=param_shapes,
    batch_shapes=batch_shapes,
    make_params=make_params,
    make_batch=make_batch,
    param_count=param_count,
    param_kinds=PARAM_KINDS,
    strategies=make_strategies(PARAM_KINDS, param_shapes, check_mp=_check_mp),
    check_config=_check_config,
    flag_names=("remat",),
)

__all__ = ["SCENARIO", "PRESETS", "SIZE_NAMES", "param_count", "param_shapes", "make_step"]
