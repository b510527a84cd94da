"""An example predictability-claims suite: copy this folder into your project and run ``pytest``.

Each test states one claim about a partitioning, checked by the analytical model
(``partir_emu.testing``, installed with partir-emu as a pytest plugin):

* a strategy beats another by a margin (``assert_faster``);
* a configuration fits in a memory budget (``assert_fits``);
* a prediction stays within a tolerance of a measured step (``assert_within``: here a published
  Megatron-LM run, arXiv 2104.04473 Table 1, 1.7B on 32 A100s, 137 TFLOP/s per GPU);
* the figures and the collective counts do not move (``partir_baseline``: snapshots in
  ``baselines/``, rewritten with ``pytest --partir-update-baselines``);
* your own JAX step partitions and verifies against ``jax.jit`` (``assert_verified``).
"""
from __future__ import annotations

import numpy as np

from partir_emu.testing import assert_faster, assert_fits, assert_verified, assert_within, predict

SMALL = dict(size="small", set="batch=64")


def test_megatron_with_zero3_beats_zero3_alone_on_64_v4_chips():
    mp = predict("transformer", "bp+mp+z3", "batch=16,model=4", "tpu-v4", **SMALL)
    z3 = predict("transformer", "bp+z3", "batch=64", "tpu-v4", **SMALL)
    assert_faster(mp, z3, by=0.10)


def test_t32_under_megatron_and_zero3_fits_a_v4_chip():
    """The 32-layer full-size preset (simulated only) on 512 chips, with room to spare."""
    r = predict("transformer", "bp+mp+z3", "batch=128,model=4", "tpu-v4", size="t32")
    assert_fits(r, hbm="16GiB")


def test_megatron_1p7b_stays_within_8_percent_of_its_published_step():
    """137 TFLOP/s per A100 by Megatron's FLOP formula (eq. 3 of arXiv 2104.04473) is a 3.528 s step
    for this configuration (global batch 512, sequence 2048, full recompute)."""
    r = predict("transformer", "bp", "batch=32", "a100", stack="megatron-lm",
                set=dict(batch=512, seq=2048, d_model=2304, heads=24, d_ff=9216, layers=24, vocab=51200, remat=1,
                         precision="bf16", mlp="gelu", block="serial", norm="layernorm", bias=1, tied=1,
                         attention="naive"))
    assert_within(r, measured_s=3.528, rel=0.08)


def test_collective_counts_and_step_do_not_move(partir_baseline):
    partir_baseline.check(predict("transformer", "bp+mp", "batch=4,model=2", "tpu-v4", size="tiny"))


def test_my_own_step_verifies():
    import jax
    import jax.numpy as jnp

    import partir_emu as pe

    def step(params, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"]))(params)
        return loss, {k: params[k] - 0.1 * g[k] for k in params}

    fn = pe.jit(step, mesh=pe.Mesh(batch=2, model=2), state_outputs={"1": "params"},
                schedule=[pe.ManualPartition({"x": 0}, axis="batch"),
                          pe.ManualPartition({"params/w1": 1, "params/w2": 0}, axis="model")])
    rng = np.random.default_rng(0)
    params = {"w1": rng.standard_normal((4, 8)).astype(np.float32),
              "w2": rng.standard_normal((8, 2)).astype(np.float32)}
    assert_verified(fn.verify(params, rng.standard_normal((6, 4)).astype(np.float32)))
