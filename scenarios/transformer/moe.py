"""Mixture-of-experts MLP layers, plain JAX, written the GShard / Switch way: one-hot dispatch and
combine tensors and einsums, as Mesh-TensorFlow, GShard (Lepikhin et al. 2020, arXiv 2006.16668) and
flaxformer's ``TokensChooseMaskedRouter`` write them.

A MoE layer (every ``moe_every``-th layer, :func:`is_moe_layer`) has ``params/layer_i/moe`` in place
of ``mlp``: ``router`` [d, E] and the experts' MLP weights stacked on a leading expert dim,
``w_in`` [E, d, f] and ``w_out`` [E, f, d] (``mlp=swiglu``: ``w_gate``, ``w_up`` [E, d, f] and
``w_down`` [E, f, d]); no biases (Switch's T5 experts and Mixtral's have none). Its input [B, S, d]
is cut into G routing groups of ``moe_group`` tokens (default: one group per sequence), x [G, S, d]::

    probs = softmax(x @ router)                  [G, S, E]   float32 (Switch's "selective precision")
    idx = top_k(probs, k)                        [G, S, k]   each token's k experts, best first
    gates = probs at idx                         k = 1: as is (Switch, eq. 2); k > 1: divided by
                                                 their sum (GShard Alg. 2; Mixtral's softmax over
                                                 the top-k logits is the same number)
    priority = cumsum over (k, S), k-major, of one_hot(idx)      int32, exact: a choice's place in its
                                                 expert's buffer, every first choice before any second
    slot = one_hot(priority, C)                  [G, S, k, C]: all zeros when priority >= C, so a
                                                 choice over its expert's capacity C is dropped
    dispatch = sum_k one_hot(idx) x slot         [G, S, E, C]  (0/1)
    combine = sum_k gate_k one_hot(idx) x slot   [G, S, E, C]
    expert_in = tag(einsum("gsec,gsd->egcd", dispatch, x), "moe/dispatch")      [E, G, C, d]
    expert_out = tag(mlp_e(expert_in), "moe/combine")   einsum "egcd,edf->egcf", act, "egcf,efd->egcd"
    y = einsum("gsec,egcd->gsd", combine, expert_out)                           [G, S, d]

A token dropped by every expert it chose leaves the layer as its residual (Switch, sec. 2.2).
Capacity ``C = ceil(top_k * moe_group * capacity_factor / E)`` tokens per expert and group
(Switch's "tokens per batch / experts x capacity factor", per choice as GShard's 2N/E for top-2).

The two tags (:func:`partir_emu.compiler.tracing.tag.tag`; the identity to jax) are where the expert
tactic ``ep`` stops (:mod:`scenarios.strategies`): the experts' side is tiled on E, the tokens' side
keeps the batch's tiling, and the lowering joins them with GShard's all_to_all, once each way per
pass (the gradient tags the cotangents too).

Auxiliary load-balancing loss (Switch eq. 4-6, as flaxformer's ``_load_balancing_loss``): per
group, ``f_e`` the fraction of the group's tokens whose top-k include expert e and ``P_e`` the mean
router probability of e; ``aux = E^2 * mean over groups and experts of f_e * P_e`` (1 when routing
is uniform). The step's loss adds ``AUX_WEIGHT`` times the sum over MoE layers (Switch's
alpha = 1e-2, sec. 2.2).

Counts (:func:`count_delta`): a MoE layer has ``d*E + E*m*d*f`` parameters in place of the dense
MLP's ``m*d*f`` and its biases (m = 3 for swiglu, else 2); model FLOPs count a token's matmuls
through the router and its ``top_k`` experts, ``2*(d*E + top_k*m*d*f)`` forward, not the capacity's
padding nor the one-hot dispatch and combine (which the hardware models do price).

Left out: router jitter noise and GShard's random dispatch of the second expert (both draw random
numbers per step), the router z-loss (ST-MoE), batch-prioritised routing (V-MoE), dropless routing
(MegaBlocks, Mixtral): every expert has a fixed capacity.
"""
from __future__ import annotations

import functools
import math
import operator

from partir_emu.errors import ScenarioError
from scenarios.common import Config, ParamKind
from scenarios.precision import as_dtype, wide
from scenarios.training import op_scope

# the tags (partir_emu.tag) on the two sides of the experts: the dispatched tokens and the experts' outputs
DISPATCH, COMBINE = "moe/dispatch", "moe/combine"
AUX_WEIGHT = 1e-2          # Switch Transformer (arXiv 2101.03961) sec. 2.2: alpha = 10^-2


NAMES = ("experts", "top_k", "capacity_factor", "moe_every", "moe_group")      # the transformer's --set keys of this module
DEFAULTS: Config = dict(top_k=2, capacity_factor=1.25, moe_every=1)   # GShard/Mixtral top-2, Switch's 1.25

# Mixtral 8x7B (Jiang et al. 2024, arXiv 2401.04088, Table 1; mistralai/Mixtral-8x7B-v0.1 config.json:
# hidden_size 4096, intermediate_size 14336, num_hidden_layers 32, num_attention_heads 32,
# num_key_value_heads 8, num_local_experts 8, num_experts_per_tok 2, vocab_size 32000, silu (SwiGLU)
# experts, RMSNorm, no biases, untied embeddings): 46,702,792,704 parameters as published there, plus
# our learned positions (seq x d; Mixtral uses RoPE). Mixtral routes without a capacity (dropless);
# capacity_factor=1.25 here is Switch's training value, and routing groups of 1,024 tokens (the
# one-hot dispatch and combine cost 2*top_k*moe_group*capacity_factor*d FLOPs a token each) are our
# choice. Mistral publishes no training batch or sequence length: batch=512 and seq=4096 are ours
# too. Trained as the other full sizes are (bf16, flash attention, full remat).
MIXTRAL_8X7B: Config = dict(d_model=4096, d_ff=14336, layers=32, heads=32, kv_heads=8, vocab=32000,
                            experts=8, top_k=2, capacity_factor=1.25, moe_every=1, mlp="swiglu",
                            norm="rmsnorm", bias="0", tied=0, batch=512, seq=4096, moe_group=1024,
                            precision="bf16", attention="flash", remat="1")


def complete(cfg: Config) -> Config:
    """``cfg`` with :data:`DEFAULTS` filled in when it has experts, and ``moe_group`` the sequence if not
    given (a dense config is left as it is)."""
    return dict(DEFAULTS, **{"moe_group": cfg["seq"], **cfg}) if cfg.get("experts") else cfg


def check(cfg: Config) -> None:
    """A MoE config that cannot be built raises :class:`ScenarioError` naming the key."""
    if not cfg.get("experts"):
        if any(k in cfg for k in NAMES[1:]):
            raise ScenarioError(f"transformer: {[k for k in NAMES[1:] if k in cfg]} without experts; "
                                "set --set experts=E (the number of experts of each MoE layer)")
        return
    if cfg["experts"] < 2 or cfg["top_k"] > cfg["experts"]:
        raise ScenarioError(f"transformer: experts={cfg['experts']}, top_k={cfg['top_k']}: a mixture needs at least "
                            "2 experts and top_k <= experts")
    if cfg["moe_every"] > cfg["layers"]:
        raise ScenarioError(f"transformer: moe_every={cfg['moe_every']} is more than layers={cfg['layers']}: no layer "
                            "would have experts; lower it (1: every layer, 2: every other)")
    if cfg["seq"] % cfg["moe_group"]:
        raise ScenarioError(f"transformer: moe_group={cfg['moe_group']} does not divide seq={cfg['seq']}; routing "
                            "groups are whole pieces of a sequence")
    if cfg["layers_as"] == "loop" and cfg["moe_every"] != 1:
        raise ScenarioError("transformer: layers_as=loop stacks identical layers; with experts it needs moe_every=1")


def layer_tree(layer: dict, cfg: Config, i: int) -> dict:
    """Layer ``i``'s parameter shapes: ``layer`` (a dense layer's) with ``mlp`` replaced by ``moe`` when
    it is a MoE layer."""
    if not is_moe_layer(cfg, i):
        return layer
    return dict(("moe", moe_shapes(cfg)) if k == "mlp" else (k, v) for k, v in layer.items())


def count_delta(cfg: Config) -> tuple[int, int]:
    """What the MoE layers change in ``(param_count, matmul_param_count)`` against dense layers: each
    has a router ``d*E`` and ``E`` experts' matrices and no MLP biases; a token's matmuls go through
    the router and ``top_k`` experts (model FLOPs count those, not the capacity's padding)."""
    moe_layers = sum(is_moe_layer(cfg, i) for i in range(cfg["layers"]))
    d, f, e, m = cfg["d_model"], cfg["d_ff"], cfg.get("experts", 0), 3 if cfg["mlp"] == "swiglu" else 2
    dense, biases = m * d * f, f * (m - 1) + d if cfg["bias"] != "0" else 0
    return (moe_layers * (d * e + e * dense - dense - biases),
            moe_layers * (d * e + (cfg.get("top_k", 1) - 1) * dense))


def kinds(prefix: str, tree: dict, stacked: bool) -> list[ParamKind]:
    """The parameter kinds of a MoE layer's ``moe`` tree below ``prefix`` (``layer_*/moe``): the router
    replicated, every expert matrix ``ep`` on its expert dim and Megatron inside each expert (the
    first matrices column-parallel, the last row-parallel)."""
    lead = 1 if stacked else 0
    mp = {"w_in": 2, "w_gate": 2, "w_up": 2, "w_out": 1, "w_down": 1}
    return [ParamKind(f"{prefix}/{leaf}", len(shape), None if leaf not in mp else mp[leaf] + lead, stacked=stacked,
                      ep_dim=None if leaf not in mp else lead) for leaf, shape in tree.items()]


def capacity(cfg: Config) -> int:
    """Tokens each expert takes from each group: ``ceil(top_k * moe_group * capacity_factor / experts)``."""
    return max(1, math.ceil(cfg["top_k"] * cfg["moe_group"] * float(cfg["capacity_factor"]) / cfg["experts"]))


def is_moe_layer(cfg: Config, i: int) -> bool:
    """Whether layer ``i`` has a MoE MLP: every ``moe_every``-th layer, the last of each run (Switch and
    GShard make every other FFN a MoE layer, counting from the second; Mixtral every one)."""
    return int(cfg.get("experts", 0)) > 0 and (i + 1) % int(cfg["moe_every"]) == 0


def moe_shapes(cfg: Config) -> dict:
    """``params/layer_i/moe`` of a MoE layer."""
    d, f, e = cfg["d_model"], cfg["d_ff"], cfg["experts"]
    mats = {"w_gate": (e, d, f), "w_up": (e, d, f), "w_down": (e, f, d)} if cfg["mlp"] == "swiglu" \
        else {"w_in": (e, d, f), "w_out": (e, f, d)}
    return {"router": (d, e), **mats}


def _route(x, router, cfg: Config):
    """Dispatch and combine tensors [G, S, E, C] (float32) and the auxiliary loss of one layer."""
    import jax
    import jax.numpy as jnp

    g, s, _ = x.shape
    e, k, c = cfg["experts"], cfg["top_k"], capacity(cfg)
    with op_scope("router"):
        xw = wide(x)
        probs = jax.nn.softmax(xw @ as_dtype(router, xw.dtype), axis=-1)          # [G, S, E]
        _, idx = jax.lax.top_k(probs, k)                                        # [G, S, k]
        mask = jax.nn.one_hot(idx, e, dtype=probs.dtype)                        # [G, S, k, E]
        gates = jnp.sum(probs[:, :, None, :] * mask, axis=-1)                   # [G, S, k]
        if k > 1:
            gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        # a choice's place in its expert's buffer, counted in int32 (exact), k-major: every token's
        # first choice before any second choice (flaxformer's TokensChooseMaskedRouter)
        flat = jax.nn.one_hot(jnp.swapaxes(idx, 1, 2).reshape(g, k * s), e, dtype=jnp.int32)
        priority = (jnp.cumsum(flat, axis=1) * flat).reshape(g, k, s, e).swapaxes(1, 2)
        priority = jnp.sum(priority, axis=-1) - 1                               # [G, S, k], 0-based
        # one_hot of a priority >= C is all zeros: the choice is dropped
        slot = jax.nn.one_hot(priority, c, dtype=probs.dtype)                   # [G, S, k, C]
        dispatch = jnp.einsum("gske,gskc->gsec", mask, slot)
        combine = jnp.einsum("gske,gskc,gsk->gsec", mask, slot, gates)
        # load balance: f_e (tokens whose top-k include e) times P_e (mean probability), per group
        f_e = jnp.mean(jnp.sum(mask, axis=2), axis=1)                           # [G, E]
        p_e = jnp.mean(probs, axis=1)
        aux = jnp.mean(f_e * p_e) * (e * e)
    return dispatch, combine, aux


def _experts(h, p: dict, act):
    """Every expert's MLP on its buffer: ``h`` [E, G, C, d] -> [E, G, C, d] (``act``: the activation,
    silu for swiglu's gate)."""
    import jax.numpy as jnp

    def mm(a, w, spec):
        return jnp.einsum(spec, a, as_dtype(w, a.dtype))

    if "w_gate" in p:
        up = act(mm(h, p["w_gate"], "egcd,edf->egcf")) * mm(h, p["w_up"], "egcd,edf->egcf")
        return mm(up, p["w_down"], "egcf,efd->egcd")
    return mm(act(mm(h, p["w_in"], "egcd,edf->egcf")), p["w_out"], "egcf,efd->egcd")


def moe_mlp(x, p: dict, cfg: Config, act):
    """``(y, aux)``: the MoE MLP of ``x`` [G, S, d] (in the compute dtype) and its auxiliary loss;
    ``act`` is the experts' activation (silu for swiglu)."""
    import jax.numpy as jnp

    from partir_emu.compiler.tracing.tag import tag

    dtype, (b, s, d) = x.dtype, x.shape
    x = x.reshape(b * s // cfg["moe_group"], cfg["moe_group"], d)       # the routing groups
    dispatch, combine, aux = _route(x, p["router"], cfg)
    with op_scope("moe_dispatch"):
        expert_in = tag(jnp.einsum("gsec,gsd->egcd", as_dtype(dispatch, dtype), x), DISPATCH)
    expert_out = tag(_experts(expert_in, p, act), COMBINE)
    with op_scope("moe_combine"):
        y = jnp.einsum("gsec,egcd->gsd", as_dtype(combine, dtype), expert_out)
    return y.reshape(b, s, d), aux


def split_aux(out):
    """A layer's output as ``(x, aux)``: a dense layer returns ``x`` alone (aux None)."""
    return out if isinstance(out, tuple) else (out, None)


def add_aux(loss, auxes):
    """``loss`` plus :data:`AUX_WEIGHT` times the sum of the MoE layers' aux losses (``auxes``: one per
    layer, None for a dense one, or the stacked array of a loop over layers); ``loss`` itself when
    there is none."""
    import jax.numpy as jnp

    if auxes is None:
        return loss
    if not isinstance(auxes, list):
        return loss + AUX_WEIGHT * jnp.sum(auxes)
    terms = [a for a in auxes if a is not None]
    return loss + AUX_WEIGHT * functools.reduce(operator.add, terms) if terms else loss


__all__ = ["AUX_WEIGHT", "COMBINE", "DEFAULTS", "DISPATCH", "MIXTRAL_8X7B", "NAMES", "add_aux", "capacity", "check",
           "complete", "count_delta", "is_moe_layer", "kinds", "layer_tree", "moe_mlp", "moe_shapes", "split_aux"]
