"""A diffusion U-Net training step (DDPM's denoising objective), plain JAX; the model lives in
``scenarios.unet.model``.

The model is DDPM's U-Net (Ho et al. 2020, "Denoising Diffusion Probabilistic Models", arXiv
2006.11239, appendix B and its ``diffusion_tf/models/unet.py``), NHWC::

    temb = dense1(swish(dense0(sinusoid(t, channels))))         [batch, 4*channels]
    h = conv_in(x_t)                                             3×3, in_ch -> channels
    level i = 0..levels-1 (resolution image/2^i, width C_i = channels * mult digit i):
        res_blocks × res_block(-> C_i) [+ attn_block if resolution == attn_res]; each kept as a skip
        i < levels-1: a 3×3 stride-2 'SAME' conv (downsample; also kept as a skip)
    mid: res_block, attn_block, res_block                       attention at the lowest resolution
    level i = levels-1..0: (res_blocks+1) × res_block(concat(h, skip) -> C_i) [+ attn_block];
        i > 0: nearest-neighbour ×2 (broadcast + reshape) then a 3×3 conv (upsample)
    eps = conv_out(swish(GN(h)))                                 3×3, channels -> in_ch
    res_block(x -> C): GN, swish, conv3×3, + dense(swish(temb)), GN, swish, conv3×3;
        + x (through a 1×1 ``skip`` projection when the width changes)
    attn_block(x): GN, q/k/v = 1×1 projections, softmax(q k^T / sqrt(C/heads)) v over the H·W
        positions (``heads`` heads), 1×1 output projection, + x; no key bias (DDPM has one, but the
        softmax is invariant to adding q·b_k to every score of a query: its gradient is exactly zero
        and Adam would turn rounding noise into updates of size lr, as in ``scenarios.transformer.scenario``)

Loss: ``mean((eps - noise)²)`` with ``x_t = sqrt(ᾱ_t) x0 + sqrt(1-ᾱ_t) noise``; ``batch/x0``,
``batch/noise`` [batch, image, image, in_ch] float32, ``batch/t`` [batch] int32 in [0, timesteps).
ᾱ_t is the cosine schedule (Nichol & Dhariwal 2021) in closed form, not DDPM's linear-β table,
so the step needs no lookup. DDPM's dropout is left out (a deterministic step); its zero-initialised
last convs are drawn small instead (a zero init would make most gradients vanish). Adam as
``scenarios.common.train_step``.

**Sizes** (``--set`` names): ``batch``, ``image`` (H = W), ``in_ch``, ``channels`` (base width),
``mult`` (the channel multiplier of each level, one decimal digit per level: 1222 is DDPM's
(1, 2, 2, 2); ``levels`` = its number of digits), ``res_blocks``, ``groups`` (GroupNorm),
``heads``, ``attn_res`` (the resolution whose level blocks get attention besides the middle;
default the lowest, ``image / 2^(levels-1)``), ``timesteps``, ``precision`` (f32|bf16: bf16
convs, matmuls and activations with float32 master weights, norm statistics, softmax and loss, as
``scenarios.transformer.scenario``; see ``scenarios.unet.model``).

Presets: ``tiny`` (emulation, f32, 45,195 parameters), ``ddpm32`` and ``ddpm256`` (simulation
only): DDPM's CIFAR-10 model (35,744,771 parameters; the paper: 35.7 M; batch 128) and its
LSUN/CelebA-HQ 256×256 model (113,670,147; the paper: 114 M; batch 64), both with attention at
16×16, 32 groups and one head (with DDPM's key biases the counts are 35,746,307 and 113,673,219).
They are simulated in bf16, as the transformer's full presets are.
The PartIR paper (arXiv 2401.11202) evaluates a U-Net but its sizes were not found in the stored
references, so the presets are DDPM's.

Parameter count (closed form, :func:`param_count`), with E = 4·channels:
``res_block(a -> c)`` = 2a + 9ac + c + Ec + c + 2c + 9c² + c [+ ac + c if a != c];
``attn_block(c)`` = 2c + 4c² + 3c; plus temb (channels·E + E + E² + E), conv_in (9·in_ch·channels
+ channels), each down/up conv 9C² + C, and the output GN and conv (2C_0 + 9·C_0·in_ch + in_ch).

**Model FLOPs** of one training step (:func:`model_flops`, the numerator of MFU): conv and matmul
multiply-accumulates per image, ×2 FLOPs per MAC, ×3 for forward + both gradients, × batch:
a 3×3 conv at resolution r: 9·a·c·r² MACs (stride 2: r = its output's); a 1×1 projection a·c·r²;
attention at r: 2·r⁴·C (scores and weighted sum); temb matmuls channels·E + E² + Σ E·C (one per
res_block). Not counted: norms, activations, the loss (elementwise). As for the MLP, the input
gradients of conv_in and temb/dense0 (whose inputs are data) are counted though the step does not
compute them.

**Strategies.** ``bp``, ``z3``, ``mp``, ``bp+mp``, ``bp+z3`` through
:func:`scenarios.strategies.build_strategy`; ``spatial``, ``bp+spatial`` and ``bp+spatial+z3`` are this module's:

- ``mp`` (Megatron on channels, ``model`` axis): each res_block's conv1 (kernel dim 3), its bias,
  ``tproj`` and ``norm2`` column-parallel, conv2 row-parallel (kernel dim 2, a pending sum
  all-reduced once per block); attention q/k/v column-parallel (whole heads), o row-parallel, when
  ``heads`` is divisible by the ``model`` axis, else replicated on it (DDPM has one head). Needs
  every level width and ``groups`` divisible by the ``model`` axis. The down/up convs, the 1×1
  shortcuts, conv_in/out and the timestep MLP have no Megatron pair and stay replicated on
  ``model`` (each device computes them whole), so ``mp`` does not pay on DDPM's sizes.
- ``spatial``: the image rows (H, dim 1 of ``batch/x0`` and ``batch/noise``) tiled on a mesh
  axis named ``spatial`` (a dedicated axis rather than the data axes, so that ``bp+spatial``
  tiles batch and rows on different axes); parameters replicated. Every 3×3 stride-1 conv
  exchanges one row with each neighbour (``partir_emu.compiler.lowering.halo``); the model is chosen to tile
  cleanly: strided convs downsample (no pooling, whose gradients would gather), nearest-neighbour
  upsampling is a broadcast + reshape (rows stay blocked), GroupNorm reduces partial sums over
  ``spatial``. Halo count convention (``partir_emu.compiler.lowering.halo``): one exchange (a
  ``collective_permute`` per direction that needs rows: 2 for a 3×3 stride-1 conv, 1 for the
  stride-2 downsampling) for each conv layer's forward, which its weight gradient reuses, and one
  for its input gradient (none for conv_in, whose input is data). Attention is global over the H·W
  positions, the documented gap: its keys and values are gathered over ``spatial`` (inherent to
  self-attention), its backward gathers some of its operands and reduce-scatters their gradients
  (one all_to_all at the full sizes), all at ``attn_res`` and the lowest resolution only;
  propagation warns of conflicting tilings there (queries and keys both want the rows).
  Needs ``image / 2^(levels-1)`` divisible by the ``spatial`` axis.
- ``bp+spatial``: the batch on every data axis except ``spatial`` and ``model``, the rows on
  ``spatial``; ``bp+spatial+z3`` then shards the parameters and Adam state on those data axes
  (ZeRO-3, as ``build_strategy`` does; tactic order bp, spatial, z3).
"""
from __future__ import annotations

import numpy as np

from partir_emu.compiler.tactics import ManualPartition
from partir_emu.core.mesh import Mesh
from partir_emu.errors import ScenarioError
from scenarios.common import MODEL_AXIS, Config, ParamKind, Scenario, count_params
from scenarios.strategies import build_strategy
from scenarios.training import init_params
from scenarios.unet import model as unet_model

SPATIAL_AXIS = "spatial"
SIZE_NAMES = ("batch", "image", "in_ch", "channels", "mult", "res_blocks", "groups", "heads", "attn_res",
              "timesteps", "precision")
CHOICES: dict[str, tuple[str, ...]] = {"precision": ("f32", "bf16")}

PRESETS: dict[str, Config] = {
    "tiny": dict(precision="f32", batch=4, image=16, in_ch=3, channels=8, mult=12, res_blocks=1, groups=4, heads=2, timesteps=1000),
    # DDPM (Ho et al. 2020, appendix B): CIFAR-10 32×32, 35.7 M parameters, batch 128
    "ddpm32": dict(batch=128, image=32, in_ch=3, channels=128, mult=1222, res_blocks=2, groups=32, heads=1,
                   attn_res=16, timesteps=1000, precision="bf16"),
    # DDPM's LSUN / CelebA-HQ 256×256 model, 114 M parameters, batch 64
    "ddpm256": dict(batch=64, image=256, in_ch=3, channels=128, mult=112244, res_blocks=2, groups=32, heads=1,
                    attn_res=16, timesteps=1000, precision="bf16"),
}

# attention's q/k/v/o and the shortcut are [in, out] matrices; conv kernels HWIO (mp_dim: see ``mp``)
PARAM_KINDS = (
    ParamKind("temb/*/w", 2), ParamKind("temb/*/b", 1),
    ParamKind("conv_in/w", 4), ParamKind("conv_in/b", 1),
    ParamKind("*/norm1/*", 1),
    ParamKind("*/conv1/w", 4, mp_dim=3), ParamKind("*/conv1/b", 1, mp_dim=0),
    ParamKind("*/tproj/w", 2, mp_dim=1), ParamKind("*/tproj/b", 1, mp_dim=0),
    ParamKind("*/norm2/*", 1, mp_dim=0),
    ParamKind("*/conv2/w", 4, mp_dim=2), ParamKind("*/conv2/b", 1),
    ParamKind("*/skip/w", 2), ParamKind("*/skip/b", 1),
    ParamKind("*attn*/norm/*", 1),
    ParamKind("*attn*/[qkv]/w", 2, mp_dim=1), ParamKind("*attn*/[qv]/b", 1, mp_dim=0),
    ParamKind("*attn*/o/w", 2, mp_dim=0), ParamKind("*attn*/o/b", 1),
    ParamKind("down_*/down/w", 4), ParamKind("down_*/down/b", 1),
    ParamKind("up_*/up/w", 4), ParamKind("up_*/up/b", 1),
    ParamKind("out/norm/*", 1), ParamKind("out/conv/w", 4), ParamKind("out/conv/b", 1),
)


# -- sizes ---------------------------------------------------------------------------------------

def complete_config(cfg: Config) -> Config:
    """``cfg`` with ``attn_res`` (default: the lowest resolution) filled in."""
    out = dict(cfg)
    out.setdefault("precision", "f32")
    out.setdefault("attn_res", out["image"] >> (len(str(out["mult"])) - 1))
    return out


def _check_config(cfg: Config) -> None:
    mult = str(cfg["mult"])
    if "0" in mult:
        raise ScenarioError(f"unet: mult={mult} has a 0 digit; each digit is a level's channel multiplier (1-9)")
    low = cfg["image"] >> (len(mult) - 1)
    if low < 1 or cfg["image"] % (1 << (len(mult) - 1)):
        raise ScenarioError(f"unet: image={cfg['image']} is not divisible by 2^(levels-1) = {1 << (len(mult) - 1)} "
                            f"(mult={mult} has {len(mult)} levels); change --set image=... or mult=...")
    bad = [c for c in unet_model.level_channels(cfg) if c % cfg["groups"]]
    if bad:
        raise ScenarioError(f"unet: groups={cfg['groups']} does not divide the level widths {bad}; "
                            "change --set groups=... or channels=...")
    if any(c % cfg["heads"] for c in unet_model.level_channels(cfg)):
        raise ScenarioError(f"unet: heads={cfg['heads']} does not divide every level width "
                            f"{unet_model.level_channels(cfg)}; change --set heads=...")
    if cfg["channels"] < 4 or cfg["channels"] % 2:
        raise ScenarioError(f"unet: channels={cfg['channels']} must be even and >= 4 (the sinusoidal timestep "
                            "embedding has channels/2 frequencies)")


def param_shapes(cfg: Config) -> dict:
    return unet_model.param_tree(complete_config(cfg))


def batch_shapes(cfg: Config) -> dict:
    img = (cfg["batch"], cfg["image"], cfg["image"], cfg["in_ch"])
    return {"x0": (img, np.float32), "noise": (img, np.float32), "t": ((cfg["batch"],), np.int32)}


# -- counts --------------------------------------------------------------------------------------

def _walk(cfg: Config) -> list[tuple[str, int, int, int]]:
    return unet_model.layers(complete_config(cfg))


def param_count(cfg: Config) -> int:
    cfg = complete_config(cfg)
    ch, k = cfg["channels"], cfg["in_ch"]
    e = 4 * ch

    def layer(kind: str, a: int, c: int) -> int:
        if kind == "res":
            return 2 * a + 9 * a * c + c + e * c + c + 2 * c + 9 * c * c + c + (a * c + c if a != c else 0)
        if kind == "attn":
            return 2 * c + 4 * c * c + 3 * c
        return 9 * c * c + c                                   # down / up conv

    c0 = unet_model.level_channels(cfg)[0]
    return (ch * e + e + e * e + e + 9 * k * ch + ch + sum(layer(kd, a, c) for kd, a, c, _ in _walk(cfg))
            + 2 * c0 + 9 * c0 * k + k)


def macs_per_image(cfg: Config) -> int:
    """Conv and matmul multiply-accumulates of one image's forward pass (see :func:`model_flops`)."""
    cfg = complete_config(cfg)
    ch, k, img = cfg["channels"], cfg["in_ch"], cfg["image"]
    e = 4 * ch

    def layer(kind: str, a: int, c: int, r: int) -> int:
        if kind == "res":
            return (9 * a * c + 9 * c * c + (a * c if a != c else 0)) * r * r + e * c
        if kind == "attn":
            return 4 * c * c * r * r + 2 * r ** 4 * c
        return 9 * c * c * r * r                               # down (r = its output's) / up

    c0 = unet_model.level_channels(cfg)[0]
    return ch * e + e * e + 9 * k * ch * img * img + sum(layer(*x) for x in _walk(cfg)) + 9 * c0 * k * img * img


def model_flops(cfg: Config) -> int:
    return 6 * cfg["batch"] * macs_per_image(cfg)


# -- inputs --------------------------------------------------------------------------------------

def make_params(cfg: Config, rng: np.random.Generator) -> dict:
    """Kernels and matrices ~ N(0, 1/fan_in), norm scales 1, biases and norm biases 0."""
    return init_params(param_shapes(cfg), rng)


def make_batch(cfg: Config, rng: np.random.Generator) -> dict:
    (img, _), _, _ = batch_shapes(cfg).values()
    return {"x0": rng.standard_normal(img).astype(np.float32), "noise": rng.standard_normal(img).astype(np.float32),
            "t": rng.integers(0, cfg["timesteps"], size=(cfg["batch"],), dtype=np.int32)}


def make_step(cfg: Config, *, lr: float = 1e-3, grads_only: bool = False):
    """The training step ``(params, opt, batch) -> (loss, new_params, new_opt)``; with
    ``grads_only`` the same step stopped before the optimizer: ``-> (loss, grads)``."""
    return unet_model.make_step(complete_config(cfg), lr=lr, grads_only=grads_only)


# -- strategies ----------------------------------------------------------------------------------

def _check_mp(cfg: Config, model_size: int) -> None:
    widths = unet_model.level_channels(cfg)
    if any(c % model_size for c in widths) or cfg["groups"] % model_size:
        raise ScenarioError(f"unet: strategy with 'mp' needs the level widths {widths} and groups={cfg['groups']} "
                            f"divisible by the 'model' axis (size {model_size}); change the sizes or the mesh")


def param_kinds(cfg: Config | None, model_size: int = 1) -> tuple[ParamKind, ...]:
    """:data:`PARAM_KINDS`; attention replicated on ``model`` when ``heads`` is not divisible by it
    (every device computes every head, as Megatron does for multi-query key/value heads)."""
    if cfg is None or cfg["heads"] % model_size == 0:
        return PARAM_KINDS
    return tuple(ParamKind(k.pattern, k.rank) if k.pattern.startswith("*attn*") else k for k in PARAM_KINDS)


def spatial_strategy(name: str, mesh: Mesh, cfg: Config | None) -> list[ManualPartition]:
    """``spatial``, ``bp+spatial`` and ``bp+spatial+z3``: see the module docstring."""
    if not isinstance(mesh, Mesh) or SPATIAL_AXIS not in mesh.axis_names:
        raise ScenarioError(f"strategy {name!r} tiles the image rows on mesh axis {SPATIAL_AXIS!r}, which {mesh} "
                            f"lacks; add it, e.g. --mesh {SPATIAL_AXIS}=4 or batch=2,{SPATIAL_AXIS}=2")
    daxes = [a for a in mesh.axis_names if a not in (MODEL_AXIS, SPATIAL_AXIS)]
    data: list[ManualPartition] = []
    if name.startswith("bp+"):
        if not daxes:
            raise ScenarioError(f"strategy {name!r} needs a data axis besides {SPATIAL_AXIS!r} and {MODEL_AXIS!r}; "
                                f"e.g. --mesh batch=2,{SPATIAL_AXIS}=2")
        # bp (and z3) on the data axes alone: the standard builder on the mesh without 'spatial'
        sub = Mesh(**{a: mesh.axis_size(a) for a in daxes})
        data = build_strategy("z3" if name.endswith("+z3") else "bp", sub, cfg, kinds=param_kinds,
                              param_shapes=param_shapes)
    if cfg is not None:
        low, size = cfg["image"] >> (len(str(cfg["mult"])) - 1), mesh.axis_size(SPATIAL_AXIS)
        if low % size:
            raise ScenarioError(f"strategy {name!r}: the lowest resolution {low} (image={cfg['image']}, "
                                f"{len(str(cfg['mult']))} levels) is not divisible by axis {SPATIAL_AXIS!r} of "
                                f"size {size}; change --set image=... or the mesh")
    spatial = ManualPartition({"batch/x0": 1, "batch/noise": 1}, axis=SPATIAL_AXIS, name=f"spatial:{SPATIAL_AXIS}")
    bp = [t for t in data if (t.name or "").startswith("bp:")]
    return bp + [spatial] + [t for t in data if t not in bp]


STRATEGY_NAMES = ("bp", "z3", "mp", "bp+mp", "bp+z3", "bp+auto", "spatial", "bp+spatial", "bp+spatial+z3")


def _make(n: str):
    def strategy(mesh: Mesh, cfg: Config | None = None) -> list[ManualPartition]:
        if "spatial" in n.split("+"):
            return spatial_strategy(n, mesh, cfg)
        return build_strategy(n, mesh, cfg, kinds=param_kinds, param_shapes=param_shapes, check_mp=_check_mp)
    strategy.__name__, strategy.__doc__ = f"strategy_{n.replace('+', '_')}", f"Strategy {n!r}: see scenarios.unet.scenario."
    return strategy


SCENARIO = Scenario(
    name="unet",
    description="DDPM diffusion U-Net training step (conv, group norm, attention, noise-prediction MSE, Adam)",
    size_names=SIZE_NAMES,
    presets=PRESETS,
    simulation_only=frozenset({"ddpm32", "ddpm256"}),
    make_step=make_step,
    param_shapes=param_shapes,
    batch_shapes=batch_shapes,
    make_params=make_params,
    make_batch=make_batch,
    param_count=param_count,
    model_flops=model_flops,
    param_kinds=PARAM_KINDS,
    strategies={n: _make(n) for n in STRATEGY_NAMES},
    check_config=_check_config,
    complete_config=complete_config,
    choices=CHOICES,
    param_kinds_for=param_kinds,
)

__all__ = ["SCENARIO", "PRESETS", "SIZE_NAMES", "SPATIAL_AXIS", "param_count", "model_flops", "macs_per_image",
           "param_shapes", "make_step", "count_params"]
