"""FP8 matmuls with per-tensor delayed scaling, as NVIDIA Transformer Engine does them, in plain JAX.

A dense layer ``y = x @ w`` under ``precision=fp8`` (Transformer Engine's ``DelayedScaling`` recipe
with its defaults: ``fp8_format=HYBRID``, ``margin=0``, ``amax_history_len=1024``,
``amax_compute_algo="max"``; TE docs, ``transformer_engine.common.recipe``):

- forward: the input ``x`` and the weight ``w`` are quantised to **E4M3** (``float8_e4m3fn``, max
  448), each with its own per-tensor scale: ``q = clip(v · s, ±max).astype(fp8)``; the product runs
  as one ``dot_general`` on the FP8 operands with ``preferred_element_type`` the accumulation type
  (float32; float64 when the verdict runs the step under x64), so the products of two FP8 numbers
  (at most 4 + 4 significant bits) are exact and only the sum rounds; the result is multiplied by
  ``1 / (s_x · s_w)`` in that type and rounded once to ``x``'s dtype (bfloat16 with
  ``precision=fp8``), as TE's GEMM epilogue does. Under Megatron's row-parallel layers the partial
  sums are therefore the float32 products, and the partitioner reduces them in float32, where TE
  all-reduces its GEMMs' bfloat16 outputs: twice the bytes of those two all-reduces per layer
  (docs/hardware-models.md, "FP8"). Written with a bfloat16 product instead, the partial sums were
  reduced in bfloat16, but each rounded before the sum, an error that FP8 quantisation downstream
  turns into whole FP8 steps that no correct run makes (``mp`` on seed 1 reached 0.90 of the
  verdict's allowance, against 0.36 with float32 partial sums);
- backward (:func:`fp8_matmul` is a ``jax.custom_vjp``): the output gradient is quantised to
  **E5M2** (``float8_e5m2``, max 57344) with its own scale, and both gradient matmuls run on FP8
  operands: ``dx = g_q · w_qᵀ`` (E5M2 × E4M3), accumulated wide, unscaled, cast to ``x``'s dtype
  (float32 partial sums under tensor parallelism, as the forward's), and ``dw = x_qᵀ · g_q`` (E4M3 ×
  E5M2) written in ``x``'s dtype, unscaled in it (the scale rounded to bfloat16) and cast to ``w``'s
  (the float32 master weight), as a bf16 step's weight gradient is: its data-parallel reduction is
  then bfloat16 (nothing quantises it again, so its rounding before the sum stays harmless). The
  FP8 copies of ``x`` and ``w`` are what the forward keeps for the backward, as TE does;
- **delayed scaling**: the scale of each of the three tensors comes from the amax history carried
  as state across steps, ``s = fp8_max / (max(history) · 2^margin)`` (1 while the history is all
  zero, TE's initial scale), so a step quantises with scales its predecessors measured; the step
  records its own ``amax = max|v|`` (of ``x`` and ``w`` in the forward, of the gradient in the
  backward) at the front of the history and drops the oldest entry. Where TE keeps the previous
  scale when the history's max is zero or not finite, this recomputes the scale from the history
  alone, so a non-finite amax gives the initial scale 1 (TE: the scale before it).

**How the new histories leave the step.** The custom VJP returns each tensor's new history as the
"cotangent" of its old one (Flax's ``fp8_ops`` and Praxis do the same): ``jax.grad`` of the loss
with respect to the histories *is* the updated state, through ``jax.checkpoint`` (the forward is
recomputed, the cotangent still comes once per use) and through ``lax.scan`` over stacked layers
(each layer's slice). The step (:func:`fp8_train_step`) takes that gradient as the new state, not
an Adam update. Gradient accumulation would sum those cotangents over micro-batches (the
histories need their max), so ``microbatches > 1`` is refused with ``precision=fp8``.

The state lives in the optimizer state: ``opt/fp8/<path of the weight>/{x,w,g}``, float32 ``[H]``
(``[L, H]`` for a stacked ``layers_as=loop`` weight), beside Adam's ``mu``, ``nu`` and ``count``;
it is replicated (no strategy pattern matches it) and the next step consumes it like the rest of
``opt``. Only the dense layers of the model are FP8 (the projections and the MLP, as TE's
``Linear``/``LayerNormMLP``); the attention core (``q·kᵀ``, ``p·v``), the unembedding and the loss
stay in the activation dtype.

Jax 0.10.2 on CPU runs ``dot_general`` on FP8 operands (E4M3 × E4M3 and mixed E5M2 × E4M3) with
``preferred_element_type``: XLA CPU converts each operand to float32 and runs a float32 GEMM
(measured: its compiled HLO is ``convert`` + f32 ``dot``, and its results equal numpy's float32
product of the FP8 values bit for bit; with bfloat16 as the preferred type, rounded once to it),
which is what the runtime's ``dot_general`` does too
(:mod:`partir_emu.primitives.dot`); its FP8 conversions equal ml_dtypes' bit for bit (2^20 values
each from float32, bfloat16 and float64). So the FP8 dot is in the program as it would be on a GPU,
not emulated by casts around a float32 dot.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from partir_emu.errors import ScenarioError
from scenarios.common import Config
from scenarios.training import adam_init, adam_layout, adam_update
from scenarios.trees import map_leaves

AMAX_HISTORY = 1024     # TE DelayedScaling amax_history_len default (TE >= 1.0)
MARGIN = 0              # TE DelayedScaling margin default
FORWARD, BACKWARD = "float8_e4m3fn", "float8_e5m2"     # TE Format.HYBRID
META = "fp8"            # the key of the state in ``opt`` and the prefix of a weight's histories in a layer
TENSORS = ("x", "w", "g")   # the input, the weight, the output gradient of one FP8 matmul
# the weights that run as FP8 matmuls: the projections of attention and the MLPs' matrices
FP8_WEIGHTS = frozenset({"w_q", "w_k", "w_v", "w_o", "w_in", "w_out", "w_gate", "w_up", "w_down"})
FP8_TABLES = frozenset({"attn", "mlp"})      # (a mixture of experts' weights stay in the activation dtype)


def fp8_matmuls(cfg: Config) -> bool:
    """Whether ``cfg`` runs its dense layers in FP8 (``precision=fp8``)."""
    return cfg.get("precision", "f32") == "fp8"


def check_config(cfg: Config) -> None:
    if fp8_matmuls(cfg) and int(cfg.get("microbatches", 1)) > 1:
        raise ScenarioError(f"precision=fp8 with microbatches={cfg['microbatches']}: the FP8 amax histories leave "
                            "the step as gradients, and gradient accumulation would sum them over micro-batches "
                            "(they need their max); use microbatches=1 with fp8")


# -- the state --------------------------------------------------------------------------------------
def meta_shapes(param_shapes: dict, parent: str = "") -> dict:
    """The amax histories of every FP8 weight of ``param_shapes`` (a matrix of :data:`FP8_WEIGHTS` in
    an ``attn`` or ``mlp`` table): ``{path: {x, w, g: shape}}``, ``(H,)`` per history, ``(L, H)`` for a
    weight stacked over ``L`` layers (rank 3)."""
    out: dict = {}
    for k, v in param_shapes.items():
        if isinstance(v, dict):
            sub = meta_shapes(v, k)
            if sub:
                out[k] = sub
        elif k in FP8_WEIGHTS and parent in FP8_TABLES:
            lead = tuple(v[:1]) if len(v) == 3 else ()
            out[k] = {t: (*lead, AMAX_HISTORY) for t in TENSORS}
    return out


def state_layout(cfg: Config, param_shapes: dict) -> dict:
    """Adam's state layout, with the FP8 histories under ``fp8`` when ``cfg`` asks for FP8."""
    layout = adam_layout(param_shapes)
    if fp8_matmuls(cfg):
        layout[META] = map_leaves(meta_shapes(param_shapes), lambda s: (tuple(s), np.float32))
    return layout


def initial_meta(param_shapes: dict) -> dict:
    """Histories of zeros (numpy): TE's initial state, so the first step quantises with scale 1."""
    return map_leaves(meta_shapes(param_shapes), lambda s: np.zeros(s, np.float32))


def state_hooks(param_shapes: Callable[[Config], dict]) -> dict[str, Callable]:
    """A scenario's ``state_shapes`` and ``make_state`` (:class:`scenarios.common.Scenario`): Adam's
    state, with the amax histories under ``opt/fp8`` when the config asks for FP8."""
    def state_shapes(cfg: Config) -> dict:
        return state_layout(cfg, param_shapes(cfg))

    def make_state(cfg: Config, params: dict, rng: np.random.Generator) -> dict:
        state = adam_init(params)
        if fp8_matmuls(cfg):
            state[META] = initial_meta(param_shapes(cfg))
        return state

    return {"state_shapes": state_shapes, "make_state": make_state}


def graft(params: dict, meta: dict) -> dict:
    """``params`` with each FP8 weight's histories beside it, under ``fp8/<weight>`` (what
    :func:`histories_of` reads in a layer)."""
    out = dict(params)
    for k, v in meta.items():
        if k in FP8_WEIGHTS:
            out[f"{META}/{k}"] = v
        else:
            out[k] = graft(params[k], v)
    return out


def histories_of(p: dict, w: str) -> dict | None:
    """The histories grafted beside weight ``w`` of a layer's parameters, if it runs in FP8."""
    return p.get(f"{META}/{w}")


# -- scaling and quantisation -------------------------------------------------------------------------
def fp8_max(dtype: str) -> float:
    import ml_dtypes

    return float(ml_dtypes.finfo(getattr(ml_dtypes, dtype)).max)


def scale_of(history: Any, dtype: str) -> Any:
    """``fp8_max / (max(history) · 2^margin)``; 1 while the history holds no positive finite amax."""
    import jax.numpy as jnp

    amax = jnp.max(history)
    ok = (amax > 0) & jnp.isfinite(amax)
    safe = jnp.where(ok, amax, jnp.ones_like(amax))
    return jnp.where(ok, np.asarray(fp8_max(dtype) / 2.0 ** MARGIN, history.dtype) / safe, jnp.ones_like(amax))


def quantize(v: Any, dtype: str, scale: Any) -> Any:
    """``clip(v · scale, ±fp8_max).astype(dtype)``, the product in the scale's dtype (TE's cast)."""
    import jax.numpy as jnp

    top = np.asarray(fp8_max(dtype), scale.dtype)
    return jnp.clip(v.astype(scale.dtype) * scale, -top, top).astype(getattr(jnp, dtype))


def pushed(history: Any, v: Any) -> Any:
    """The history with ``max|v|`` in front and its oldest entry dropped."""
    import jax.numpy as jnp

    amax = jnp.max(jnp.abs(v)).astype(history.dtype)
    return jnp.concatenate([amax[None], history[:-1]])


def _dot(a: Any, b: Any, contract: tuple[tuple[int, ...], tuple[int, ...]], acc: Any) -> Any:
    import jax

    return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=acc)


def _make_fp8_matmul(x_dtype: Any, w_dtype: Any) -> Any:
    """The custom-VJP FP8 matmul for inputs of these dtypes (the cotangents leave in them)."""
    import jax

    def forward(x, w, hx, hw, hg):
        sx, sw = scale_of(hx, FORWARD), scale_of(hw, FORWARD)
        xq, wq = quantize(x, FORWARD, sx), quantize(w, FORWARD, sw)
        y = _dot(xq, wq, ((x.ndim - 1,), (0,)), hx.dtype) * (1 / (sx * sw))
        return y.astype(x_dtype), (xq, wq, sx, sw, hg, pushed(hx, x), pushed(hw, w))

    def backward(res, g):
        xq, wq, sx, sw, hg, new_hx, new_hw = res
        sg = scale_of(hg, BACKWARD)
        gq = quantize(g, BACKWARD, sg)
        lead = tuple(range(g.ndim - 1))
        dx = _dot(gq, wq, ((g.ndim - 1,), (1,)), hg.dtype) * (1 / (sg * sw))
        dw = _dot(xq, gq, (lead, lead), x_dtype) * (1 / (sx * sg)).astype(x_dtype)   # (module docstring)
        return dx.astype(x_dtype), dw.astype(w_dtype), new_hx, new_hw, pushed(hg, g)

    @jax.custom_vjp
    def matmul(x, w, hx, hw, hg):
        return forward(x, w, hx, hw, hg)[0]

    matmul.defvjp(forward, backward)
    return matmul


_FP8_MATMULS: dict[tuple[str, str], Any] = {}     # by (x dtype, w dtype): made once each


def fp8_matmul(x: Any, w: Any, meta: dict) -> Any:
    """``x @ w`` (``x`` ``[..., k]``, ``w`` ``[k, n]``) as FP8 matmuls with delayed scaling (module
    docstring), ``meta`` the histories ``{x, w, g}`` of this matmul; the result in ``x``'s dtype."""
    key = (str(x.dtype), str(w.dtype))
    fn = _FP8_MATMULS.get(key)
    if fn is None:
        fn = _FP8_MATMULS[key] = _make_fp8_matmul(x.dtype, w.dtype)
    return fn(x, w, meta["x"], meta["w"], meta["g"])


# -- the training step -------------------------------------------------------------------------------
def fp8_train_step(loss_fn: Any, *, lr: float, grads_only: bool = False) -> Any:
    """``(params, opt, batch) -> (loss, new_params, new_opt)`` for a model with FP8 matmuls: the
    gradient of the loss with respect to the parameters and to ``opt/fp8`` (the amax histories, whose
    "gradients" are their new values, module docstring); Adam on the parameters, the histories
    replaced. ``grads_only``: ``(loss, parameter gradients)``."""
    import jax

    def loss_of(params, meta, batch):
        return loss_fn(graft(params, meta), batch)

    def step(params, opt, batch):
        loss, (grads, new_meta) = jax.value_and_grad(loss_of, argnums=(0, 1))(params, opt[META], batch)
        if grads_only:
            return loss, grads
        new_params, new_opt = adam_update(grads, opt, params, lr=lr)
        return loss, new_params, {**new_opt, META: new_meta}

    return step


__all__ = ["AMAX_HISTORY", "BACKWARD", "FORWARD", "MARGIN", "check_config", "fp8_matmul", "fp8_matmuls",
           "fp8_train_step", "graft", "histories_of", "initial_meta", "meta_shapes", "quantize", "scale_of",
           "state_hooks", "state_layout"]
