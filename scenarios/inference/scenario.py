"""Decoder-only transformer inference with a KV cache: one ``prefill`` or one ``decode`` step
(``--set phase=prefill|decode``), the model of ``scenarios.inference.model``.

The step is ``(params, cache, batch) -> (logits, new_cache)``: its state is the KV cache
(``Scenario.state_name = "cache"``), and output ``1/...`` (the new cache) keeps the layout of
input ``cache/...``, so the next step consumes it as it is. Not a training step: no optimizer,
and ``--strict`` checks the step itself elementwise.

**Config**: ``batch``; ``prompt_len`` P (prefill: the prompt's tokens; decode: the positions
already in the cache, the new token is written at P); ``cache_len`` T (the static cache length;
P <= T for prefill, P < T for decode); ``d_model`` d, ``heads`` H, ``head_dim`` Q (default
d // H), ``kv_heads`` K (1 = multi-query, as PaLM; must divide H), ``d_ff`` f, ``layers`` L,
``vocab`` V; ``phase``; ``precision`` f32|bf16 (bf16: bfloat16 weights, activations and
cache, as served; float32 norm statistics, softmax and logits), ``mlp`` gelu|swiglu, ``block`` serial|parallel,
``norm`` layernorm|rmsnorm, ``tied`` 0|1 (the unembedding is ``embed/tokens^T``).

**Parameter count** (closed form, :func:`param_count`; no biases), with A = H*Q, B = K*Q,
m = 3 for swiglu else 2, n = 2 norms per layer for serial blocks, 1 for parallel, and
g = 2 (layernorm: scale, bias) or 1 (rmsnorm)::

    V*d + T*d + L*(2*d*A + 2*d*B + m*d*f + n*g*d) + g*d + [tied=0] d*V

**Model FLOPs** of one step (:func:`model_flops`), the forward-only count of Pope et al. 2022
(2 FLOPs per parameter per token) plus attention over the cache::

    tokens = batch * s   (s = P for prefill, 1 for decode)
    2 * N_L * tokens + 2 * d * V * batch + 4 * L * H * Q * T * tokens

``N_L`` the layers' matmul parameters (attention and MLP matrices; ``N = N_L + d*V`` with the
unembedding, :func:`matmul_param_count`), the unembedding counted once per sequence (the step
computes the logits of the last position only; not the lookup tables); the attention term counts q·k and p·v over all T positions of the static cache that
the step computes (masked positions included, not halved).

**Presets.** ``tiny`` (emulation, multi-query). Simulation only, the PaLM models as Pope et al.
2022 ("Efficiently Scaling Transformer Inference", MLSys 2023) serve them with multi-query
attention and a 2048-token context; the sizes are PaLM's (Chowdhery et al. 2022, Table 1: 62B
d=8192, L=64, H=32; 540B d=18432, L=118, H=48; Q=256, f=4d, SwiGLU, parallel blocks,
multi-query, shared input/output embedding, V=256k), bf16:

- ``palm540b-decode``: batch 64, 1920 tokens in the cache, cache 2048 (their chatbot example:
  a 1920-token history, generating with a 2048-token context at low batch);
- ``palm540b-prefill``: batch 512 × 2048-token prompts (their large-batch prefill regime; the
  batch is our choice of a large one);
- ``palm62b-decode``: the 62B model at the decode sizes of ``palm540b-decode``.

The PartIR paper's MQ tactic follows Pope et al.'s multi-query partitioning (section 3.3):
strategies in :mod:`scenarios.inference.strategies`.
"""
from __future__ import annotations

import math

import numpy as np

from partir_emu.core.dtypes import np_dtype
from scenarios.common import Config, ParamKind, Scenario
from scenarios.inference import model as inference_model
from scenarios.inference.config import CHOICES, FLAG_NAMES, PRESETS, SIZE_NAMES, check_config, complete_config
from scenarios.inference.strategies import STRATEGIES


def _mlp_mats(cfg: Config) -> dict:
    d, f = cfg["d_model"], cfg["d_ff"]
    if cfg["mlp"] == "swiglu":
        return {"w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    return {"w_in": (d, f), "w_out": (f, d)}


def param_shapes(cfg: Config) -> dict:
    cfg = complete_config(cfg)
    d, v = cfg["d_model"], cfg["vocab"]
    a, kv = cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
    ln = (lambda: {"scale": (d,)}) if cfg["norm"] == "rmsnorm" else (lambda: {"scale": (d,), "bias": (d,)})
    shapes: dict = {"embed": {"tokens": (v, d), "pos": (cfg["cache_len"], d)}}
    for i in range(cfg["layers"]):
        layer = {"ln1": ln(), "attn": {"w_q": (d, a), "w_k": (d, kv), "w_v": (d, kv), "w_o": (a, d)}}
        if cfg["block"] == "serial":
            layer["ln2"] = ln()
        layer["mlp"] = _mlp_mats(cfg)
        shapes[f"layer_{i}"] = layer
    shapes["final_ln"] = ln()
    if not cfg["tied"]:
        shapes["unembed"] = {"w": (d, v)}
    return shapes


def cache_dtype(cfg: Config) -> np.dtype:
    """The dtype of the cache and of the weights: bfloat16 with ``precision=bf16`` (inference
    keeps no float32 master weights), else float32."""
    return np_dtype("bfloat16") if cfg.get("precision", "f32") == "bf16" else np.dtype(np.float32)


def cache_shapes(cfg: Config) -> dict:
    """The cache as a nested dict of ``(shape, dtype)``."""
    cfg = complete_config(cfg)
    kv = ((cfg["batch"], cfg["cache_len"], cfg["kv_heads"], cfg["head_dim"]), cache_dtype(cfg))
    out: dict = {"pos": ((), np.dtype(np.int32))}
    for i in range(cfg["layers"]):
        out[f"layer_{i}"] = {"k": kv, "v": kv}
    return out


def step_len(cfg: Config) -> int:
    """Tokens per sequence in one step: the prompt for prefill, one for decode."""
    return cfg["prompt_len"] if cfg["phase"] == "prefill" else 1


def batch_shapes(cfg: Config) -> dict:
    return {"tokens": ((cfg["batch"], step_len(cfg)), np.int32)}


def matmul_param_count(cfg: Config) -> int:
    """``N`` of :func:`model_flops`: the attention and MLP matrices and the unembedding."""
    cfg = complete_config(cfg)
    d, L = cfg["d_model"], cfg["layers"]
    a, kv = cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
    mlp = sum(math.prod(s) for s in _mlp_mats(cfg).values())
    return L * (2 * d * a + 2 * d * kv + mlp) + d * cfg["vocab"]


def param_count(cfg: Config) -> int:
    cfg = complete_config(cfg)
    d, f, v, t, L = cfg["d_model"], cfg["d_ff"], cfg["vocab"], cfg["cache_len"], cfg["layers"]
    a, kv = cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
    m = 3 if cfg["mlp"] == "swiglu" else 2
    g = 2 if cfg["norm"] == "layernorm" else 1
    n = 2 if cfg["block"] == "serial" else 1
    return v * d + t * d + L * (2 * d * a + 2 * d * kv + m * d * f + n * g * d) + g * d + (0 if cfg["tied"] else d * v)


def model_flops(cfg: Config) -> int:
    cfg = complete_config(cfg)
    tokens = cfg["batch"] * step_len(cfg)
    unembed = cfg["d_model"] * cfg["vocab"]
    attn = 4 * cfg["layers"] * cfg["heads"] * cfg["head_dim"] * cfg["cache_len"] * tokens
    return 2 * (matmul_param_count(cfg) - unembed) * tokens + 2 * unembed * cfg["batch"] + attn


def make_params(cfg: Config, rng: np.random.Generator) -> dict:
    cfg = complete_config(cfg)

    def init(path: str, shape: tuple[int, ...]) -> np.ndarray:
        if path.endswith("scale"):
            return np.ones(shape, np.float32)
        if path.endswith("ln1/bias") or path.endswith("ln2/bias") or path.endswith("final_ln/bias"):
            return np.zeros(shape, np.float32)
        std = 0.02 if path.startswith("embed") else 1.0 / math.sqrt(shape[0])
        return (std * rng.standard_normal(shape)).astype(np.float32)

    dtype = cache_dtype(cfg)

    def walk(tree: dict, prefix: str) -> dict:
        return {k: walk(v, f"{prefix}{k}/") if isinstance(v, dict) else init(prefix + k, v).astype(dtype)
                for k, v in tree.items()}

    return walk(param_shapes(cfg), "")


def make_cache(cfg: Config, params: dict, rng: np.random.Generator) -> dict:
    """The cache a step starts from: empty (zeros, ``pos = 0``) for prefill; for decode,
    ``prompt_len`` positions already filled (random keys and values of unit scale, as a
    prefill's would be) and ``pos = prompt_len``."""
    cfg = complete_config(cfg)
    out: dict = {}
    for name, leaf in cache_shapes(cfg).items():
        if name == "pos":
            out[name] = np.asarray(0 if cfg["phase"] == "prefill" else cfg["prompt_len"], np.int32)
            continue
        out[name] = {}
        for kv, (shape, dtype) in leaf.items():
            arr = np.zeros(shape, np.float32)
            if cfg["phase"] == "decode":
                arr[:, :cfg["prompt_len"]] = rng.standard_normal((shape[0], cfg["prompt_len"], *shape[2:]))
            out[name][kv] = arr.astype(dtype)
    return out


def make_batch(cfg: Config, rng: np.random.Generator) -> dict:
    return {"tokens": rng.integers(0, cfg["vocab"], size=(cfg["batch"], step_len(cfg)), dtype=np.int32)}


def make_step(cfg: Config):
    """The ``phase`` step ``(params, cache, batch) -> (logits, new_cache)``."""
    return inference_model.make_step(complete_config(cfg))


PARAM_KINDS = (
    ParamKind("layer_*/attn/w_q", 2, 1), ParamKind("layer_*/attn/w_k", 2, None),
    ParamKind("layer_*/attn/w_v", 2, None), ParamKind("layer_*/attn/w_o", 2, 0),
    ParamKind("layer_*/mlp/w_in", 2, 1), ParamKind("layer_*/mlp/w_out", 2, 0),
)

SCENARIO = Scenario(
    name="inference",
    description="decoder-only LM inference over a KV cache: one prefill or decode step (--set phase=...)",
    size_names=SIZE_NAMES,
    presets=PRESETS,
    simulation_only=frozenset(p for p in PRESETS if p != "tiny"),
    make_step=make_step,
    param_shapes=param_shapes,
    batch_shapes=batch_shapes,
    make_params=make_params,
    make_batch=make_batch,
    param_count=param_count,
    model_flops=model_flops,
    param_kinds=PARAM_KINDS,
    strategies=STRATEGIES,
    check_config=check_config,
    flag_names=FLAG_NAMES,
    choices=CHOICES,
    complete_config=complete_config,
    state_name="cache",
    state_shapes=cache_shapes,
    make_state=make_cache,
    state_outputs={"1": "cache"},
    training=False,
    param_dtype=cache_dtype,
)

__all__ = ["SCENARIO", "PRESETS", "SIZE_NAMES", "complete_config", "param_count", "matmul_param_count",
           "model_flops", "param_shapes", "cache_shapes", "make_step"]
