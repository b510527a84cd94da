"""Gradient accumulation (``--set microbatches=K``, :func:`scenarios.training.train_step`): the
accumulated loss and gradients equal the full batch's under plain ``jax.jit`` (an identity of the
maths, checked by JAX alone); the microbatched step partitions and verifies against ``jax.jit``
under every strategy; its collectives are the single step's, once per micro-batch, on the same axes,
but for the data-parallel gradient all-reduces, which move out of the loop and run once;
its activations are exactly those of a step on ``batch / K`` rows; a micro-batch the data axes
cannot split is a clear error.
"""
from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import pytest

from partir_emu.app.experiment import Experiment
from partir_emu.core.mesh import Mesh
from partir_emu.errors import ScenarioError
from partir_emu.hwmodels import simulate
from partir_emu.runtime.local_mesh import LocalMesh

MESH = Mesh(batch=2, model=2)
TINY = "batch=8,layers=1"            # d_model 16, heads 4, seq 8: micro-batches of 4 or 2 rows


@functools.cache
def _exp(strategy: str, mesh: Mesh, preset: str, overrides: str, strict: bool = True) -> Experiment:
    return Experiment("transformer", strategy, mesh, preset, overrides, strict=strict)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_accumulated_gradients_equal_the_full_batch_under_jax(k):
    """The mean of K micro-batch mean losses (and their gradients) is the batch's mean loss (and its
    gradient): the microbatched step under ``jax.jit`` equals the single step under ``jax.jit`` to
    float32 rounding. K = 8 is one row per micro-batch."""
    one = _exp("bp", Mesh(batch=1), "tiny", TINY)
    acc = _exp("bp", Mesh(batch=1), "tiny", f"{TINY},microbatches={k}")
    inputs = one.inputs()
    assert [x.shape for x in acc.inputs()] == [x.shape for x in inputs]      # the same batch, not K of them
    want, got = one.reference(inputs), acc.reference(inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6 * float(np.max(np.abs(w))))
    # and it really is a loop over micro-batches, not the same program
    assert [e.prim for e in acc.program.eqns].count("loop") == 1 and "loop" not in {e.prim for e in one.program.eqns}


@pytest.mark.parametrize("strategy", ["bp", "mp", "z2", "z3", "bp+mp", "bp+mp+z3"])
def test_microbatched_step_verifies_under_every_strategy(strategy):
    exp = _exp(strategy, MESH, "tiny", f"{TINY},microbatches=2")
    low = exp.lower()
    inputs = exp.inputs(low.spmd.input_names)
    res = LocalMesh(MESH).run(low.spmd, inputs)
    ver = exp.check(res.outputs, inputs, low.spmd.output_names)
    assert ver.verified, ver.to_json()["worst"]


def test_full_microbatched_step_with_adam_verifies():
    """Not strict: the whole step, Adam included, judged by the normwise verdict ``run`` uses."""
    exp = _exp("bp+mp+z3", MESH, "tiny", f"{TINY},microbatches=4", strict=False)
    low = exp.lower()
    inputs = exp.inputs(low.spmd.input_names)
    ver = exp.check(LocalMesh(MESH).run(low.spmd, inputs).outputs, inputs, low.spmd.output_names)
    assert ver.verified, ver.to_json()["worst"]


def _lowered(strategy: str, overrides: str):
    return _exp(strategy, MESH, "tiny", overrides, strict=False).lower().spmd       # the whole step


def _collectives(strategy: str, overrides: str) -> Counter:
    return Counter((c.prim, ",".join(c.params["axes"])) for c in _lowered(strategy, overrides).collectives())


@pytest.mark.parametrize("strategy", ["bp", "mp", "bp+mp", "z2", "z3", "bp+mp+z3"])
def test_collectives_repeat_once_per_microbatch(strategy):
    """Each micro-batch's forward and backward pass communicate as one step does, on the same axes:
    Megatron all-reduces its activations, ZeRO reduce-scatters every micro-batch's gradients into
    the sharded accumulator (FSDP's pattern), ZeRO-3 gathers each weight for every micro-batch's
    forward pass and again for its backward pass (the loop body's passes are told apart as the
    step's are); ZeRO-2 gathers the updated parameters once, after the loop. A data-parallel
    gradient all-reduce is the exception: accumulated into the carry, it moves out of the loop
    (``compiler/lowering/sink.py``, DDP's ``no_sync``), so the step's G gradient all-reduces happen
    once whatever K is, and only the loss's repeats."""
    one = _collectives(strategy, TINY)
    n_grads = sum(name.startswith("params/") for name in _lowered(strategy, TINY).input_names)
    for k in (2, 4):
        got = _collectives(strategy, f"{TINY},microbatches={k}")
        want = Counter({key: n if (strategy, key[0]) == ("z2", "all_gather") else k * n for key, n in one.items()})
        if strategy in ("bp", "bp+mp"):
            want[("all_reduce", "batch")] = n_grads + k * (one[("all_reduce", "batch")] - n_grads)
        assert got == want, (k, got, one)


@pytest.mark.parametrize("strategy", ["bp", "bp+mp"])
def test_data_parallel_gradients_are_reduced_once_after_the_loop(strategy):
    """``compiler/lowering/sink.py`` on the real step: the body keeps only the loss's all-reduce; each
    gradient is all-reduced once after the loop, from a carry that entered as a pending sum
    (``to_partial``) and kept its size."""
    exp = Experiment("transformer", strategy, Mesh(batch=2, model=2), "tiny", "batch=8,layers=1,microbatches=4",
                     strict=False)
    spmd = exp.lower().spmd
    eqns = spmd.program.eqns
    (at,) = [i for i, e in enumerate(eqns) if e.prim == "loop"]
    loop = eqns[at]
    nc, nk = loop.params["num_consts"], loop.params["num_carry"]
    n_params = sum(name.startswith("params/") for name in spmd.input_names)
    body_ar = [e for e in loop.params["body"].eqns if e.prim == "all_reduce" and e.params["axes"] == ("batch",)]
    assert len(body_ar) == 1                                  # the loss's, every micro-batch
    after = [e for e in eqns[at + 1:] if e.prim == "all_reduce" and e.inputs[0] in loop.outputs[:nk]]
    assert len(after) == n_params and all(e.params["axes"] == ("batch",) for e in after)
    prod = spmd.program.producers()
    for e in after:
        k = loop.outputs.index(e.inputs[0])
        op = loop.inputs[nc + k]
        assert eqns[prod[op]].prim == "to_partial" and eqns[prod[op]].params["axes"] == ("batch",)
        assert e.outputs[0].shape == op.shape                 # the accumulator keeps its size


@pytest.mark.parametrize("strategy", ["bp", "z3"])
def test_activations_are_a_micro_batchs(strategy):
    """Priced on 4 TPU v4 chips: the microbatched step keeps exactly the activations of a step on
    ``batch / K`` rows; what accumulation adds is gradient-sized buffers (the carry, one micro-batch's
    gradients, their sum), a few times the (local) parameters and far below the activations it
    saves. Under ZeRO-3 no gathered weight outlives its pass: the collective buffers at the peak are
    those of the step on ``batch / K`` rows (a body that kept its forward gathers for the backward
    pass held every layer's weights at once)."""
    mesh = Mesh(batch=4)
    full = simulate(_exp(strategy, mesh, "small", "batch=64", strict=False).lower().spmd, "tpu-v4")
    acc = simulate(_exp(strategy, mesh, "small", "batch=64,microbatches=4", strict=False).lower().spmd, "tpu-v4")
    quarter = simulate(_exp(strategy, mesh, "small", "batch=16", strict=False).lower().spmd, "tpu-v4")
    assert acc.memory["activations"] == quarter.memory["activations"] < full.memory["activations"] / 3
    assert acc.memory["collective_buffers"] <= quarter.memory["collective_buffers"], (acc.memory, quarter.memory)
    assert acc.peak_bytes_per_device < full.peak_bytes_per_device / 2
    extra = acc.peak_bytes_per_device - quarter.peak_bytes_per_device
    assert 0 < extra < 5 * acc.memory["params"], (extra, acc.memory)
    # the same work, K loop iterations of it
    assert acc.flops_per_device == pytest.approx(full.flops_per_device, rel=0.02)


@pytest.mark.parametrize("overrides, strategy, needle", [
    ("batch=8,microbatches=3", "bp", r"microbatches=3 does not divide batch=8"),
    ("batch=8,microbatches=0", "bp", r"'microbatches' of scenario 'transformer' must be a positive integer, got '0'"),
    # micro-batches of 2 rows on 4 data-parallel devices: refused, not resharded every iteration
    ("batch=8,microbatches=4", "bp", r"micro-batch of batch 8 / microbatches 4 = 2 rows is not divisible by the data axes"),
])
def test_bad_microbatches_are_clear_errors(overrides, strategy, needle):
    with pytest.raises(ScenarioError, match=needle):
        Experiment("transformer", strategy, Mesh(batch=4), "tiny", overrides).lower()

