"""Causal attention cores, plain JAX: ``naive`` (scores, softmax, values, as written) and
``flash`` (the same math with a flash-attention backward, marked as one hand-fused kernel).

Both take ``q`` [b, s, heads, dh] and ``k``, ``v`` [b, s, kv_heads, dh] (``kv_heads`` divides
``heads``; query head ``h`` reads key/value head ``h // (heads // kv_heads)``, as grouped-query
attention does) in the compute dtype, and return ``o`` [b, s, heads, dh] in that dtype. Scores,
mask and softmax are float32 whatever the compute dtype (Megatron's fused softmax and MaxText do
the same); the probabilities are cast back to the compute dtype for ``p @ v``.

**flash.** A ``jax.custom_vjp`` written as flash attention (Dao 2023, "FlashAttention-2", Alg. 1
and 2) computes it, without the blocking: the forward returns ``o`` and the log-sum-exp
``lse = m + log(sum(exp(s - m)))`` (``m`` the row max) and saves only ``q, k, v, o, lse``; the
backward recomputes ``s`` and ``p = exp(s - lse)`` from ``q, k, lse`` and forms::

    D = rowsum(do * o);  dv = p^T do;  dp = do v^T;  ds = p * (dp - D);  dq = ds k;  dk = ds^T q

Both bodies run under ``jax.named_scope("kernel:flash_attention")``: the tracer tags their
equations ``flash_attention`` and ``flash_attention/bwd`` (``Eqn.kernel``, see
``partir_emu.compiler.tracing.trace``), and the fusion-aware cost model prices each tagged region as one
fused kernel, so the [s, s] scores and probabilities are never HBM traffic. We mark the kernel
rather than write blocked attention with an online softmax because the partitioned program stays
the textbook one (the same sharding rules, the same numerics as ``naive`` to rounding) and the
pricing question -- what crosses HBM -- is exactly what the kernel tag answers.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

from scenarios.precision import as_dtype, wide
from scenarios.training import op_scope

KERNEL_SCOPE = "kernel:flash_attention"
# the checkpoint_name of what remat=op keeps (scenarios.transformer.model.EverySecondDot): the flash
# kernel's own saved outputs, o and the log-sum-exp, as PyTorch's SDPA keeps them under torchtitan's
# per-op selective checkpointing (an identity anywhere else)
SAVED = "op_saved"
_MASKED = np.float32(-1e9)


def _repeat_kv(x, groups: int):
    """[b, s, kv, dh] -> [b, s, kv * groups, dh], each kv head repeated for its group of queries."""
    import jax.numpy as jnp

    if groups == 1:
        return x
    b, s, kv, dh = x.shape
    return jnp.broadcast_to(x[:, :, :, None, :], (b, s, kv, groups, dh)).reshape(b, s, kv * groups, dh)


def _sum_groups(x, groups: int):
    """The transpose of :func:`_repeat_kv`: [b, s, kv * groups, dh] -> [b, s, kv, dh]."""
    if groups == 1:
        return x
    b, s, h, dh = x.shape
    return x.reshape(b, s, h // groups, groups, dh).sum(axis=3)




def _scale_mask(raw, dh: int):
    """``raw`` scores [b, heads, s, s] scaled by 1/sqrt(dh) in float32 and causally masked."""
    import jax
    import jax.numpy as jnp

    s = raw.shape[-1]
    scores = wide(raw) * np.float32(1.0 / math.sqrt(dh))
    causal = jax.lax.broadcasted_iota(jnp.int32, (s, s), 0) >= jax.lax.broadcasted_iota(jnp.int32, (s, s), 1)
    return jnp.where(causal, scores, _MASKED)


def _causal_scores(q, k):
    """Scaled, causally masked scores [b, heads, s, s] in float32."""
    import jax.numpy as jnp

    return _scale_mask(jnp.einsum("bqhd,bkhd->bhqk", q, k), q.shape[3])


def naive_attention(q, k, v):
    """Scores, max-subtracted softmax, ``p @ v``: every intermediate is a value of the program. Scale,
    mask and softmax are one framework op, ``scale_mask_softmax`` (Megatron's ``FusedScaleMaskSoftmax``
    CUDA kernel, which a stack may run as one hand-written kernel: ``hand_fused``)."""
    import jax
    import jax.numpy as jnp

    groups = q.shape[2] // k.shape[2]
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    raw = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    with op_scope("scale_mask_softmax"):
        scores = _scale_mask(raw, q.shape[3])
        m = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
        e = jnp.exp(scores - m)
        probs = as_dtype(e / jnp.sum(e, axis=-1, keepdims=True), v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def _flash_forward(q, k, v):
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    with jax.named_scope(KERNEL_SCOPE):
        groups = q.shape[2] // k.shape[2]
        kk, vv = _repeat_kv(k, groups), _repeat_kv(v, groups)
        s = _causal_scores(q, kk)
        m = jnp.max(s, axis=-1, keepdims=True)
        lse = m + jnp.log(jnp.sum(jnp.exp(s - m), axis=-1, keepdims=True))        # [b, h, s, 1]
        p = jnp.exp(s - lse)
        o = jnp.einsum("bhqk,bkhd->bqhd", as_dtype(p, v.dtype), vv)
        o, lse = checkpoint_name(o, SAVED), checkpoint_name(lse, SAVED)
    return o, (q, k, v, o, lse)


def _flash_backward(res, do):
    import jax
    import jax.numpy as jnp

    q, k, v, o, lse = res
    with jax.named_scope(KERNEL_SCOPE):
        groups = q.shape[2] // k.shape[2]
        kk, vv = _repeat_kv(k, groups), _repeat_kv(v, groups)
        p = jnp.exp(_causal_scores(q, kk) - lse)                                  # [b, h, q, k] f32
        big_d = jnp.sum(wide(do) * wide(o), axis=-1).transpose(0, 2, 1)[..., None]  # [b, h, q, 1]
        dv = jnp.einsum("bhqk,bqhd->bkhd", as_dtype(p, do.dtype), do)
        dp = wide(jnp.einsum("bqhd,bkhd->bhqk", do, vv))
        ds = (p * (dp - big_d) * np.float32(1.0 / math.sqrt(q.shape[3])))
        ds = as_dtype(ds, q.dtype)
        dq = jnp.einsum("bhqk,bkhd->bqhd", ds, kk)
        dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q)
        dk, dv = _sum_groups(dk, groups), _sum_groups(dv, groups)
    return as_dtype(dq, q.dtype), as_dtype(dk, k.dtype), as_dtype(dv, v.dtype)


@functools.cache
def _flash_fn() -> Callable:
    """The custom_vjp function, made once on first use (keeps jax out of this module's import)."""
    import jax

    @jax.custom_vjp
    def flash(q, k, v):
        return _flash_forward(q, k, v)[0]

    flash.defvjp(_flash_forward, _flash_backward)
    return flash


def flash_attention(q, k, v):
    """The flash-attention core (see the module docstring); same value as :func:`naive_attention`."""
    return _flash_fn()(q, k, v)


ATTENTION = {"naive": naive_attention, "flash": flash_attention}

__all__ = ["ATTENTION", "KERNEL_SCOPE", "SAVED", "flash_attention", "naive_attention"]
