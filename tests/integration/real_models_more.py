"""More real-library language models for the tier of ``test_real_model_libraries.py`` (issue 25:
"we hold other libraries and models back"), in its :class:`~tests.integration.real_models.Case`
form; :data:`ALL_CASES` is the tier (these and ``real_models.CASES``).

- **haiku** (dm-haiku 0.0.17): a transformer LM from ``hk.Embed``, ``hk.MultiHeadAttention``
  (``query``/``key``/``value``/``linear``, ``w`` as ``[in, out]``), ``hk.LayerNorm``, ``hk.Linear``;
  and an MLP stack under ``hk.layer_stack`` (one ``lax.scan``; every weight has the layer dim
  first, so Megatron's dims are one later);
- **keras** 3 (``KERAS_BACKEND=jax``): a functional transformer LM from ``keras.layers``
  (``Embedding``, ``MultiHeadAttention``, ``LayerNormalization``, ``Dense``), applied through
  ``model.stateless_call``; ``MultiHeadAttention``'s ``EinsumDense`` kernels keep heads as their own
  axis (``query/kernel [hidden, heads, head_dim]``, ``attention_output/kernel [heads, head_dim,
  hidden]``). Keras layers compute in their dtype policy (float32) whatever their inputs: the float64
  reference is float32 there. (keras-hub's GPT-2, Gemma and Llama causal LMs, built the same way,
  verified under the four strategies when probed; keras-hub is not a test dependency: it requires
  tensorflow-text);
- **flax.nnx** (flax already is a dependency): an LM whose blocks are made by ``nnx.vmap`` and run
  by ``nnx.scan`` under ``nnx.remat``, applied by ``nnx.merge`` from a pure dict; its ``nnx.Embed``
  gets ``dtype=jnp.float64`` (float32 without x64), else it fixes float32 at construction and the
  scan's carry changes type in verify's float64 reference;
- **penzai**: the llama-like transformer with ``use_layer_stack=True`` (one ``pz.nn.LayerStack``,
  a ``lax.scan``; the stack axis first);
- **Equinox**: an LM with ``eqx.nn.RotaryPositionalEmbedding`` in ``MultiheadAttention``'s
  ``process_heads``, ``RMSNorm`` and its blocks under ``eqx.filter_checkpoint``.

``MORE_CASES[name].mp_all_reduces`` are the counts measured under Megatron (bp on ``batch=2``).
"""
from __future__ import annotations

import os
import warnings

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "jax")      # keras picks its backend when first imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tests.integration.real_models import BATCH, CASES, SEQ, VOCAB, Case, D, _lm_step, _numpy_init  # noqa: E402

# --- haiku ------------------------------------------------------------------------------------


def _haiku_lm():
    import haiku as hk

    def fwd(tok):
        x = hk.Embed(VOCAB, D, name="embed")(tok)
        x = x + hk.get_parameter("pos", [SEQ, D], init=hk.initializers.TruncatedNormal(0.02))
        mask = jnp.tril(jnp.ones((SEQ, SEQ)))[None, None]
        for i in range(2):
            h = hk.LayerNorm(-1, True, True, name=f"ln1_{i}")(x)
            x = x + hk.MultiHeadAttention(num_heads=4, key_size=8, w_init=hk.initializers.VarianceScaling(1.0),
                                          name=f"attn_{i}")(h, h, h, mask=mask)
            h = hk.LayerNorm(-1, True, True, name=f"ln2_{i}")(x)
            x = x + hk.Linear(D, name=f"down_{i}")(jax.nn.gelu(hk.Linear(4 * D, name=f"up_{i}")(h)))
        return hk.Linear(VOCAB, name="head")(hk.LayerNorm(-1, True, True, name="ln_f")(x))
    f = hk.without_apply_rng(hk.transform(fwd))
    return _lm_step(f.apply, f.init(jax.random.key(0), np.zeros((BATCH, SEQ), np.int32)))


def _haiku_layer_stack():
    import haiku as hk

    def block(x):
        h = hk.LayerNorm(-1, True, True, name="ln")(x)
        return x + hk.Linear(D, name="down")(jax.nn.gelu(hk.Linear(4 * D, name="up")(h)))

    def fwd(tok):
        return hk.Linear(VOCAB, name="head")(hk.layer_stack(3)(block)(hk.Embed(VOCAB, D, name="embed")(tok)))
    f = hk.without_apply_rng(hk.transform(fwd))
    return _lm_step(f.apply, f.init(jax.random.key(0), np.zeros((BATCH, SEQ), np.int32)))


# --- keras 3 -------------------------------------------------------------------------------------


def _keras_lm():
    import keras
    keras.utils.set_random_seed(0)
    layers = keras.layers
    tok_in = keras.Input((SEQ,), dtype="int32")
    x = layers.Embedding(VOCAB, D, name="embed")(tok_in)
    for i in range(2):
        h = layers.LayerNormalization(name=f"ln1_{i}")(x)
        x = layers.Add()([x, layers.MultiHeadAttention(4, D // 4, name=f"attn_{i}")(h, h, use_causal_mask=True)])
        h = layers.LayerNormalization(name=f"ln2_{i}")(x)
        up = layers.Dense(4 * D, activation="gelu", name=f"up_{i}")(h)
        x = layers.Add()([x, layers.Dense(D, name=f"down_{i}")(up)])
    lm = keras.Model(tok_in, layers.Dense(VOCAB, name="head")(x))
    names = [v.path for v in lm.trainable_variables]
    assert not lm.non_trainable_variables and len(set(names)) == len(names), names
    params = {n: np.asarray(v.value) for n, v in zip(names, lm.trainable_variables)}

    def logits(p, t):
        return lm.stateless_call([p[n] for n in names], [], t, training=False)[0]
    return _lm_step(logits, params)


# keras' MultiHeadAttention keeps heads as their own axis: query/key/value kernels [hidden, heads,
# head_dim] (biases [heads, head_dim]), attention_output [heads, head_dim, hidden]
_KERAS = "params/attn_*"
_KERAS_FLOAT32 = "keras layers compute in their dtype policy (float32)"

# --- flax.nnx ---------------------------------------------------------------------------------------


def _nnx_scan_remat():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln = nnx.LayerNorm(D, rngs=rngs)
            self.up, self.down = nnx.Linear(D, 4 * D, rngs=rngs), nnx.Linear(4 * D, D, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jax.nn.gelu(self.up(self.ln(x))))

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(VOCAB, D, dtype=jnp.float64, rngs=rngs)

            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Block(rngs)
            self.blocks = make(rngs)
            self.head = nnx.Linear(D, VOCAB, rngs=rngs)

        def __call__(self, tok):
            body = nnx.scan(nnx.remat(lambda x, block: block(x)), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            return self.head(body(self.emb(tok), self.blocks))

    with warnings.catch_warnings():       # float64 without x64: float32, with a warning per cast
        warnings.filterwarnings("ignore", "Explicitly requested dtype float64")
        graphdef, state = nnx.split(LM(nnx.Rngs(0)))
    params = state.to_pure_dict()         # pure arrays: Variables made outside grad are not mutable in it

    def logits(p, tok):
        st = nnx.State(state)
        nnx.replace_by_pure_dict(st, p)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Explicitly requested dtype float64")
            return nnx.merge(graphdef, st)(tok)
    return _lm_step(logits, params)


# --- penzai ---------------------------------------------------------------------------------------


def _penzai_llama_stack():
    from penzai import pz
    from penzai.models.transformer.variants import llamalike_common as ll
    cfg = ll.LlamalikeTransformerConfig(
        embedding_dim=D, projection_dim=8, mlp_hidden_dim=2 * D, num_decoder_blocks=2, vocab_size=VOCAB,
        num_kv_heads=2, query_head_multiplier=2, mlp_variant="swiglu", tie_embedder_and_logits=False,
        use_layer_stack=True)
    build = ll.build_llamalike_transformer
    shapes = jax.eval_shape(lambda: {p.label: p.value for p in
                                     pz.unbind_params(build(cfg, init_base_rng=jax.random.key(0)))[1]})
    params = _numpy_init(shapes)
    unbound, _ = pz.unbind_params(build(cfg, init_base_rng=None))

    def logits(p, tok):
        bound = pz.bind_variables(unbound, [pz.ParameterValue(value=v, label=k) for k, v in p.items()])
        return bound(pz.nx.wrap(tok).tag("batch", "seq")).unwrap("batch", "seq", "vocabulary")
    return _lm_step(logits, params)


_PZ = "params/transformer/blocks"

# --- Equinox ------------------------------------------------------------------------------------


def _equinox_rope():
    import equinox as eqx

    class Block(eqx.Module):
        ln1: eqx.nn.RMSNorm
        attn: eqx.nn.MultiheadAttention
        rope: eqx.nn.RotaryPositionalEmbedding
        ln2: eqx.nn.RMSNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.ln1, self.ln2 = eqx.nn.RMSNorm(D), eqx.nn.RMSNorm(D)
            self.attn = eqx.nn.MultiheadAttention(4, D, key=k1)
            self.rope = eqx.nn.RotaryPositionalEmbedding(D // 4)
            self.up, self.down = eqx.nn.Linear(D, 4 * D, key=k2), eqx.nn.Linear(4 * D, D, key=k3)

        def __call__(self, x, mask):
            def heads(q, k, v):          # [seq, heads, head_dim]: the rotation per head
                rot = jax.vmap(self.rope, in_axes=1, out_axes=1)
                return rot(q), rot(k), v
            h = jax.vmap(self.ln1)(x)
            x = x + self.attn(h, h, h, mask=mask, process_heads=heads)
            return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.ln2)(x))))

    class LM(eqx.Module):
        emb: eqx.nn.Embedding
        blocks: list
        head: eqx.nn.Linear

        def __init__(self, key):
            ks = jax.random.split(key, 4)
            self.emb = eqx.nn.Embedding(VOCAB, D, key=ks[0])
            self.blocks = [Block(k) for k in ks[1:3]]
            self.head = eqx.nn.Linear(D, VOCAB, use_bias=False, key=ks[3])

        def __call__(self, tok):
            x = jax.vmap(self.emb)(tok)
            mask = jnp.tril(jnp.ones((tok.shape[0], tok.shape[0]), bool))
            for b in self.blocks:
                x = eqx.filter_checkpoint(b)(x, mask)
            return jax.vmap(self.head)(x)

    params, static = eqx.partition(LM(jax.random.key(0)), eqx.is_array)
    return _lm_step(lambda p, tok: jax.vmap(eqx.combine(p, static))(tok), params)


_EQX = "params/blocks/*"

MORE_CASES: dict[str, Case] = {
    "haiku-lm": Case("haiku", _haiku_lm,
                     {"params/attn_*/linear/w": 0, "params/attn_*/*/w": 1, "params/attn_*/[qkv]*/b": 0,
                      "params/up_*/w": 1, "params/up_*/b": 0, "params/down_*/w": 0}, 2 * 4),
    "haiku-layer-stack": Case("haiku", _haiku_layer_stack,
                              {"params/*/up/w": 2, "params/*/up/b": 1, "params/*/down/w": 1}, 3 * 2,
                              notes="an MLP stack (no attention): one pair a layer"),
    "keras-lm": Case("keras", _keras_lm,
                     {f"{_KERAS}/attention_output/kernel": 0, f"{_KERAS}/*/kernel": 1, f"{_KERAS}/[qkv]*/bias": 0,
                      "params/up_*/kernel": 1, "params/up_*/bias": 0, "params/down_*/kernel": 0}, 2 * 4,
                     float32_in_reference=_KERAS_FLOAT32),
    "nnx-scan-remat": Case("flax.nnx", _nnx_scan_remat,
                           {"params/blocks/up/kernel": 2, "params/blocks/up/bias": 1,
                            "params/blocks/down/kernel": 1}, 3 * 2, notes="an MLP stack: one pair a layer"),
    "penzai-llama-stack": Case("penzai", _penzai_llama_stack,
                               {f"{_PZ}/attention/output.weights/data_array": 1,
                                f"{_PZ}/attention/*.weights/data_array": 2,
                                f"{_PZ}/mlp/out_linear.weights/data_array": 1,
                                f"{_PZ}/mlp/*_linear.weights/data_array": 2}, 2 * 4),
    "equinox-rope": Case("equinox", _equinox_rope,
                         {f"{_EQX}/attn/output_proj/weight": 1, f"{_EQX}/attn/*_proj/weight": 0,
                          f"{_EQX}/up/weight": 0, f"{_EQX}/up/bias": 0, f"{_EQX}/down/weight": 1}, 2 * 4 + 2,
                         float32_in_reference="Equinox's RotaryPositionalEmbedding computes its sin/cos in float32"),
}

ALL_CASES: dict[str, Case] = {**CASES, **MORE_CASES}
