"""The ``unet`` scenario's model, plain JAX (NHWC): DDPM's U-Net (Ho et al. 2020, arXiv 2006.11239,
its ``diffusion_tf/models/unet.py``) and its denoising loss. The parameter tree is
:func:`param_tree` (``scenarios.unet.scenario.param_shapes``); the architecture and its tiling choices
are described in ``scenarios.unet.scenario``.

Mixed precision (``precision=bf16``) as ``scenarios.transformer.model`` does it: float32 parameters
(master weights) cast to bfloat16 where they are used, so convs, matmuls, activations and their
gradients are bfloat16; GroupNorm statistics, the softmax, the timestep path (embedding, its MLP
and each block's projection of it, [batch, ·] matmuls, added to the block in float32), the
noising of x0 and the loss are float32, their outputs cast back. ``precision=f32`` emits no cast.

Every 3×3 conv is ``lax.conv_general_dilated`` with 'SAME' padding (stride 1, or stride 2 for
downsampling); 1×1 projections (attention q/k/v/o, the channel-changing shortcut) are matmuls over
the channel dim; upsampling is nearest-neighbour by broadcast + reshape (no FLOPs, no window op).
"""
from __future__ import annotations

import math

import numpy as np

from scenarios.common import Config
from scenarios.precision import as_dtype, compute_dtype, wide
from scenarios.training import train_step

EPS = 1e-5
COSINE_S = 0.008          # the cosine schedule's offset (Nichol & Dhariwal 2021, eq. 17)


def level_channels(cfg: Config) -> list[int]:
    """Channels of each level: ``channels * mult digit``."""
    return [cfg["channels"] * int(d) for d in str(cfg["mult"])]


# -- the architecture: levels, parameter tree, layers --------------------------------------------

def level_geometry(cfg: Config) -> list[tuple[int, int, bool]]:
    """(width, resolution, attention?) of each level."""
    return [(c, cfg["image"] >> i, (cfg["image"] >> i) == cfg["attn_res"])
            for i, c in enumerate(level_channels(cfg))]


def _res_shapes(a: int, c: int, e: int) -> dict:
    out = {"norm1": {"scale": (a,), "bias": (a,)}, "conv1": {"w": (3, 3, a, c), "b": (c,)},
           "tproj": {"w": (e, c), "b": (c,)}, "norm2": {"scale": (c,), "bias": (c,)},
           "conv2": {"w": (3, 3, c, c), "b": (c,)}}
    if a != c:
        out["skip"] = {"w": (a, c), "b": (c,)}
    return out


def _attn_shapes(c: int) -> dict:
    out = {"norm": {"scale": (c,), "bias": (c,)}, **{n: {"w": (c, c), "b": (c,)} for n in "qkvo"}}
    out["k"] = {"w": (c, c)}                   # no key bias: see scenarios.unet.scenario
    return out


def param_tree(cfg: Config) -> dict:
    """The parameter tree's shapes (``scenarios.unet.scenario.param_shapes``; ``cfg`` complete)."""
    ch, nres, e, levels = cfg["channels"], cfg["res_blocks"], 4 * cfg["channels"], level_geometry(cfg)
    shapes: dict = {"temb": {"dense0": {"w": (ch, e), "b": (e,)}, "dense1": {"w": (e, e), "b": (e,)}},
                    "conv_in": {"w": (3, 3, cfg["in_ch"], ch), "b": (ch,)}}
    skips, cur = [ch], ch
    for i, (c, _, attn) in enumerate(levels):
        lv: dict = {}
        for j in range(nres):
            lv[f"block_{j}"] = _res_shapes(cur, c, e)
            cur = c
            if attn:
                lv[f"attn_{j}"] = _attn_shapes(c)
            skips.append(cur)
        if i != len(levels) - 1:
            lv["down"] = {"w": (3, 3, cur, cur), "b": (cur,)}
            skips.append(cur)
        shapes[f"down_{i}"] = lv
    shapes["mid"] = {"block_0": _res_shapes(cur, cur, e), "attn": _attn_shapes(cur), "block_1": _res_shapes(cur, cur, e)}
    for i in reversed(range(len(levels))):
        c, _, attn = levels[i]
        lv = {}
        for j in range(nres + 1):
            lv[f"block_{j}"] = _res_shapes(cur + skips.pop(), c, e)
            cur = c
            if attn:
                lv[f"attn_{j}"] = _attn_shapes(c)
        if i != 0:
            lv["up"] = {"w": (3, 3, cur, cur), "b": (cur,)}
        shapes[f"up_{i}"] = lv
    shapes["out"] = {"norm": {"scale": (cur,), "bias": (cur,)}, "conv": {"w": (3, 3, cur, cfg["in_ch"]),
                                                                         "b": (cfg["in_ch"],)}}
    return shapes


def layers(cfg: Config) -> list[tuple[str, int, int, int]]:
    """The model's layers in order as (kind, in width, out width, resolution of the output):
    kinds ``res``, ``attn``, ``down``, ``up`` (the layers ``scenarios.unet.scenario.param_count`` and
    ``model_flops`` sum over, as :func:`param_tree` builds them)."""
    ch, nres, levels = cfg["channels"], cfg["res_blocks"], level_geometry(cfg)
    out: list[tuple[str, int, int, int]] = []
    skips, cur = [ch], ch
    for i, (c, r, attn) in enumerate(levels):
        for _ in range(nres):
            out.append(("res", cur, c, r))
            cur = c
            out += [("attn", c, c, r)] if attn else []
            skips.append(cur)
        if i != len(levels) - 1:
            out.append(("down", cur, cur, r // 2))
            skips.append(cur)
    out += [("res", cur, cur, levels[-1][1]), ("attn", cur, cur, levels[-1][1]), ("res", cur, cur, levels[-1][1])]
    for i in reversed(range(len(levels))):
        c, r, attn = levels[i]
        for _ in range(nres + 1):
            out.append(("res", cur + skips.pop(), c, r))
            cur = c
            out += [("attn", c, c, r)] if attn else []
        if i != 0:
            out.append(("up", cur, cur, 2 * r))
    return out


# -- the model ------------------------------------------------------------------------------------

def swish(x):
    import jax

    return x * jax.nn.sigmoid(x)


def group_norm(x, p: dict, groups: int):
    """GroupNorm over (H, W, channels of a group), per example, with a per-channel scale and bias."""
    import jax
    import jax.numpy as jnp

    b, h, w, c = x.shape
    dtype = x.dtype
    g = wide(x).reshape(b, h, w, groups, c // groups)
    mean = jnp.mean(g, axis=(1, 2, 4), keepdims=True)
    gc = g - mean
    var = jnp.mean(gc * gc, axis=(1, 2, 4), keepdims=True)
    y = (gc * jax.lax.rsqrt(var + EPS)).reshape(b, h, w, c)
    return as_dtype(y * p["scale"] + p["bias"], dtype)


def conv(x, p: dict, stride: int = 1):
    """3×3 'SAME' conv, kernel ``p["w"]`` [3, 3, in, out] (HWIO), plus bias."""
    from jax import lax

    y = lax.conv_general_dilated(x, as_dtype(p["w"], x.dtype), (stride, stride), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + as_dtype(p["b"], x.dtype)


def dense(x, p: dict):
    """A matmul over the last dim (a 1×1 conv on NHWC), plus the bias if it has one, in ``x``'s dtype."""
    y = x @ as_dtype(p["w"], x.dtype)
    return y + as_dtype(p["b"], x.dtype) if "b" in p else y


def upsample(x):
    """Nearest-neighbour ×2 by broadcast + reshape: each row/column repeated, H stays major."""
    import jax.numpy as jnp

    b, h, w, c = x.shape
    y = jnp.broadcast_to(x[:, :, None, :, None, :], (b, h, 2, w, 2, c))
    return y.reshape(b, 2 * h, 2 * w, c)


def res_block(x, temb, p: dict, groups: int):
    """DDPM's resnet block: GN, swish, conv, + dense(swish(temb)), GN, swish, conv; a 1×1 shortcut
    (``skip``) when the channels change. (DDPM's dropout is left out: the step is deterministic.)"""
    h = conv(swish(group_norm(x, p["norm1"], groups)), p["conv1"])
    # the timestep path is float32 (temb is): the gradient of tproj is a per-example sum over the
    # image of the cotangent, which GN2 makes nearly cancel; rounded to bfloat16 per device before
    # the all-reduce of a spatially tiled step, its sign was noise
    h = as_dtype(wide(h) + dense(swish(temb), p["tproj"])[:, None, None, :], h.dtype)
    h = conv(swish(group_norm(h, p["norm2"], groups)), p["conv2"])
    if "skip" in p:
        x = dense(x, p["skip"])
    return x + h


def attn_block(x, p: dict, groups: int, heads: int):
    """Self-attention over the H·W positions (non-causal), ``heads`` heads of C/heads, residual."""
    import jax
    import jax.numpy as jnp

    b, hh, ww, c = x.shape
    s, dh = hh * ww, c // heads
    h = group_norm(x, p["norm"], groups).reshape(b, s, c)      # H major: a tiled H tiles the positions
    q = dense(h, p["q"]).reshape(b, s, heads, dh)
    k = dense(h, p["k"]).reshape(b, s, heads, dh)
    v = dense(h, p["v"]).reshape(b, s, heads, dh)
    scores = wide(jnp.einsum("bqhd,bkhd->bhqk", q, k)) * np.float32(1.0 / math.sqrt(dh))
    w = as_dtype(jax.nn.softmax(scores, axis=-1), x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, c)
    return x + dense(out, p["o"]).reshape(b, hh, ww, c)


def timestep_embedding(t, dim: int):
    """DDPM's sinusoidal embedding of the (int) timesteps: [sin(t·f), cos(t·f)], f geometric."""
    import jax.numpy as jnp

    half = dim // 2
    freqs = np.exp(-np.arange(half) * (math.log(10000.0) / (half - 1))).astype(np.float32)
    arg = t.astype(jnp.float32)[:, None] * freqs[None, :]
    return jnp.concatenate([jnp.sin(arg), jnp.cos(arg)], axis=1)


def alpha_bar(t, timesteps: int):
    """ᾱ_t of the cosine schedule, in closed form (so the step needs no table lookup)."""
    import jax.numpy as jnp

    f = lambda u: jnp.cos((u + COSINE_S) / (1.0 + COSINE_S) * (math.pi / 2))
    u = t.astype(jnp.float32) / np.float32(timesteps)
    return (f(u) / np.float32(math.cos(COSINE_S / (1.0 + COSINE_S) * math.pi / 2))) ** 2


def forward(params: dict, x, t, cfg: Config):
    """The predicted noise ε_θ(x_t, t), [batch, image, image, in_ch]."""
    groups, heads, nres = cfg["groups"], cfg["heads"], cfg["res_blocks"]
    chans = level_channels(cfg)
    levels = len(chans)
    dtype = compute_dtype(cfg)
    tp = params["temb"]
    temb = dense(swish(dense(timestep_embedding(t, cfg["channels"]), tp["dense0"])), tp["dense1"])
    hs = [conv(as_dtype(x, dtype), params["conv_in"])]
    for i in range(levels):
        p = params[f"down_{i}"]
        for j in range(nres):
            h = res_block(hs[-1], temb, p[f"block_{j}"], groups)
            if f"attn_{j}" in p:
                h = attn_block(h, p[f"attn_{j}"], groups, heads)
            hs.append(h)
        if i != levels - 1:
            hs.append(conv(hs[-1], p["down"], stride=2))
    m = params["mid"]
    h = res_block(hs[-1], temb, m["block_0"], groups)
    h = attn_block(h, m["attn"], groups, heads)
    h = res_block(h, temb, m["block_1"], groups)
    for i in reversed(range(levels)):
        p = params[f"up_{i}"]
        for j in range(nres + 1):
            h = res_block(_concat(h, hs.pop()), temb, p[f"block_{j}"], groups)
            if f"attn_{j}" in p:
                h = attn_block(h, p[f"attn_{j}"], groups, heads)
        if i != 0:
            h = conv(upsample(h), p["up"])
    o = params["out"]
    return conv(swish(group_norm(h, o["norm"], groups)), o["conv"])


def _concat(a, b):
    import jax.numpy as jnp

    return jnp.concatenate([a, b], axis=-1)


def make_loss(cfg: Config):
    """``(params, batch) -> mean((ε_θ(x_t, t) - ε)²)`` with ``x_t = √ᾱ_t·x0 + √(1-ᾱ_t)·ε``."""
    import jax.numpy as jnp

    def loss_fn(params, batch):
        ab = alpha_bar(batch["t"], cfg["timesteps"])[:, None, None, None]
        x_t = jnp.sqrt(ab) * batch["x0"] + jnp.sqrt(1.0 - ab) * batch["noise"]
        err = wide(forward(params, x_t, batch["t"], cfg)) - batch["noise"]
        return jnp.mean(err * err)

    return loss_fn


def make_step(cfg: Config, *, lr: float = 1e-3, grads_only: bool = False):
    """The training step ``(params, opt, batch) -> (loss, new_params, new_opt)``; with
    ``grads_only`` the same step stopped before the optimizer: ``-> (loss, grads)``."""
    return train_step(make_loss(cfg), lr=lr, grads_only=grads_only)


__all__ = ["make_step", "make_loss", "forward", "level_channels", "level_geometry", "layers", "param_tree", "alpha_bar", "timestep_embedding"]
