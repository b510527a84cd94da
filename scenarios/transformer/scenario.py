"""A decoder-only language-model training step (GPT-style, pre-norm), plain JAX, whose shape
options cover the dense transformers that are trained in practice.

Forward (the model lives in ``scenarios.transformer.model``, attention in ``scenarios.transformer.attention``)::

    x = embed/tokens[tokens] + embed/pos                     gather; its gradient is a scatter-add
    per layer i (params/layer_{i}/...), block=serial:
        x = x + attn(n1(x));  x = x + mlp(n2(x))             n = ln1, ln2: layernorm or rmsnorm
    block=parallel (PaLM): x = x + attn(n1(x)) + mlp(n1(x))  one norm per layer
    attn(h): q = h @ w_q [d, H*Q], k = h @ w_k, v = h @ w_v [d, K*Q] (+ b_q, b_v with bias=1);
        causal softmax(q k^T / sqrt(Q)) v per head (query head h reads kv head h // (H/K));
        merge heads -> @ w_o [H*Q, d] (+ b_o)
    mlp(h): gelu|relu: act(h @ w_in + b_in) @ w_out + b_out        w_in [d, f], w_out [f, d]
            swiglu:    (silu(h @ w_gate + b_gate) * (h @ w_up + b_up)) @ w_down + b_down
    logits = final_ln(x) @ unembed/w [d, vocab]  (tied=1: @ embed/tokens^T, no unembed/w)
    loss = mean cross-entropy(log_softmax(logits), one_hot(targets))

``batch/tokens`` and ``batch/targets`` are int32 [batch, seq]; ``targets`` are the next tokens
(``make_inputs`` draws random tokens and shifts them by one). Adam (by hand,
``scenarios.common.adam_update``). ``remat=1`` wraps each layer in ``jax.checkpoint`` (the
backward pass recomputes the layer's activations; the compiler inlines the recomputation, so
memory and time models see it).

**Config** (every key is a ``--set`` name; a config dict holds all of them once resolved):

=============  ==========================  =====================================================
key            values (default)            meaning
=============  ==========================  =====================================================
batch, seq     int                         sequences per step, tokens per sequence
d_model        int                         residual width d
heads          int                         query heads H
head_dim       int (d_model // heads)      Q; the attention width H*Q may differ from d_model
kv_heads       int (heads)                 K key/value heads: 1 multi-query, < H grouped-query;
                                           must divide heads
d_ff           int                         MLP width f
layers, vocab  int                         L, V
remat          0|1|full|selective|minimal|dots|op (0)
                                           what the backward pass recomputes: 0 nothing; 1 = full
                                           each layer (jax.checkpoint); selective only the attention
                                           core (Korthikanti et al. 2022); minimal the layer but the
                                           outputs of dots without batch dims (MaxText's
                                           remat_policy=minimal); dots the layer but every dot output
                                           (jax's dots_saveable); op the layer but every other dot's
                                           output and the attention core's (torchtitan's per-op
                                           selective AC, ``model.EverySecondDot``)
microbatches   int (1)                     gradient accumulation: K forward/backward passes over
                                           batch/K rows each (one ``lax.scan``), gradients summed,
                                           one Adam step (``scenarios.training.train_step``);
                                           with ``pipeline`` the pipeline's micro-batches
layers_as      unrolled|loop (unrolled)    loop: the layers are one ``lax.scan`` over
                                           ``params/layers/...`` (each leaf stacked on dim 0),
                                           as MaxText and PaLM-style code write it; the
                                           partitioner sees one layer (``core.loops``)
precision      f32|bf16|fp8 (f32)          bf16: bf16 matmul inputs, activations, gradients;
                                           float32 master weights, Adam state, norms, softmax
                                           and loss (see ``scenarios.transformer.model``);
                                           fp8: bf16 with the projections and MLP matrices as
                                           FP8 matmuls, per-tensor delayed scaling as
                                           Transformer Engine (``scenarios.fp8``; amax
                                           histories in ``opt/fp8``; microbatches=1)
mlp            gelu|relu|swiglu (gelu)     swiglu has w_gate, w_up [d, f] and w_down [f, d]
block          serial|parallel (serial)    parallel: PaLM's attention and MLP side by side
tied           0|1 (0)                     1: the unembedding is embed/tokens^T
norm           layernorm|rmsnorm           rmsnorm has a scale and no bias
               (layernorm)
bias           mlp|0|1 (mlp)               biases in: mlp = the MLP only (the model before these
                                           options), 0 = nowhere, 1 = attention projections
                                           (b_q, b_v, b_o; no key bias, see below) and MLP;
                                           norm biases follow ``norm``
attention      naive|flash|ring (naive)    flash: the flash-attention core, one fused kernel
                                           (``scenarios.transformer.attention``); same values as naive;
                                           ring: ring attention in ``ring_blocks`` (1) sequence
                                           blocks (``scenarios.transformer.ring_attention``)
pipeline       int (1)                     P > 1: the layers as P pipeline stages over
virtual_stages int (1)                     ``microbatches`` micro-batches, V chunks a stage
                                           (circular); stacks the layers (``layers_as=loop``),
                                           stage-major (``scenarios.transformer.pipeline``)
schedule       gpipe|1f1b (gpipe)          1f1b: PipeDream-flush, remat=1, interleaved with
                                           virtual_stages (``pipeline_1f1b``)
experts        int (none: dense)           mixture of experts: E experts, ``top_k`` (2) a token,
                                           in every ``moe_every``-th (1) layer; ``capacity_factor``
                                           (1.25), ``moe_group`` (seq): ``scenarios.transformer.moe``
=============  ==========================  =====================================================

The defaults reproduce the original model exactly. There is no key bias ``b_k`` (Megatron and
GPT-2 have one, Whisper drops it): softmax is invariant to adding ``q·b_k`` to every score of a query,
so its gradient is exactly zero, and Adam would turn that zero's rounding noise into updates of
size ``lr`` that no verification can hold to a reference. Megatron's count is ``L*K*Q`` higher
(0.003 % of the 1.7 B model); no FLOPs change.

To build a config for a published model, start from any preset and override every size and
every option the model sets (a preset's own options stay otherwise: ``t32`` and ``t48`` are
bf16, flash attention, remat=1); pass them as a dict. Megatron-LM 1.7B, for example::

    sc = get_scenario("transformer")
    cfg = sc.config("t32", dict(batch=512, seq=2048, d_model=2304, heads=24, d_ff=4 * 2304, layers=24,
                                vocab=51200, tied=1, mlp="gelu", norm="layernorm", bias=1, block="serial",
                                attention="naive", precision="bf16", remat=1))
    sc.model_flops(cfg), sc.param_count(cfg)

``head_dim`` and ``kv_heads`` are derived when absent (``d_model // heads``, ``heads``); ints and
strings both work for switches and choices (``bias=1`` or ``"1"``); an unknown value raises
``ScenarioError`` naming the key, the value and the allowed ones.

Presets: ``tiny``, ``small`` (emulation; f32, naive), ``t32``, ``t48`` (simulation only; bf16,
flash attention, remat).

Parameter count (closed form, :func:`param_count`), with d, f, V, s = seq, L, A = H*Q, B = K*Q::

    V*d + s*d                                            embeddings (token table, positions)
    + L * (2*d*A + 2*d*B + m*d*f                         attention, MLP (m = 3 for swiglu, else 2)
           + [bias=1] (A + B + d) + [bias!=0] (f*(m-1) + d)        biases
           + n * d * (2 if layernorm else 1))            norms (n = 2 serial, 1 parallel)
    + d * (2 if layernorm else 1) + [tied=0] d*V         final norm, unembedding

The default presets: ``tiny`` 5,504 params, ``small`` 930,560, ``t32`` 2,780,124,160
(≈ 2.78 B), ``t48`` 5,752,510,464 (≈ 5.75 B).

**Model FLOPs** of one training step (:func:`model_flops`; the numerator of MFU), as the PaLM
paper counts them (Chowdhery et al. 2022, appendix B)::

    6 * N * tokens + 12 * L * H * Q * seq * tokens          tokens = batch * seq

with ``N`` (:func:`matmul_param_count`) the parameters that take part in matmuls: every layer's
attention and MLP weight matrices plus the unembedding ``d*V`` (the tied table counts once, for
that matmul); not the position embeddings, not the untied input table (a lookup is not a matmul),
not biases or norm scales (elementwise). No recomputation (remat), no elementwise FLOPs; the
attention term is not halved for the causal mask.

Megatron (``mp``): ``w_q`` and ``mlp/w_in`` (or ``w_gate``, ``w_up``) column-parallel (dim 1;
their biases dim 0), ``w_o`` and ``mlp/w_out`` (``w_down``) row-parallel (dim 0; their biases
replicated); ``w_k``/``w_v`` (and ``b_v``) column-parallel when ``kv_heads`` is divisible
by the ``model`` axis, else replicated on it (every device computes all key/value heads, as
Megatron and PaLM do for multi-query attention). Embeddings, norms and the unembedding are
replicated on ``model``. Needs ``heads`` and ``d_ff`` divisible by the ``model`` axis.
"""
from __future__ import annotations

import math

import numpy as np

from partir_emu.errors import ScenarioError
from scenarios import fp8
from scenarios.common import Config, ParamKind, Scenario
from scenarios.strategies import EMB_STRATEGY_NAMES, STRATEGY_NAMES, make_strategies
from scenarios.transformer import model as transformer_model
from scenarios.transformer import moe, pipeline, pipeline_1f1b, ring_attention

SIZE_NAMES = ("batch", "seq", "d_model", "heads", "d_ff", "layers", "vocab", "remat", "head_dim", "kv_heads",
              "microbatches", "precision", "mlp", "block", "tied", "norm", "bias", "attention", "layers_as", *moe.NAMES,
              *pipeline.NAMES, *ring_attention.NAMES)
CHOICES: dict[str, tuple[str, ...]] = {
    "layers_as": ("unrolled", "loop"), "remat": ("0", "1", "full", "selective", "minimal", "dots", "op"),
    "precision": ("f32", "bf16", "fp8"), "mlp": ("gelu", "relu", "swiglu"), "block": ("serial", "parallel"),
    "norm": ("layernorm", "rmsnorm"), "bias": ("mlp", "0", "1"), "attention": ("naive", "flash", "ring"),
    "schedule": ("gpipe", "1f1b"),          # a pipeline's (scenarios.transformer.pipeline, pipeline_1f1b)
}
FLAG_NAMES = ("tied",)
# the original model; head_dim and kv_heads are derived (complete_config)
DEFAULTS: Config = dict(remat="0", microbatches=1, precision="f32", mlp="gelu", block="serial", tied=0, norm="layernorm",
                        bias="mlp", attention="naive", layers_as="unrolled")

PRESETS: dict[str, Config] = {
    "tiny": dict(DEFAULTS, batch=8, seq=8, d_model=16, heads=4, d_ff=32, layers=2, vocab=32),
    "small": dict(DEFAULTS, batch=16, seq=64, d_model=128, heads=8, d_ff=512, layers=4, vocab=512),
    # full sizes are trained as such models are: bf16 with float32 master weights, flash attention,
    # and each layer's activations recomputed in the backward pass (only the residual stream is kept)
    "t32": dict(DEFAULTS, batch=256, seq=2048, d_model=2560, heads=32, d_ff=10240, layers=32, vocab=50304,
                remat="1", precision="bf16", attention="flash"),
    "t48": dict(DEFAULTS, batch=512, seq=2048, d_model=3072, heads=32, d_ff=12288, layers=48, vocab=50304,
                remat="1", precision="bf16", attention="flash"),
    "mixtral-8x7b": dict(DEFAULTS, **moe.MIXTRAL_8X7B),      # sizes and sources: scenarios.transformer.moe
}


def complete_config(cfg: Config) -> Config:
    """``cfg`` with every option present: the defaults, ``head_dim = d_model // heads`` and
    ``kv_heads = heads`` where absent."""
    out = dict(DEFAULTS, **cfg)
    out.update({k: str(out[k]) for k in CHOICES if k in out})      # bias=1 written as an int means "1"
    if "head_dim" not in out:
        if out["d_model"] % out["heads"]:
            raise ScenarioError(f"transformer: d_model={out['d_model']} is not divisible by heads={out['heads']}; "
                                "change --set d_model=... or heads=..., or set head_dim=...")
        out["head_dim"] = out["d_model"] // out["heads"]
    out.setdefault("kv_heads", out["heads"])
    return pipeline.complete(moe.complete(out))


def _mlp_mats(cfg: Config) -> tuple[str, ...]:
    return ("w_gate", "w_up", "w_down") if cfg["mlp"] == "swiglu" else ("w_in", "w_out")


def param_shapes(cfg: Config) -> dict:
    cfg = complete_config(cfg)
    d, f, v, s = cfg["d_model"], cfg["d_ff"], cfg["vocab"], cfg["seq"]
    a, kv = cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
    ln = (lambda: {"scale": (d,)}) if cfg["norm"] == "rmsnorm" else (lambda: {"scale": (d,), "bias": (d,)})
    attn = {"w_q": (d, a), "w_k": (d, kv), "w_v": (d, kv), "w_o": (a, d)}
    if cfg["bias"] == "1":
        attn.update(b_q=(a,), b_v=(kv,), b_o=(d,))      # no key bias: see the module docstring
    if cfg["mlp"] == "swiglu":
        mlp = {"w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
        biases = {"b_gate": (f,), "b_up": (f,), "b_down": (d,)}
    else:
        mlp = {"w_in": (d, f), "b_in": (f,), "w_out": (f, d), "b_out": (d,)}
        biases = {"b_in": (f,), "b_out": (d,)}
    if cfg["bias"] == "0":
        mlp = {k: v for k, v in mlp.items() if k not in biases}
    elif cfg["mlp"] == "swiglu":
        mlp.update(biases)
    shapes: dict = {"embed": {"tokens": (v, d), "pos": (s, d)}}
    layer = {"ln1": ln(), "attn": dict(attn)}
    if cfg["block"] == "serial":
        layer["ln2"] = ln()
    layer["mlp"] = dict(mlp)
    if cfg["layers_as"] == "loop":     # one tree, every leaf with the layers stacked on dim 0
        shapes["layers"] = _stacked(moe.layer_tree(layer, cfg, 0), cfg["layers"])
    else:
        for i in range(cfg["layers"]):
            shapes[f"layer_{i}"] = {k: dict(v) for k, v in moe.layer_tree(layer, cfg, i).items()}
    shapes["final_ln"] = ln()
    if not cfg["tied"]:
        shapes["unembed"] = {"w": (d, v)}
    return shapes


def _stacked(tree: dict, n: int) -> dict:
    return {k: _stacked(v, n) if isinstance(v, dict) else (n, *v) for k, v in tree.items()}


def _stack_trees(trees: list) -> dict:
    return {k: _stack_trees([t[k] for t in trees]) if isinstance(trees[0][k], dict) else np.stack([t[k] for t in trees])
            for k in trees[0]}


def batch_shapes(cfg: Config) -> dict:
    shape = (cfg["batch"], cfg["seq"])
    return {"tokens": (shape, np.int32), "targets": (shape, np.int32)}


def matmul_param_count(cfg: Config) -> int:
    """``N`` of :func:`model_flops`: the parameters that take part in matmuls."""
    cfg = complete_config(cfg)
    d, f, L = cfg["d_model"], cfg["d_ff"], cfg["layers"]
    a, kv = cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
    return L * (2 * d * a + 2 * d * kv + len(_mlp_mats(cfg)) * d * f) + d * cfg["vocab"] + moe.count_delta(cfg)[1]


def param_count(cfg: Config) -> int:
    cfg = complete_config(cfg)
    d, f, v, s, L = cfg["d_model"], cfg["d_ff"], cfg["vocab"], cfg["seq"], cfg["layers"]
    a, kv = cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
    m = len(_mlp_mats(cfg))
    per_norm = 2 * d if cfg["norm"] == "layernorm" else d
    norms = 2 if cfg["block"] == "serial" else 1
    biases = (a + kv + d if cfg["bias"] == "1" else 0) + (f * (m - 1) + d if cfg["bias"] != "0" else 0)
    layer = 2 * d * a + 2 * d * kv + m * d * f + biases + norms * per_norm
    return v * d + s * d + L * layer + per_norm + (0 if cfg["tied"] else d * v) + moe.count_delta(cfg)[0]


def model_flops(cfg: Config) -> int:
    cfg = complete_config(cfg)
    tokens = cfg["batch"] * cfg["seq"]
    attn = 12 * cfg["layers"] * cfg["heads"] * cfg["head_dim"] * cfg["seq"] * tokens
    return 6 * matmul_param_count(cfg) * tokens + attn


def make_params(cfg: Config, rng: np.random.Generator) -> dict:
    """Initial parameters; with ``layers_as=loop`` the very values of ``layers_as=unrolled`` (same
    draws), each layer's stacked on dim 0, so both forms of one config compute the same step."""
    cfg = complete_config(cfg)
    if cfg["layers_as"] == "loop":
        flat = make_params(dict(cfg, layers_as="unrolled", pipeline=1, virtual_stages=1), rng)
        layers = [flat.pop(f"layer_{i}") for i in range(cfg["layers"])]
        layers = [layers[i] for i in pipeline.layer_order(cfg)]    # a pipeline's are stored stage-major
        flat["layers"] = _stack_trees(layers)
        return flat

    def init(path: str, shape: tuple[int, ...]) -> np.ndarray:
        leaf = path.rsplit("/", 1)[-1]
        if leaf == "scale":
            return np.ones(shape, np.float32)
        if leaf.startswith("b") and len(shape) == 1:          # bias, b_in, b_q, ...
            return np.zeros(shape, np.float32)
        std = 0.02 if path.startswith("embed") else 1.0 / math.sqrt(shape[-2])    # fan-in ([E, d, f]: d)
        return (std * rng.standard_normal(shape)).astype(np.float32)

    def walk(tree: dict, prefix: str) -> dict:
        return {k: walk(v, f"{prefix}{k}/") if isinstance(v, dict) else init(prefix + k, v)
                for k, v in tree.items()}

    return walk(param_shapes(cfg), "")


def make_batch(cfg: Config, rng: np.random.Generator) -> dict:
    tokens = rng.integers(0, cfg["vocab"], size=(cfg["batch"], cfg["seq"] + 1), dtype=np.int32)
    return {"tokens": np.ascontiguousarray(tokens[:, :-1]), "targets": np.ascontiguousarray(tokens[:, 1:])}


def make_step(cfg: Config, *, lr: float = 1e-2, grads_only: bool = False):
    """The training step ``(params, opt, batch) -> (loss, new_params, new_opt)``; with
    ``grads_only`` the same step stopped before the optimizer: ``-> (loss, grads)``."""
    return transformer_model.make_step(complete_config(cfg), lr=lr, grads_only=grads_only)


def param_kinds(cfg: Config | None, model_size: int = 1) -> tuple[ParamKind, ...]:
    """The parameter kinds of ``cfg`` (``None``: the defaults) and what Megatron shards on a
    ``model`` axis of ``model_size``; key/value projections only when ``kv_heads`` divides."""
    c = complete_config(cfg) if cfg is not None else dict(DEFAULTS, heads=1, kv_heads=1)
    shapes = param_shapes(dict(c, d_model=1, heads=1, head_dim=1, kv_heads=1, d_ff=1, vocab=1, seq=1,
                               layers=c.get("moe_every", 1)))     # with experts: a dense layer and a MoE one
    kv_dim = 1 if cfg is None or c["kv_heads"] % model_size == 0 else None
    mp = {"w_q": 1, "w_k": kv_dim, "w_v": kv_dim, "w_o": 0, "b_q": 0, "b_v": 0 if kv_dim else None,
          "w_in": 1, "b_in": 0, "w_out": 0, "w_gate": 1, "b_gate": 0, "w_up": 1, "b_up": 0, "w_down": 0}
    kinds = []
    loop = c["layers_as"] == "loop"
    for top, tree in shapes.items():
        prefix = "layer_*" if top.startswith("layer_") else top
        for name, sub in tree.items():
            if name == "moe":
                kinds += moe.kinds(f"{prefix}/{name}", sub, stacked=loop)
            elif isinstance(sub, dict) and loop and top == "layers":    # stacked: dim 0 is the layer
                kinds += [ParamKind(f"{prefix}/{name}/{leaf}", len(shape),
                                    None if mp.get(leaf) is None else mp[leaf] + 1, stacked=True)
                          for leaf, shape in sub.items()]
            elif isinstance(sub, dict):
                kinds += [ParamKind(f"{prefix}/{name}/{leaf}", len(shape), mp.get(leaf))
                          for leaf, shape in sub.items()]
            else:
                kinds.append(ParamKind(f"{prefix}/{name}", len(sub), None, emb_dim=_EMB_DIMS.get(f"{prefix}/{name}")))
    return tuple(dict.fromkeys(kinds))      # each kind once (the layers share them)


# the vocabulary dim of the tables the ``emb`` strategies shard (the unembedding's, or with
# ``tied=1`` the one table's, which then serves lookup and logits)
_EMB_DIMS = {"embed/tokens": 0, "unembed/w": 1}

PARAM_KINDS = param_kinds(None)


def _check_config(cfg: Config) -> None:
    pipeline.check(cfg)
    pipeline_1f1b.check(cfg)
    ring_attention.check(cfg)
    moe.check(cfg)
    fp8.check_config(cfg)
    if cfg["microbatches"] < 1 or cfg["batch"] % cfg["microbatches"]:
        raise ScenarioError(f"transformer: microbatches={cfg['microbatches']} does not divide batch={cfg['batch']}; "
                            "gradient accumulation needs equal micro-batches (set batch to a multiple of it)")
    if cfg["heads"] % cfg["kv_heads"]:
        raise ScenarioError(f"transformer: kv_heads={cfg['kv_heads']} does not divide heads={cfg['heads']}; "
                            "grouped-query attention needs whole groups (kv_heads=1 is multi-query)")


def _check_mp(cfg: Config, model_size: int) -> None:
    if cfg["heads"] % model_size:
        raise ScenarioError(f"strategy with 'mp': heads={cfg['heads']} is not divisible by the 'model' axis "
                            f"(size {model_size}); Megatron attention shards whole heads")


SCENARIO = Scenario(
    name="transformer",
    description="decoder-only LM training step (causal attention, gelu/relu/swiglu MLP, Adam; --set options)",
    size_names=SIZE_NAMES,
    presets=PRESETS,
    simulation_only=frozenset({"t32", "t48", "mixtral-8x7b"}),
    make_step=make_step,
    param_shapes=param_shapes,
    batch_shapes=batch_shapes,
    make_params=make_params,
    make_batch=make_batch,
    param_count=param_count,
    model_flops=model_flops,
    param_kinds=PARAM_KINDS,
    strategies=make_strategies(param_kinds, param_shapes, check_mp=_check_mp, seq_dim=1,
                               names=STRATEGY_NAMES + EMB_STRATEGY_NAMES),
    check_config=_check_config,
    flag_names=FLAG_NAMES,
    float_names=("capacity_factor",),
    strategy_notes={"bp+ep, bp+mp+ep, bp+ep+z3": "with --set experts=E and a mesh axis 'expert': GShard's expert "
                    "parallelism (all_to_all dispatch and combine)",
                    "pp, bp+pp, bp+mp+pp, bp+mp+sp+pp+z3": "with --set pipeline=P,microbatches=M (virtual_stages=V: "
                    "circular) and a mesh axis 'stage' of P: SPMD pipelining, collective_permute between stages",
                    "cp, bp+cp, bp+mp+cp, pp+cp": "with --set attention=ring,ring_blocks=C and a mesh axis 'context' "
                    "of C: ring attention, key/value blocks passed round by collective_permute (another attention "
                    "core gathers them)"},
    choices=CHOICES,
    complete_config=complete_config,
    param_kinds_for=param_kinds,
    program_meta=pipeline_1f1b.program_meta,
    **fp8.state_hooks(param_shapes),         # Adam's state, and the FP8 amax histories with precision=fp8
)

__all__ = ["SCENARIO", "PRESETS", "SIZE_NAMES", "CHOICES", "DEFAULTS", "complete_config", "param_count",
           "matmul_param_count", "model_flops", "param_kinds", "param_shapes", "make_step"]
