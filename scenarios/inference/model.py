"""The inference scenario's model, plain JAX: a decoder-only LM step over a KV cache, either
``prefill`` (a prompt of ``prompt_len`` tokens per sequence) or ``decode`` (one token per sequence).

``step(params, cache, batch) -> (logits, new_cache)``:

- ``batch/tokens`` int32 [batch, s] (s = ``prompt_len`` for prefill, 1 for decode);
- ``cache/pos`` int32 scalar: how many positions of the cache are filled (the next write goes
  there); ``cache/layer_i/k``, ``cache/layer_i/v`` [batch, cache_len, kv_heads, head_dim] in the
  compute dtype (bfloat16 with ``precision=bf16``, as inference servers keep them);
- ``logits`` [batch, vocab] (float32) of the last position (the greedy next token is their
  argmax, left to the caller: a discrete output that bfloat16 rounding flips at near-ties, which
  no normwise verdict could hold to a float64 reference), ``new_cache`` the cache with this step's keys and values written at ``pos`` by
  ``dynamic_update_slice`` and ``pos + s``.

Attention reads the whole (static-shape) cache, masked to the positions at or before each query's:
``key_pos <= pos + query_index``, as static-shape inference code (e.g. PaLM's and MaxText's)
does. Grouped queries are written as an einsum over ``[batch, s, kv_heads, groups, head_dim]``,
so multi-query attention never materialises the key/value heads repeated per query head.

The building blocks (norms, dense, MLPs, casts) are ``scenarios.transformer.model``'s; the
parameters carry no biases (PaLM has none). Positions are a learned table ``embed/pos``
[cache_len, d] (PaLM uses RoPE, which has no parameters; the table adds ``cache_len * d``).
"""
from __future__ import annotations

import math

import numpy as np

from scenarios.common import Config
from scenarios.precision import as_dtype, compute_dtype, wide
from scenarios.transformer.model import dense, mlp, norm

_MASKED = np.float32(-1e9)


def attend(h, p: dict, c: dict, pos, cfg: Config):
    """One attention layer over the cache: ``(h [b, s, d], params, cache layer, pos) -> (out, new cache layer)``."""
    import jax
    import jax.numpy as jnp

    b, s, _ = h.shape
    heads, kv, dh = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q = dense(h, p, "w_q").reshape(b, s, kv, heads // kv, dh)
    k = dense(h, p, "w_k").reshape(b, s, kv, dh)
    v = dense(h, p, "w_v").reshape(b, s, kv, dh)
    zero = jnp.zeros((), jnp.int32)
    ck = jax.lax.dynamic_update_slice(c["k"], as_dtype(k, c["k"].dtype), (zero, pos, zero, zero))
    cv = jax.lax.dynamic_update_slice(c["v"], as_dtype(v, c["v"].dtype), (zero, pos, zero, zero))
    scores = wide(jnp.einsum("bskgd,btkd->bkgst", q, as_dtype(ck, q.dtype))) * np.float32(1.0 / math.sqrt(dh))
    t = ck.shape[1]
    visible = jax.lax.broadcasted_iota(jnp.int32, (s, t), 1) <= pos + jax.lax.broadcasted_iota(jnp.int32, (s, t), 0)
    scores = jnp.where(visible, scores, _MASKED)
    m = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.exp(scores - m)
    probs = e / jnp.sum(e, axis=-1, keepdims=True)
    o = jnp.einsum("bkgst,btkd->bskgd", as_dtype(probs, q.dtype), as_dtype(cv, q.dtype)).reshape(b, s, heads * dh)
    return dense(o, p, "w_o"), {"k": ck, "v": cv}


def make_block(cfg: Config):
    """One layer ``(x, params/layer_i, cache/layer_i, pos) -> (x, new cache/layer_i)``."""
    dtype, nk, mk = compute_dtype(cfg), cfg["norm"], cfg["mlp"]

    def block(x, p, c, pos):
        h = norm(x, p["ln1"], nk, dtype)
        a, new_c = attend(h, p["attn"], c, pos, cfg)
        if cfg["block"] == "parallel":             # PaLM: attention and MLP read one norm
            return x + a + mlp(h, p["mlp"], mk), new_c
        x = x + a
        return x + mlp(norm(x, p["ln2"], nk, dtype), p["mlp"], mk), new_c

    return block


def make_step(cfg: Config):
    """The inference step ``(params, cache, batch) -> (logits, new_cache)`` (module docstring)."""
    import jax
    import jax.numpy as jnp

    dtype = compute_dtype(cfg)
    block = make_block(cfg)

    def step(params, cache, batch):
        tokens, pos = batch["tokens"], cache["pos"]
        s = tokens.shape[1]
        emb = params["embed"]
        x = as_dtype(emb["tokens"][tokens], dtype) + as_dtype(jax.lax.dynamic_slice_in_dim(emb["pos"], pos, s, axis=0), dtype)
        new_cache = {"pos": pos + jnp.int32(s)}
        for i in range(cfg["layers"]):
            x, new_cache[f"layer_{i}"] = block(x, params[f"layer_{i}"], cache[f"layer_{i}"], pos)
        h = norm(x[:, -1, :], params["final_ln"], cfg["norm"], dtype)
        unembed = as_dtype(emb["tokens"], dtype).T if cfg["tied"] else as_dtype(params["unembed"]["w"], dtype)
        logits = wide(h @ unembed)
        return logits, new_cache

    return step


__all__ = ["attend", "make_block", "make_step"]
