"""Tiny models from real model libraries, each with an optax AdamW training step and its Megatron
patterns (issue 25 item 5; used by ``test_real_model_libraries.py``).

The libraries and what comes from each: HF transformers' Flax models (decoders GPT-2, GPT-Neo,
Llama, Mistral, OPT, BLOOM; encoders BERT, DistilBERT; seq2seq BART; vision ViT; speech Whisper),
penzai's transformer variants (llama-like, gemma-like, GPT-NeoX) and an
Equinox transformer LM built from ``eqx.nn`` layers. Every model is built by its library's own
code at a tiny configuration, random init, nothing downloaded (``HF_HUB_OFFLINE=1``). HF's and
penzai's parameters are drawn with numpy (normal, std 0.02; norm scales 1 + that) in the shapes
and names their own initialisers give when run abstractly (``jax.eval_shape``): run for real,
those dispatch op by op and cost 3-7 s a model, the draw costs nothing. Equinox initialises its
own (cheap).

Megatron's patterns differ per library because the layouts do:

- HF GPT-2 keeps ``Conv1D`` kernels as ``[out, in]`` (``c_fc``/``c_attn`` column-parallel on dim 0,
  the ``c_proj``s row-parallel on dim 1) and fuses q|k|v in ``c_attn``, whose dim 0 cannot be
  tiled without resharding (the pieces q, k, v each get a part of the fused dim's tiling), nor
  can the attention's ``c_proj`` alone (its tiling reaches ``v`` through the heads, and the fused
  gradient concatenates dq|dk|dv): its Megatron tiles the MLP and leaves attention replicated;
  :data:`GPT2_ATTENTION_MP` adds the attention, which lowers with the all-gathers and the
  warning that names the fused projection;
- HF GPT-Neo, Llama, Mistral, BERT, BART, OPT, DistilBERT, ViT and Whisper use ``nn.Dense``:
  ``[in, out]`` (column-parallel dim 1 with its bias dim 0, row-parallel dim 0); so does BLOOM,
  whose fused q|k|v is head-major (``[heads, 3, head_dim]``): unlike GPT-2's, it tiles;
- penzai's weights are ``NamedArray``s, named ``.../query.weights/data_array``, with heads as
  their own axis (``[embedding, head_groups, query_heads, projection]``): tile the heads axis;
- Equinox's ``Linear`` is ``[out, in]`` like GPT-2's Conv1D, without fusion.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")         # nothing here may reach a hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

VOCAB, SEQ, BATCH, D = 64, 8, 4, 32


@dataclass(frozen=True)
class Case:
    """One model: its library, a builder returning ``(args, step)`` and its Megatron patterns
    (pytree-path glob -> dim, first match wins, as in ``ManualPartition``)."""

    library: str
    build: Callable[[], tuple[tuple, Callable]]
    megatron: dict[str, int]
    # all-reduces over 'model' (alone or with 'batch') under Megatron: one forward and one backward
    # per column/row-parallel pair and layer, plus what the notes say
    mp_all_reduces: int
    notes: str = ""
    # why verify's float64 reference still computes partly in float32 ("": it does not)
    float32_in_reference: str = ""
    # the step's data arguments, each with the batch on dim 0 (bp tiles them on 'batch')
    inputs: tuple[str, ...] = ("tokens",)


def _tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)


def _train_step(loss_fn: Callable, params: Any, **data: np.ndarray) -> tuple[tuple, Callable]:
    """``(params, opt_state, *data)`` and an AdamW step ``step(params, opt, *data) -> (loss, params,
    opt)`` over ``loss_fn(params, *data)``; its data arguments are named as ``data``'s keys (the
    program's input names, which the schedules' patterns match)."""
    tx = optax.adamw(1e-3)

    def step(params, opt, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt = tx.update(grads, opt, params)
        return loss, optax.apply_updates(params, updates), opt

    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    step.__signature__ = inspect.Signature([inspect.Parameter(n, positional) for n in ("params", "opt", *data)])
    return (params, tx.init(params), *data.values()), step


def _next_token_loss(out: Any, tokens: Any) -> Any:
    return optax.softmax_cross_entropy_with_integer_labels(out[:, :-1], tokens[:, 1:]).mean()


def _lm_step(logits: Callable, params: Any) -> tuple[tuple, Callable]:
    """``(params, opt_state, tokens)`` and a next-token AdamW step ``step(params, opt, tokens) ->
    (loss, params, opt)`` over ``logits(params, tokens) -> [batch, seq, vocab]``."""
    return _train_step(lambda p, tokens: _next_token_loss(logits(p, tokens), tokens), params, tokens=_tokens())


def _numpy_init(abstract: Any, seed: int = 0, std: float = 0.02) -> Any:
    """Parameters of the given shapes: normal(0, std) (HF's initializer_range), norm scales 1 + that."""
    rng = np.random.default_rng(seed)

    def draw(path, x):
        name = jax.tree_util.keystr(path).lower()
        base = 1.0 if x.ndim == 1 and ("norm" in name or "ln_" in name) and "bias" not in name else 0.0
        return (base + std * rng.standard_normal(x.shape)).astype(x.dtype)
    return jax.tree_util.tree_map_with_path(draw, abstract)


# --- HF transformers (Flax) -------------------------------------------------------------------

def _hf(cls_name: str, config: Callable[[Any], Any], call: str) -> Callable[[], tuple[tuple, Callable]]:
    def build():
        import transformers
        # dtype float64: HF's modules cast activations to their dtype (float32 by default) even under
        # x64, which would make verify's float64 reference a float32 run; float64 is float32
        # without x64 (jax truncates it, with a warning per cast, silenced) and float64 with it
        with _float64_module_warnings():
            model = getattr(transformers, cls_name)(config(transformers), seed=0, _do_init=False, dtype=jnp.float64)
            shape = model.input_shape if call in ("vision", "speech") else (1, SEQ)    # an image, a spectrogram
            params = _numpy_init(jax.eval_shape(lambda: model.init_weights(jax.random.key(0), shape)))
        module = model.module
        pos = np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ))

        def apply(p, *args):
            with _float64_module_warnings():
                return module.apply({"params": p}, *args, deterministic=True).logits

        if call == "vision":       # ViT: NHWC pixels -> class logits; each image its own class
            def classify(p, pixels):
                out = apply(p, pixels)
                return optax.softmax_cross_entropy_with_integer_labels(out, jnp.arange(BATCH) % out.shape[-1]).mean()
            return _train_step(classify, params, pixels=_normal((BATCH, *model.input_shape[1:])))
        if call == "speech":       # Whisper: [batch, mel bins, frames] features; the tokens on the decoder side
            def transcribe(p, features, tokens):
                return _next_token_loss(apply(p, features, tokens, jnp.ones_like(tokens), pos), tokens)
            return _train_step(transcribe, params, features=_normal((BATCH, *model.input_shape[1:])), tokens=_tokens())

        def logits(p, tok):
            ones = jnp.ones_like(tok)
            if call == "encoder":      # BERT: ids, mask, token types, positions, head mask
                return apply(p, tok, ones, jnp.zeros_like(tok), pos, None)
            if call == "seq2seq":      # BART: the tokens on both sides
                return apply(p, tok, ones, tok, ones, pos, pos)
            if call == "no-positions":     # BLOOM (ALiBi), DistilBERT: ids and mask
                return apply(p, tok, ones)
            return apply(p, tok, ones, pos)
        return _lm_step(logits, params)
    return build


def _normal(shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(1).standard_normal(shape).astype(np.float32)


@contextlib.contextmanager
def _float64_module_warnings():
    """Without x64 a float64 module warns at each cast (jax truncates it to float32) and where it
    builds its attention mask from ``finfo(float64).min`` (-inf in float32: the same softmax)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Explicitly requested dtype float64")
        warnings.filterwarnings("ignore", "overflow encountered in cast", RuntimeWarning)
        yield


_GPT2 = "params/transformer/h/*"
# GPT-2's attention as Megatron would tile it, were q, k, v separate: c_attn column-parallel on its
# fused dim 0, c_proj row-parallel (dim 1); the fused dim cannot carry the tiling (module docstring)
GPT2_ATTENTION_MP = {f"{_GPT2}/attn/c_attn/kernel": 0, f"{_GPT2}/attn/c_attn/bias": 0, f"{_GPT2}/attn/c_proj/kernel": 1}
_LLAMA = "params/model/layers/*"
_LLAMA_MP = {f"{_LLAMA}/self_attn/o_proj/kernel": 0, f"{_LLAMA}/self_attn/*_proj/kernel": 1,
             f"{_LLAMA}/mlp/down_proj/kernel": 0, f"{_LLAMA}/mlp/*_proj/kernel": 1}
# HF's Flax Llama and Mistral compute RMSNorm in float32 (an explicit cast) and, for any other
# module dtype, the attention weights (attention_softmax_in_fp32): about a tenth of the equations of
# their float64 reference stay float32, which the verdict names
_LLAMA_FLOAT32 = "RMSNorm and attention weights cast to float32 by the library"
_BERT = "params/bert/encoder/layer/*"
_BART = "params/model/*/layers/*"


def _dense_mp(layers: str) -> dict[str, int]:
    """BART's layout (OPT, Whisper alike): ``*attn/{q,k,v,out}_proj``, ``fc1``, ``fc2`` under ``layers``."""
    return {f"{layers}/*attn/out_proj/kernel": 0, f"{layers}/*attn/*_proj/kernel": 1,
            f"{layers}/*attn/[qkv]_proj/bias": 0, f"{layers}/fc1/kernel": 1, f"{layers}/fc1/bias": 0,
            f"{layers}/fc2/kernel": 0}


_BLOOM = "params/transformer/h/*"
_DISTILBERT = "params/distilbert/transformer/layer/*"
_VIT = "params/vit/encoder/layer/*"

# --- penzai -----------------------------------------------------------------------------------


def _penzai(variant: str) -> Callable[[], tuple[tuple, Callable]]:
    def build():
        from penzai import pz
        from penzai.models.transformer.variants import gpt_neox
        from penzai.models.transformer.variants import llamalike_common as ll
        common = dict(embedding_dim=D, projection_dim=8, mlp_hidden_dim=2 * D, num_decoder_blocks=2, vocab_size=VOCAB)
        if variant == "llama":
            cfg = ll.LlamalikeTransformerConfig(num_kv_heads=2, query_head_multiplier=2, mlp_variant="swiglu",
                                                tie_embedder_and_logits=False, **common)
            builder = ll.build_llamalike_transformer
        elif variant == "gemma":     # gemma 2's shape: MQA, GeGLU, tied embeddings, local/global layers, soft caps
            cfg = ll.LlamalikeTransformerConfig(
                num_kv_heads=1, query_head_multiplier=4, mlp_variant="geglu_approx", tie_embedder_and_logits=True,
                attention_type=(ll.AttentionTypeSlidingWindowCausal(4), ll.AttentionTypeGlobalCausal()),
                use_post_attn_norm=True, use_post_ffw_norm=True, final_logit_softcap=30.0, attn_logits_soft_cap=50.0,
                **common)
            builder = ll.build_llamalike_transformer
        else:
            cfg = gpt_neox.GPTNeoXTransformerConfig(
                num_attention_heads=4, activation_fn="gelu_exact", rope_subset_size=4, rope_wavelength=10_000.0,
                layernorm_epsilon=1e-5, parameter_dtype=jnp.float32, activation_dtype=jnp.float32, **common)
            builder = gpt_neox.build_gpt_neox_transformer
        # the parameters' names and shapes from penzai's own initialisers run abstractly, values drawn
        # by numpy (run for real, they dispatch op by op: 7 s a model); the model itself with slots
        shapes = jax.eval_shape(lambda: {p.label: p.value for p in
                                         pz.unbind_params(builder(cfg, init_base_rng=jax.random.key(0)))[1]})
        params = _numpy_init(shapes)                   # named by penzai's own labels
        unbound, _ = pz.unbind_params(builder(cfg, init_base_rng=None))

        def logits(p, tok):
            bound = pz.bind_variables(unbound, [pz.ParameterValue(value=v, label=k) for k, v in p.items()])
            return bound(pz.nx.wrap(tok).tag("batch", "seq")).unwrap("batch", "seq", "vocabulary")
        return _lm_step(logits, params)
    return build


_PZ = "params/transformer/block_*"
# heads are an axis of their own: query [embedding, head_groups, query_heads, projection] (llama),
# [embedding, query_heads, projection] (gemma's MQA: key/value have no heads axis, replicated),
# output [heads..., projection, embedding]; the MLP is [embedding, neurons] / [neurons, embedding]
_PZ_LLAMA_MP = {f"{_PZ}/attention/output.weights/data_array": 0, f"{_PZ}/attention/*.weights/data_array": 1,
                f"{_PZ}/mlp/out_linear.weights/data_array": 0, f"{_PZ}/mlp/*_linear.weights/data_array": 1}
_PZ_GEMMA_MP = {f"{_PZ}/attention/output.weights/data_array": 0, f"{_PZ}/attention/query.weights/data_array": 1,
                f"{_PZ}/mlp/out_linear.weights/data_array": 0, f"{_PZ}/mlp/*_linear.weights/data_array": 1}
_PZ_NEOX_MP = {f"{_PZ}/attention/output/Linear.weights/data_array": 0,
               f"{_PZ}/attention/*/Linear.weights/data_array": 1, f"{_PZ}/attention/[qkv]*/AddBias.bias/data_array": 0,
               f"{_PZ}/mlp/out/Linear.weights/data_array": 0, f"{_PZ}/mlp/in/Linear.weights/data_array": 1,
               f"{_PZ}/mlp/in/AddBias.bias/data_array": 0}


# --- Equinox ----------------------------------------------------------------------------------

def _equinox() -> tuple[tuple, Callable]:
    import equinox as eqx

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
            self.attn = eqx.nn.MultiheadAttention(4, D, key=k1)
            self.up, self.down = eqx.nn.Linear(D, 4 * D, key=k2), eqx.nn.Linear(4 * D, D, key=k3)

        def __call__(self, x, mask):
            h = jax.vmap(self.ln1)(x)
            x = x + self.attn(h, h, h, mask=mask)
            return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.ln2)(x))))

    class LM(eqx.Module):
        emb: eqx.nn.Embedding
        blocks: list
        ln: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key):
            ks = jax.random.split(key, 4)
            self.emb = eqx.nn.Embedding(VOCAB, D, key=ks[0])
            self.blocks = [Block(k) for k in ks[1:3]]
            self.ln = eqx.nn.LayerNorm(D)
            self.head = eqx.nn.Linear(D, VOCAB, use_bias=False, key=ks[3])

        def __call__(self, tok):
            x = jax.vmap(self.emb)(tok)
            mask = jnp.tril(jnp.ones((tok.shape[0], tok.shape[0]), bool))
            for b in self.blocks:
                x = b(x, mask)
            return jax.vmap(self.head)(jax.vmap(self.ln)(x))

    params, static = eqx.partition(LM(jax.random.key(0)), eqx.is_array)
    return _lm_step(lambda p, tok: jax.vmap(eqx.combine(p, static))(tok), params)


_EQX = "params/blocks/*"

CASES: dict[str, Case] = {
    "hf-gpt2": Case("transformers", _hf("FlaxGPT2LMHeadModel", lambda t: t.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=D, n_layer=2, n_head=4), "lm"),
        {f"{_GPT2}/mlp/c_fc/kernel": 0, f"{_GPT2}/mlp/c_fc/bias": 0, f"{_GPT2}/mlp/c_proj/kernel": 1}, 2 * 2,
        notes="Conv1D [out, in]; attention replicated (fused q|k|v, see GPT2_ATTENTION_MP)"),
    "hf-gpt-neo": Case("transformers", _hf("FlaxGPTNeoForCausalLM", lambda t: t.GPTNeoConfig(
        vocab_size=VOCAB, max_position_embeddings=16, hidden_size=D, num_layers=2, num_heads=4,
        attention_types=[[["global", "local"], 1]], window_size=4, intermediate_size=2 * D), "lm"),
        {f"{_GPT2}/attn/attention/out_proj/kernel": 0, f"{_GPT2}/attn/attention/*_proj/kernel": 1,
         f"{_GPT2}/mlp/c_fc/kernel": 1, f"{_GPT2}/mlp/c_fc/bias": 0, f"{_GPT2}/mlp/c_proj/kernel": 0}, 2 * 4),
    "hf-llama": Case("transformers", _hf("FlaxLlamaForCausalLM", lambda t: t.LlamaConfig(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16), "lm"), _LLAMA_MP, 2 * 4,
        float32_in_reference=_LLAMA_FLOAT32),
    "hf-mistral": Case("transformers", _hf("FlaxMistralForCausalLM", lambda t: t.MistralConfig(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, sliding_window=4), "lm"), _LLAMA_MP, 2 * 4,
        float32_in_reference=_LLAMA_FLOAT32),
    "hf-bert": Case("transformers", _hf("FlaxBertForMaskedLM", lambda t: t.BertConfig(
        vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * D,
        max_position_embeddings=16), "encoder"),
        {f"{_BERT}/attention/self/*/kernel": 1, f"{_BERT}/attention/self/*/bias": 0,
         f"{_BERT}/intermediate/dense/kernel": 1, f"{_BERT}/intermediate/dense/bias": 0,
         f"{_BERT}/output/dense/kernel": 0}, 2 * 4 + 2 * 2,
        notes="attention/output/dense and output/dense both row-parallel (dim 0); +2 a layer: the backward "
              "adds the residual's cotangent to dq's partial sum before dk's and dv's (add_any order), so "
              "q, k and v's input gradients are reduced one by one"),
    "hf-bart": Case("transformers", _hf("FlaxBartForConditionalGeneration", lambda t: t.BartConfig(
        vocab_size=VOCAB, d_model=D, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=2 * D, decoder_ffn_dim=2 * D, max_position_embeddings=16),
        "seq2seq"),
        _dense_mp(_BART), 5 * 2 + 5,
        notes="self-attention and the decoder's cross-attention alike (5 pairs); +2 per self-attention and +1 "
              "for the cross-attention's k, v: input gradients reduced one by one, as BERT's"),
    "hf-opt": Case("transformers", _hf("FlaxOPTForCausalLM", lambda t: t.OPTConfig(
        vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, ffn_dim=2 * D, num_attention_heads=4,
        max_position_embeddings=16, word_embed_proj_dim=D), "lm"), _dense_mp("params/model/decoder/layers/*"), 2 * 4),
    "hf-bloom": Case("transformers", _hf("FlaxBloomForCausalLM", lambda t: t.BloomConfig(
        vocab_size=VOCAB, hidden_size=D, n_layer=2, n_head=4), "no-positions"),
        {f"{_BLOOM}/self_attention/query_key_value/kernel": 1, f"{_BLOOM}/self_attention/query_key_value/bias": 0,
         f"{_BLOOM}/self_attention/dense/kernel": 0, f"{_BLOOM}/mlp/dense_h_to_4h/kernel": 1,
         f"{_BLOOM}/mlp/dense_h_to_4h/bias": 0, f"{_BLOOM}/mlp/dense_4h_to_h/kernel": 0}, 2 * 4,
        notes="q|k|v fused as GPT-2's but head-major ([heads, 3, head_dim] on the fused dim): a tile of the fused "
              "dim is whole heads' q, k and v, so Megatron tiles it without resharding",
        float32_in_reference="ALiBi slopes and the attention softmax computed in float32 by the library"),
    "hf-distilbert": Case("transformers", _hf("FlaxDistilBertForMaskedLM", lambda t: t.DistilBertConfig(
        vocab_size=VOCAB, dim=D, n_layers=2, n_heads=4, hidden_dim=2 * D, max_position_embeddings=16), "no-positions"),
        {f"{_DISTILBERT}/attention/out_lin/kernel": 0, f"{_DISTILBERT}/attention/*_lin/kernel": 1,
         f"{_DISTILBERT}/attention/[qkv]_lin/bias": 0, f"{_DISTILBERT}/ffn/lin1/kernel": 1,
         f"{_DISTILBERT}/ffn/lin1/bias": 0, f"{_DISTILBERT}/ffn/lin2/kernel": 0}, 2 * 4 + 2 * 2,
        notes="post-LayerNorm as BERT: q, k and v's input gradients reduced one by one (+2 a layer)"),
    "hf-vit": Case("transformers", _hf("FlaxViTForImageClassification", lambda t: t.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=2 * D, num_labels=10), "vision"),
        {f"{_VIT}/attention/attention/*/kernel": 1, f"{_VIT}/attention/attention/*/bias": 0,
         f"{_VIT}/attention/output/dense/kernel": 0, f"{_VIT}/intermediate/dense/kernel": 1,
         f"{_VIT}/intermediate/dense/bias": 0, f"{_VIT}/output/dense/kernel": 0}, 2 * 4, inputs=("pixels",),
        notes="pre-LayerNorm: q, k and v's input gradients meet before the norm, one all-reduce"),
    "hf-whisper": Case("transformers", _hf("FlaxWhisperForConditionalGeneration", lambda t: t.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, d_model=D, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=2 * D, decoder_ffn_dim=2 * D, max_source_positions=8,
        max_target_positions=16, decoder_start_token_id=0, pad_token_id=1, bos_token_id=0, eos_token_id=2), "speech"),
        _dense_mp(_BART), 5 * 2 + 1, inputs=("features", "tokens"),
        notes="BART's layout, pre-LayerNorm; +1: the cross-attention's k, v read the encoder's output, its q the "
              "decoder's (two input gradients)"),
    "penzai-llama": Case("penzai", _penzai("llama"), _PZ_LLAMA_MP, 2 * 4),
    "penzai-gemma": Case("penzai", _penzai("gemma"), _PZ_GEMMA_MP, 2 * 4 + 2 * 2,
                         notes="MQA: key/value replicated, their gradients summed over the query heads "
                               "(+2 a layer)"),
    "penzai-gpt-neox": Case("penzai", _penzai("neox"), _PZ_NEOX_MP, 2 * 4 + 2 * 2,
                            notes="+2 a layer over (batch, model): the gradients of the biases added after "
                                  "the row-parallel projections"),
    "equinox-lm": Case("equinox", _equinox,
                       {f"{_EQX}/attn/output_proj/weight": 1, f"{_EQX}/attn/*_proj/weight": 0,
                        f"{_EQX}/up/weight": 0, f"{_EQX}/up/bias": 0, f"{_EQX}/down/weight": 1}, 2 * 4),
}
