"""The transformer scenario's model, plain JAX: norms, projections, MLPs, blocks, loss and the
training step. Which parts are used is decided by the config (see ``scenarios.transformer.scenario``);
the parameter tree is ``scenarios.transformer.scenario.param_shapes``.

Mixed precision (``precision=bf16``) as Megatron and MaxText do it: parameters are float32 inputs
(master weights) cast to bfloat16 where they are used, so matmul inputs, activations and their
gradients are bfloat16 and the parameter gradients come back float32 through the casts; norm
statistics, the softmax and the loss (logits cast to float32 before the log-softmax) are float32,
their outputs cast back. Adam's state is float32 (``scenarios.common.adam_update``). With
``precision=f32`` no cast is emitted at all. ``precision=fp8`` is bf16 with every dense layer an FP8
matmul with delayed scaling (:mod:`scenarios.fp8`; its amax histories in ``opt/fp8``).
"""
from __future__ import annotations

import math

import numpy as np

from scenarios.common import Config
from scenarios.fp8 import fp8_matmul, fp8_matmuls, fp8_train_step, histories_of
from scenarios.precision import as_dtype, compute_dtype, wide
from scenarios.training import op_scope, train_step
from scenarios.transformer import pipeline, ring_attention
from scenarios.transformer.attention import ATTENTION, SAVED  # SAVED: what remat=op keeps
from scenarios.transformer.moe import add_aux, moe_mlp, split_aux
from scenarios.transformer.pipeline_1f1b import make_value_and_grad, one_f_one_b

EPS = 1e-5


def gelu(x):
    """gelu, tanh approximation, in ``x``'s dtype."""
    import jax.numpy as jnp

    with op_scope("gelu"):
        c = np.asarray(math.sqrt(2.0 / math.pi), x.dtype)
        return 0.5 * x * (1.0 + jnp.tanh(c * (x + 0.044715 * (x * x * x))))


def relu(x):
    import jax.numpy as jnp

    with op_scope("relu"):
        return jnp.maximum(x, 0.0)


def silu(x):
    import jax

    with op_scope("silu"):
        return x * jax.nn.sigmoid(x)


def norm(x, p: dict, kind: str, dtype):
    """layernorm (scale and bias) or rmsnorm (scale only); statistics in float32, output in ``dtype``."""
    import jax
    import jax.numpy as jnp

    with op_scope(kind):
        x = wide(x)
        if kind == "rmsnorm":
            y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * p["scale"]
        else:
            mean = jnp.mean(x, axis=-1, keepdims=True)
            xc = x - mean
            var = jnp.mean(xc * xc, axis=-1, keepdims=True)
            y = xc * jax.lax.rsqrt(var + EPS) * p["scale"] + p["bias"]
        return as_dtype(y, dtype)




class EverySecondDot:
    """remat=op, torchtitan's per-op selective activation checkpointing (``selective_ac_option = 'op'``,
    torchtitan/parallelisms/parallelize_llama.py @ 1ea476e, 2024-04): in each layer the outputs of the
    1st, 3rd, 5th, ... matmul in forward order are saved and every second one recomputed, the
    attention core's outputs are saved (SDPA is on its no-recompute list), and every other op
    (norms, activations, residual adds, RoPE) is recomputed. One instance per layer call counts its
    dots; each is named before its bias (torchtitan's models have none: ``aten.mm``)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, y):
        from jax.ad_checkpoint import checkpoint_name

        self.count += 1
        return checkpoint_name(y, SAVED) if self.count % 2 == 1 else y


def dense(x, p: dict, w: str, b: str | None = None, sac: EverySecondDot | None = None):
    """``x @ p[w] (+ p[b] when the config has that bias)``, the parameters cast to ``x``'s dtype; an
    FP8 matmul (:func:`scenarios.fp8.fp8_matmul`) when the step grafted amax histories beside ``w``."""
    meta = histories_of(p, w)
    y = x @ as_dtype(p[w], x.dtype) if meta is None else fp8_matmul(x, p[w], meta)
    if sac is not None:
        y = sac(y)
    return y + as_dtype(p[b], x.dtype) if b is not None and b in p else y


def attention(x, p: dict, cfg: Config, sac: EverySecondDot | None = None):
    b, s, _ = x.shape
    heads, kv, dh = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q = dense(x, p, "w_q", "b_q", sac).reshape(b, s, heads, dh)
    k = dense(x, p, "w_k", None, sac).reshape(b, s, kv, dh)    # no key bias (see scenarios.transformer.scenario)
    v = dense(x, p, "w_v", "b_v", sac).reshape(b, s, kv, dh)
    core = ring_attention.core(cfg) if cfg["attention"] == "ring" else ATTENTION[cfg["attention"]]
    if str(cfg.get("remat", 0)) == "selective":
        # Korthikanti et al. 2022 (arXiv 2205.05198 sec. 4.2) selective recomputation: only the attention
        # core (q·kᵀ, softmax, p·v) is recomputed in the backward pass; the projections' outputs are kept
        import jax
        core = jax.checkpoint(core)
    out = core(q, k, v)
    if sac is not None:
        from jax.ad_checkpoint import checkpoint_name
        out = checkpoint_name(out, SAVED)
    return dense(out.reshape(b, s, heads * dh), p, "w_o", "b_o", sac)


def mlp(x, p: dict, kind: str, sac: EverySecondDot | None = None):
    if kind == "swiglu":
        gate = silu(dense(x, p, "w_gate", "b_gate", sac))
        return dense(gate * dense(x, p, "w_up", "b_up", sac), p, "w_down", "b_down", sac)
    act = gelu if kind == "gelu" else relu
    return dense(act(dense(x, p, "w_in", "b_in", sac)), p, "w_out", "b_out", sac)


def feed_forward(x, p: dict, cfg: Config, sac: EverySecondDot | None = None):
    """``(y, aux)``: the layer's MLP of ``x``, and for a mixture-of-experts layer (``p`` has ``moe``)
    its auxiliary load-balancing loss (:mod:`scenarios.transformer.moe`), else None."""
    if "moe" in p:
        return moe_mlp(x, p["moe"], cfg, {"gelu": gelu, "relu": relu, "swiglu": silu}[cfg["mlp"]])
    return mlp(x, p["mlp"], cfg["mlp"], sac), None


def _residual(x, ffn):
    """``x + y`` of ``ffn = (y, aux)``, with the aux loss beside it when there is one."""
    y, aux = ffn
    return x + y if aux is None else (x + y, aux)


def make_block(cfg: Config):
    """One layer ``(x, params/layer_i) -> x``: serial (pre-norm GPT) or parallel (PaLM); a MoE layer
    returns ``(x, its aux loss)``."""
    dtype, nk = compute_dtype(cfg), cfg["norm"]
    op_sac = str(cfg.get("remat", 0)) == "op"

    def serial(x, p):
        sac = EverySecondDot() if op_sac else None
        x = x + attention(norm(x, p["ln1"], nk, dtype), p["attn"], cfg, sac)
        return _residual(x, feed_forward(norm(x, p["ln2"], nk, dtype), p, cfg, sac))

    def parallel(x, p):
        sac = EverySecondDot() if op_sac else None
        h = norm(x, p["ln1"], nk, dtype)
        return _residual(x + attention(h, p["attn"], cfg, sac), feed_forward(h, p, cfg, sac))

    return parallel if cfg["block"] == "parallel" else serial


def remat_policy(cfg: Config):
    """The ``jax.checkpoint`` policy each layer is wrapped in under ``remat`` (None: the layer is not
    wrapped; ``remat=selective`` checkpoints the attention core inside it instead)."""
    import jax

    policies = jax.checkpoint_policies
    remat = str(cfg.get("remat", 0))
    if remat in ("1", "full"):
        return policies.nothing_saveable
    if remat == "minimal":
        # MaxText remat_policy=minimal: keep the outputs of the dots without batch dimensions (the
        # projections and the MLP), recompute the rest of the layer (its elementwise work and attention)
        return policies.checkpoint_dots_with_no_batch_dims
    if remat == "dots":
        return policies.dots_saveable       # every dot's output kept
    if remat == "op":
        return policies.save_only_these_names(SAVED)
    return None


def make_embed(cfg: Config):
    """``(params, tokens) -> x`` [batch, seq, d]: token and position embeddings in the compute dtype."""
    dtype = compute_dtype(cfg)

    def embed(params, tokens):
        emb = params["embed"]
        # gather from the float32 table, then cast: the embedding gradient accumulates in float32
        return as_dtype(emb["tokens"][tokens], dtype) + as_dtype(emb["pos"], dtype)

    return embed


def make_head(cfg: Config):
    """``(params, x, targets) -> the mean next-token cross-entropy of x's rows`` (float32): final norm,
    logits, loss."""
    import jax
    import jax.numpy as jnp

    dtype = compute_dtype(cfg)

    def head(params, x, targets):
        h = norm(x, params["final_ln"], cfg["norm"], dtype)
        unembed = as_dtype(params["embed"]["tokens"], dtype).T if cfg["tied"] else \
            as_dtype(params["unembed"]["w"], dtype)
        logits = h @ unembed
        with op_scope("cross_entropy"):
            logp = jax.nn.log_softmax(wide(logits), axis=-1)
            onehot = jax.nn.one_hot(targets, cfg["vocab"], dtype=logp.dtype)
            return -jnp.mean(jnp.sum(onehot * logp, axis=-1))

    return head


def make_loss(cfg: Config):
    """``(params, batch) -> mean next-token cross-entropy`` (float32), plus the MoE layers' weighted
    auxiliary losses when there are any."""
    import jax

    block = make_block(cfg)
    policy = remat_policy(cfg)
    if policy is not None:
        block = jax.checkpoint(block, policy=policy)
    embed, head = make_embed(cfg), make_head(cfg)

    def loss_fn(params, batch):
        x = embed(params, batch["tokens"])
        if pipeline.pipelined(cfg):        # the layers as P stages (scenarios.transformer.pipeline)
            x, auxes = pipeline.run_layers(cfg, make_block(cfg), params["layers"], x, policy), []
        elif cfg["layers_as"] == "loop":
            x, auxes = jax.lax.scan(lambda h, p: split_aux(block(h, p)), x, params["layers"])
        else:
            auxes = []
            for i in range(cfg["layers"]):
                x, aux = split_aux(block(x, params[f"layer_{i}"]))
                auxes.append(aux)

        def head_of(x, targets):
            return head(params, x, targets)

        # a pipeline's head runs a micro-batch at a time, as its last stage does
        ce = pipeline.per_micro_batch(cfg, head_of, x, batch["targets"]) if pipeline.pipelined(cfg) else \
            head_of(x, batch["targets"])
        return add_aux(ce, auxes)

    return loss_fn


def make_step(cfg: Config, *, lr: float = 1e-2, grads_only: bool = False):
    """The training step ``(params, opt, batch) -> (loss, new_params, new_opt)``; with
    ``grads_only`` the same step stopped before the optimizer: ``-> (loss, grads)``. A 1F1B pipeline
    computes its gradient itself (``scenarios.transformer.pipeline_1f1b``)."""

    loss_fn = make_loss(cfg)
    if fp8_matmuls(cfg):
        return fp8_train_step(loss_fn, lr=lr, grads_only=grads_only)
    if pipeline.pipelined(cfg) and one_f_one_b(cfg):
        grads = make_value_and_grad(cfg, make_embed(cfg), make_block(cfg), make_head(cfg))
        return train_step(loss_fn, lr=lr, grads_only=grads_only, value_and_grad=grads)
    # a pipeline's micro-batches are its own (scenarios.transformer.pipeline), not gradient accumulation
    k = 1 if pipeline.pipelined(cfg) else int(cfg.get("microbatches", 1))
    return train_step(loss_fn, lr=lr, grads_only=grads_only, microbatches=k)


__all__ = ["make_step", "make_loss", "make_block", "make_embed", "make_head", "feed_forward", "norm", "dense", "gelu", "relu", "silu",
           "compute_dtype"]
