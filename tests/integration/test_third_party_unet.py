"""A Flax linen U-Net (issue 11, done-when: "a U-Net with ``nn.Conv`` and pooling ... partition with
BP, MP and Z3 and verify against jax.jit"), trained with optax Adam, partitioned as a user would:

- BP: the batch on ``batch``;
- MP: every conv's output features (kernel dim 3, bias) on ``model``, after BP;
- Z3: BP, then the parameters and Adam moments sharded on ``batch`` (kernel output features);
- spatial: the image rows (H) on ``spatial`` (the paper's U-Net partitioning): every 3×3 conv
  exchanges one border row with each neighbour (``compiler/lowering/halo.py``), the 2×2 poolings and the
  ``jnp.repeat`` upsampling need none. One value is gathered: ``avg_pool``'s gradient is a ``pad``
  with interior padding (then a window sum), and ``pad`` blocks the dims it pads. With max pooling
  at both levels nothing is gathered;
- spatial + BP.

The model: two encoder levels (3×3 convs, ``nn.max_pool`` and ``nn.avg_pool``), a bottleneck, a
decoder that upsamples with ``jnp.repeat`` and concatenates the skip connections, a 1×1 output
conv; a per-pixel MSE loss. Checked as tests/integration/test_third_party_models.py checks its models (its
``_check``: loss and gradients to ``rtol=1e-4`` normwise, the whole optax step to 1e-3).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

pytestmark = pytest.mark.xdist_group("third_party_unet")    # its cached programs and references: made once, on one worker

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
nn = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")

import partir_emu as pe  # noqa: E402
from tests.integration.test_third_party_models import _axes, _check  # noqa: E402

BATCH, SIZE, CH = 4, 16, 8


def _up(x):
    return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)


class _UNet(nn.Module):
    pool2: str = "avg"     # the second level's pooling

    @nn.compact
    def __call__(self, x):
        pool2 = nn.avg_pool if self.pool2 == "avg" else nn.max_pool
        e1 = nn.relu(nn.Conv(CH, (3, 3))(nn.relu(nn.Conv(CH, (3, 3))(x))))                # 16×16
        e2 = nn.relu(nn.Conv(2 * CH, (3, 3))(nn.max_pool(e1, (2, 2), strides=(2, 2))))  # 8×8
        b = nn.relu(nn.Conv(2 * CH, (3, 3))(pool2(e2, (2, 2), strides=(2, 2))))         # 4×4
        d2 = nn.relu(nn.Conv(2 * CH, (3, 3))(jnp.concatenate([_up(b), e2], axis=-1)))   # 8×8
        d1 = nn.relu(nn.Conv(CH, (3, 3))(jnp.concatenate([_up(d2), e1], axis=-1)))      # 16×16
        return nn.Conv(4, (1, 1))(d1)


@functools.cache
def _case(pool2: str = "avg"):
    model = _UNet(pool2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, SIZE, SIZE, 3)).astype(np.float32)
    y = rng.standard_normal((BATCH, SIZE, SIZE, 4)).astype(np.float32)
    params = model.init(jax.random.key(0), x)
    tx = optax.adam(1e-3)
    opt = tx.init(params)

    def loss_fn(p, x, y):
        return jnp.mean((model.apply(p, x) - y) ** 2)

    def grads(params, opt, x, y):
        return jax.value_and_grad(loss_fn)(params, x, y)

    def step(params, opt, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        upd, opt = tx.update(g, opt, params)
        return loss, optax.apply_updates(params, upd), opt

    return (params, opt, x, y), grads, step


def _schedule(strategy: str) -> tuple[pe.Mesh, list]:
    bp = pe.ManualPartition({"x": 0, "y": 0}, axis="batch")
    if strategy == "bp":
        return pe.Mesh(batch=4), [bp]
    if strategy == "mp":
        return pe.Mesh(batch=2, model=2), [bp, pe.ManualPartition({"params/*/kernel": 3, "params/*/bias": 0},
                                                                  axis="model")]
    if strategy == "z3":
        z3 = {f"{root}/*/{leaf}": d for root in ("params", "opt/*mu", "opt/*nu") for leaf, d in (("kernel", 3), ("bias", 0))}
        return pe.Mesh(batch=4), [bp, pe.ManualPartition(z3, axis="batch")]
    sp = pe.ManualPartition({"x": 1, "y": 1}, axis="spatial")
    if strategy == "spatial":
        return pe.Mesh(spatial=4), [sp]
    return pe.Mesh(batch=2, spatial=2), [bp, sp]       # spatial+bp


STRATEGIES = ["bp", "mp", "z3", "spatial", "spatial+bp"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unet_loss_and_gradients_match_jax(strategy):
    args, grads, _ = _case()
    mesh, schedule = _schedule(strategy)
    spmd = _check(grads, args, mesh, schedule, 1e-4)
    convs = [e for e in spmd.program.eqns if e.prim == "conv_general_dilated"]
    permutes = [e for e in spmd.collectives() if e.prim == "collective_permute"]
    if strategy == "bp":
        assert not permutes and not _axes(spmd, "all_gather") and ("batch",) in _axes(spmd, "all_reduce")
    if strategy == "mp":
        assert any(e.inputs[1].shape[3] == CH // 2 for e in convs)       # kernels' output features tiled
        assert ("model",) in _axes(spmd, "all_reduce") | _axes(spmd, "all_gather")
    if strategy == "z3":
        assert ("batch",) in _axes(spmd, "all_gather")                    # parameters gathered before use
    if strategy.startswith("spatial"):
        rows = SIZE // mesh.axis_size("spatial")
        assert convs[0].inputs[0].shape[1] == rows + 2                    # own rows + one from each neighbour
        # one exchange (two permutes) per 3×3 conv forward, reused by its weight gradient, one per input
        # gradient (all but the first conv's): (6 + 5) exchanges
        assert len(permutes) == 2 * (6 + 5) and {e.params["axes"] for e in permutes} == {("spatial",)}
        assert _gathered(spmd) == ["pad"] and not _axes(spmd, "all_to_all")   # avg_pool's gradient only


def _gathered(spmd) -> list[str]:
    """What reads each all_gather's result."""
    gathered = {e.outputs[0] for e in spmd.collectives() if e.prim == "all_gather"}
    return [e.prim for e in spmd.program.eqns if any(a in gathered for a in e.inputs)]


@pytest.mark.slow
def test_unet_with_max_pooling_tiled_on_h_gathers_nothing():
    args, grads, step = _case("max")
    mesh, schedule = _schedule("spatial")
    spmd = _check(grads, args, mesh, schedule, 1e-4)
    assert not _gathered(spmd) and len([e for e in spmd.collectives() if e.prim == "collective_permute"]) == 22
    assert not _gathered(_check(step, args, mesh, schedule, 1e-3))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unet_whole_step_with_optax_matches_jax(strategy):
    args, _, step = _case()
    mesh, schedule = _schedule(strategy)
    _check(step, args, mesh, schedule, 1e-3)
