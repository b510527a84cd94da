"""Ring attention, plain JAX: ``--set attention=ring,ring_blocks=C`` (Liu, Zaharia & Abbeel 2023, "Ring
Attention with Blockwise Transformers"; the causal flash form of ring-flash-attention).

The sequence is cut into ``C`` blocks (``[b, C, s/C, ...]``); with the strategy part ``cp`` the block
dim is tiled over the ``context`` mesh axis, one block per device when ``C`` is the axis size. Query
block ``i`` stays where it is; the key/value blocks go round the ring: after ``r`` steps position ``i``
holds key/value block ``(i - r) mod C``, ``jnp.roll(kv, 1)`` on the block dim, which the compiler
lowers to one ``collective_permute`` of a block over ``context``
(``partir_emu/compiler/lowering/rotate.py``). Keys and values travel packed, one permute per step.

**Forward** (online softmax, flash attention's): step 0 is the diagonal block (every causal row has
a key in it, so the running max starts finite), then ``C - 1`` steps of roll-and-accumulate::

    s = q_i k_j^T / sqrt(dh), masked where key position > query position (whole blocks j > i)
    m' = max(m, rowmax s);  l = l e^(m - m') + rowsum e^(s - m');  o = o e^(m - m') + e^(s - m') v_j

and ``o / l``, with ``lse = m + log l`` (``l``: ``den`` in the code). **Backward** (a ``jax.custom_vjp``, flash attention's
backward blockwise): the key/value blocks go round the ring again, and with them the accumulators
of their gradients, which after ``C`` steps are back at their block's device::

    p = e^(s - lse);  dv_j += p^T do_i;  ds = p (do_i v_j^T - rowsum(do_i o_i)) / sqrt(dh);
    dq_i += ds k_j;  dk_j += ds^T q_i

So a layer's attention sends ``C - 1`` key/value blocks forward and, backward, ``C - 1`` key/value
blocks and ``C`` gradient blocks (float32): ``3C - 2`` permutes; only the local blocks, ``o`` and
``lse`` are saved. Masked blocks (``j > i``) are computed and masked like the naive core's, not
skipped: no zig-zag load balancing. Each step's block work is tagged as the flash-attention kernel
(``scenarios.transformer.attention.KERNEL_SCOPE``), so the fusion-aware pricing never moves its
``[s/C, s/C]`` scores through HBM. Grouped-query attention groups query heads by key/value head.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from partir_emu.errors import ScenarioError
from scenarios.common import Config
from scenarios.precision import as_dtype, wide
from scenarios.transformer.attention import KERNEL_SCOPE

NAMES = ("ring_blocks",)       # the transformer's --set keys of this module
_MASKED = np.float32(-1e9)


def check(cfg: Config) -> None:
    """A ring that cannot be built raises :class:`ScenarioError` naming the keys."""
    blocks = int(cfg.get("ring_blocks", 1))
    if cfg["attention"] != "ring":
        if "ring_blocks" in cfg:
            raise ScenarioError(f"transformer: ring_blocks={blocks} without attention=ring; set --set attention=ring")
        return
    if cfg["seq"] % blocks:
        raise ScenarioError(f"transformer: seq={cfg['seq']} is not divisible by ring_blocks={blocks}; ring attention "
                            "cuts the sequence into equal blocks")


def core(cfg: Config):
    """The attention core ``(q, k, v) -> o`` of ``attention=ring`` with the config's block count."""
    return functools.partial(ring_attention, blocks=int(cfg.get("ring_blocks", 1)))


def ring_attention(q, k, v, blocks: int):
    """Causal attention of ``q`` [b, s, heads, dh] over ``k``, ``v`` [b, s, kv_heads, dh] as a ring of
    ``blocks`` sequence blocks (see the module docstring); same value as the naive core."""
    return _ring_fn(blocks)(q, k, v)


@functools.cache
def _ring_fn(blocks: int):
    import jax

    @jax.custom_vjp
    def ring(q, k, v):
        return _forward(q, k, v, blocks)[0]

    ring.defvjp(lambda q, k, v: _forward(q, k, v, blocks), lambda res, do: _backward(res, do, blocks))
    return ring


def _grouped(x, c: int, kv_heads: int):
    """[b, s, heads, dh] -> [b, C, s/C, kv_heads, groups, dh]."""
    b, s, h, dh = x.shape
    return x.reshape(b, c, s // c, kv_heads, h // kv_heads, dh)


def _scores(qg, kk, r, c: int):
    """Scaled, causally masked scores [b, C, kv, g, sq, sk] (float32) of query block ``i`` against the
    key block ``(i - r) mod C`` each position holds at step ``r``."""
    import jax.numpy as jnp

    sc, dh = qg.shape[2], qg.shape[-1]
    s = wide(jnp.einsum("bcqngd,bcknd->bcngqk", qg, kk)) * np.float32(1.0 / math.sqrt(dh))
    i = jnp.arange(c, dtype=jnp.int32)
    pos = jnp.arange(sc, dtype=jnp.int32)
    qpos = i[:, None] * sc + pos                       # [C, sq]
    kpos = ((i - r) % c)[:, None] * sc + pos           # [C, sk]
    keep = kpos[:, None, :] <= qpos[:, :, None]        # [C, sq, sk]
    return jnp.where(keep[None, :, None, None], s, _MASKED)


def _forward(q, k, v, c: int):
    import jax
    import jax.numpy as jnp

    n = k.shape[2]
    qg = _grouped(q, c, n)
    kv = jnp.stack([k, v], axis=2)                     # [b, s, 2, kv, dh]: one message per step
    kv = kv.reshape(kv.shape[0], c, kv.shape[1] // c, *kv.shape[2:])

    def step(m, den, o, kv, r):
        with jax.named_scope(KERNEL_SCOPE):
            s = _scores(qg, kv[:, :, :, 0], r, c)
            m_new = s.max(axis=-1) if m is None else jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp(s - m_new[..., None])
            pv = wide(jnp.einsum("bcngqk,bcknd->bcqngd", as_dtype(p, v.dtype), kv[:, :, :, 1]))
            if m is None:
                return m_new, p.sum(axis=-1), pv
            alpha = jnp.exp(m - m_new)
            return m_new, den * alpha + p.sum(axis=-1), o * jnp.moveaxis(alpha, -1, 2)[..., None] + pv

    m, den, o = step(None, None, None, kv, 0)
    if c > 1:
        def ring_step(carry, r):
            m, den, o, kv = carry
            kv = jnp.roll(kv, 1, axis=1)
            return (*step(m, den, o, kv, r), kv), None

        (m, den, o, _), _ = jax.lax.scan(ring_step, (m, den, o, kv), jnp.arange(1, c, dtype=jnp.int32))
    with jax.named_scope(KERNEL_SCOPE):
        out = as_dtype(o / jnp.moveaxis(den, -1, 2)[..., None], q.dtype).reshape(q.shape)
        lse = m + jnp.log(den)
    return out, (q, k, v, out, lse)


def _backward(res, do, c: int):
    import jax
    import jax.numpy as jnp

    q, k, v, o, lse = res
    n = k.shape[2]
    qg, dog = _grouped(q, c, n), _grouped(do, c, n)
    with jax.named_scope(KERNEL_SCOPE):
        big_d = jnp.moveaxis(jnp.sum(wide(dog) * wide(_grouped(o, c, n)), axis=-1), 2, -1)   # [b, C, n, g, q]
    kv = jnp.stack([k, v], axis=2)
    kv = kv.reshape(kv.shape[0], c, kv.shape[1] // c, *kv.shape[2:])
    scale = np.float32(1.0 / math.sqrt(q.shape[-1]))

    def step(dq, dkv, kv, r):
        with jax.named_scope(KERNEL_SCOPE):
            kk, vv = kv[:, :, :, 0], kv[:, :, :, 1]
            p = jnp.exp(_scores(qg, kk, r, c) - lse[..., None])
            dv = jnp.einsum("bcngqk,bcqngd->bcknd", as_dtype(p, do.dtype), dog)
            dp = wide(jnp.einsum("bcqngd,bcknd->bcngqk", dog, vv))
            ds = as_dtype(p * (dp - big_d[..., None]) * scale, q.dtype)
            dq = dq + wide(jnp.einsum("bcngqk,bcknd->bcqngd", ds, kk))
            dk = jnp.einsum("bcngqk,bcqngd->bcknd", ds, qg)
            return dq, dkv + wide(jnp.stack([dk, dv], axis=3))

    zeros = jnp.zeros(qg.shape, np.float32), jnp.zeros(kv.shape, np.float32)
    dq, dkv = step(*zeros, kv, 0)
    if c > 1:
        def ring_step(carry, r):
            dq, dkv, kv = carry
            kv, dkv = jnp.roll(kv, 1, axis=1), jnp.roll(dkv, 1, axis=1)
            return (*step(dq, dkv, kv, r), kv), None

        (dq, dkv, _), _ = jax.lax.scan(ring_step, (dq, dkv, kv), jnp.arange(1, c, dtype=jnp.int32))
        dkv = jnp.roll(dkv, 1, axis=1)                 # each block's gradient home
    dkv = dkv.reshape(dkv.shape[0], -1, *dkv.shape[3:])
    return (as_dtype(dq.reshape(q.shape), q.dtype), as_dtype(dkv[:, :, 0], k.dtype), as_dtype(dkv[:, :, 1], v.dtype))


__all__ = ["NAMES", "check", "core", "ring_attention"]
