"""The 1F1B pipeline schedule (issue 24 item 2; ``scenarios/transformer/pipeline_1f1b.py``):

- its gradient, which the step computes itself (a micro-batch's backward pass starts as soon as its
  forward pass has left the last stage), equals ``jax.grad`` of the unpipelined model under plain
  ``jax.jit``: an identity checked by JAX alone, for several stage and micro-batch counts;
- it partitions and verifies against ``jax.jit`` under pp and bp+mp+pp;
- structure: ``M + P - 1`` activation permutes forward and as many gradient permutes back, nothing
  else on ``stage`` inside the tick loops, and every data-parallel weight gradient reduced once after
  the last loop (the three loops accumulate into one pending sum);
- priced: the bubble against ``(P-1)/(M+P-1)``, the DES on the same program, and a stash of
  ``2P - 1`` micro-batches that does not grow with ``M`` where GPipe's does;
- bad configurations are clear errors.
"""
from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import numpy as np
import pytest

from partir_emu.app.experiment import Experiment
from partir_emu.core.loops import walk
from partir_emu.core.mesh import Mesh
from partir_emu.hwmodels.analytical import Analyzer
from partir_emu.hwmodels.compute.program import compute_times
from partir_emu.hwmodels.compute.stack import load_stack
from partir_emu.hwmodels.des import simulate_des
from partir_emu.hwmodels.machine.specs import load_spec
from scenarios.transformer.pipeline import layer_order
from tests.conftest import assert_schedule_refused, verified_on_local_mesh
from tests.integration.test_pipeline import _priced as accumulation

TINY = "batch=8,layers=4,remat=1"
ONE_F_ONE_B = f"{TINY},pipeline=2,microbatches=4,schedule=1f1b"
INTERLEAVED = "batch=8,layers=8,remat=1,pipeline=2,microbatches=4,schedule=1f1b,virtual_stages=2"


@pytest.mark.parametrize("p, m, v, tied", [(2, 4, 1, 0), (4, 2, 1, 0), (2, 1, 1, 0), (2, 4, 1, 1), (2, 4, 2, 1),
                                           (4, 4, 2, 0), (2, 2, 4, 0)])
def test_the_1f1b_gradient_is_the_models(p, m, v, tied):
    """Loss and every gradient of the 1F1B step under jax.jit equal jax.value_and_grad of the
    layers_as=loop model on the same draws, to float32 rounding; fewer micro-batches than stages
    (M < P - 1 ticks of steady state) included; tied: the embedding table's gradient is the head's
    plus the embedding's; interleaved (v > 1): the stored layers are stage-major (layer_order)."""
    import jax

    from scenarios.transformer import model
    from scenarios.transformer.pipeline_1f1b import make_value_and_grad
    from scenarios.transformer.scenario import SCENARIO

    layers = f"batch=8,layers={4 * v},remat=1,tied={tied}"
    pipe = SCENARIO.config("tiny", f"{layers},pipeline={p},microbatches={m},schedule=1f1b,virtual_stages={v}")
    loop = SCENARIO.config("tiny", f"{layers},layers_as=loop")
    batch = SCENARIO.make_batch(loop, np.random.default_rng(1))
    want_loss, want = jax.jit(jax.value_and_grad(model.make_loss(loop)))(
        SCENARIO.make_params(loop, np.random.default_rng(0)), batch)
    step = make_value_and_grad(pipe, model.make_embed(pipe), model.make_block(pipe), model.make_head(pipe))
    got_loss, got = jax.jit(step)(SCENARIO.make_params(pipe, np.random.default_rng(0)), batch)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6)
    order = layer_order(pipe)
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got), strict=True):
        w = np.asarray(w)[order] if "layers" in jax.tree_util.keystr(path) else w
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6 * float(np.abs(w).max()), err_msg=str(path))


@functools.cache
def _base(overrides: str) -> Experiment:
    return Experiment("transformer", "bp", Mesh(batch=1), "tiny", overrides, strict=True)


@pytest.mark.parametrize("strategy, mesh, overrides", [
    ("pp", "stage=2", ONE_F_ONE_B), ("bp+mp+pp", "batch=2,model=2,stage=2", ONE_F_ONE_B),
    ("bp+mp+pp", "batch=2,model=2,stage=2", INTERLEAVED)])
def test_1f1b_verifies_on_the_local_mesh(strategy, mesh, overrides):
    exp = _base(overrides).with_strategy(strategy, Mesh.parse(mesh))
    spmd, ver = verified_on_local_mesh(exp)
    assert ver.verified, ver.to_json()["worst"]
    w_q = spmd.input_names.index("params/layers/attn/w_q")
    assert spmd.in_shardings[w_q].dims[0] == ("stage",)


@pytest.mark.parametrize("precision, tied, v", [("f32", 0, 1), ("bf16", 1, 1), ("f32", 0, 2)])
def test_1f1b_structure(precision, tied, v):
    """P = 4, M = 4 under bp+pp: three tick loops (P - 1, M, P - 1 ticks); M + P - 1 = 7 forward
    permutes (shift +1) and 7 backward (shift -1 = 3), each one micro-batch's [mb, seq, d] block, and
    no other collective on ``stage`` in a loop; no gradient all-reduce over ``batch`` in any loop body
    (only the per-tick loss scalar), and each weight gradient all-reduced over ``batch`` exactly once
    (bf16: the projections cast once before the loops, their bf16 gradients widened into the float32
    sums, which still move out of the loops; tied: the head's gradient of the embedding table
    accumulates apart from the embedding's). Interleaved (v = 2, 8 layers): VP - 1 = 7 warm-up, 4 steady
    and 7 cool-down ticks, VM + P - 1 = 11 permutes each way, and the gradients added to their chunk's
    row (a scatter-add) still reduced once after the loops."""
    exp = _base(f"batch=8,layers={4 * v},remat=1,precision={precision},tied={tied},pipeline=4,microbatches=4,"
                f"schedule=1f1b,virtual_stages={v}").with_strategy("bp+pp", Mesh(batch=2, stage=4))
    spmd = exp.lower().spmd
    loops = [e for e in spmd.program.eqns if e.prim == "loop"]
    warm, n = 4 * v - 1, 4 * v + 4 - 1
    assert [e.params["length"] for e in loops if e.params["length"] in (warm, 4)][-3:] == [warm, 4, warm]
    # every per-stage carry is sharded on `stage`: no [P, seq, d] block whole on a device (the tied head's
    # accumulator of a pos gradient it never has was, 12.5 GiB of float32 zeros a device at 1 T)
    assert all((4, 8, 16) != v.shape[-3:] for e in loops for v in e.outputs), [v.shape for v in loops[-2].outputs]
    perms = Counter((e.params["shift"], e.inputs[0].shape) for e in spmd.collectives()
                    if e.prim == "collective_permute")
    assert set(perms.values()) == {n} and {shift for shift, _ in perms} == {1, 3}, perms
    assert {shape for _, shape in perms} == {(1, 1, 8, 16)}, perms
    in_loops = Counter((b.prim, b.params["axes"], b.inputs[0].shape) for e, _ in walk(spmd.program) if e.prim == "loop"
                       for b in e.params["body"].eqns if b.prim in ("all_reduce", "all_gather", "reduce_scatter"))
    assert {k for k in in_loops if "stage" in k[1]} == set(), in_loops
    assert all(int(np.prod(k[2])) == 1 for k in in_loops if "batch" in k[1]), in_loops
    after = sorted(int(np.prod(e.inputs[0].shape)) for e in spmd.program.eqns
                   if e.prim == "all_reduce" and e.params["axes"] == ("batch",) and "after the loop" in e.source)
    once = sorted(int(np.prod(v.shape)) for n, v in zip(spmd.input_names, spmd.program.inputs)
                  if n.startswith(("params/layers/", "params/final_ln/", "params/unembed/", "params/embed/")))
    # tied: the table's two sums (the head's, the embedding's) are each reduced after their loop, as
    # Megatron all-reduces the first and last stages' copies of the table over its embedding group
    once += [int(np.prod(v.shape)) for n, v in zip(spmd.input_names, spmd.program.inputs)
             if tied and n == "params/embed/tokens"]
    assert after == sorted(once), (after, once)   # the stage's layers, the head's and the embedding's weights


# -- priced ---------------------------------------------------------------------------------------
PRICED = "seq=2048,d_model=2048,heads=16,d_ff=8192,layers=16,vocab=1024"


@functools.cache
def _priced(p: int, m: int, schedule: str, batch: int = 64, v: int = 1):
    return Experiment("transformer", "pp", Mesh(stage=p), "t32", f"{PRICED},batch={batch},pipeline={p},"
                      f"microbatches={m},schedule={schedule},virtual_stages={v}").lower().spmd


def _all_s(entry, spec) -> float:
    """Compute seconds of a program, its loops' bodies times their lengths included."""
    return float(compute_times(entry.costs, spec).sum()) + sum(lc.length * _all_s(lc.body, spec)
                                                               for lc in entry.costs.loops)


def _layer_work_s(entry, spec) -> float:
    """Compute seconds of the loops inside a program's loops: the layer scans inside gradient
    accumulation's micro-batch loop, or inside the pipeline's tick loops."""
    return sum(lc.length * sum(i.length * _all_s(i.body, spec) for i in lc.body.costs.loops)
               for lc in entry.costs.loops)


@pytest.mark.parametrize("v", [1, 2])
def test_the_1f1b_bubble_is_the_closed_form(v):
    """Compute-only pricing: the layer work of the tick loops against a stage's share (1/P) of
    gradient accumulation's over the same micro-batches is ``1 - (P-1)/(VM+P-1)``: a stage runs
    VM + P - 1 forward and VM + P - 1 backward units of 1/V of its layers, P - 1 of each idle
    (interleaved: Megatron's bubble, 1/V of the non-interleaved one). Each backward unit recomputes
    its layers from their stashed inputs, as remat=1's backward pass does, so the work per unit is
    the same (the head and the ticks' bookkeeping aside)."""
    an = Analyzer()
    spec = an.spec("tpu-v4")
    p, m = 4, 8
    ideal = _layer_work_s(an.entry(accumulation(1, m, 1).program), spec) / p      # the same micro-batches, no pipeline
    work = _layer_work_s(an.entry(_priced(p, m, "1f1b", v=v).program), spec)
    closed = (p - 1) / (v * m + p - 1)
    assert ideal > 0 and abs((1 - ideal / work) - closed) < 0.01, (1 - ideal / work, closed)


@pytest.mark.parametrize("v", [1, 2])
def test_the_des_replays_1f1b_as_priced(v):
    spmd = _priced(4, 8, "1f1b", v=v)
    an = Analyzer().simulate(spmd, "tpu-v4")
    des = simulate_des(spmd, "tpu-v4")
    assert des.step_s == pytest.approx(an.step_s, rel=1e-6)
    assert an.by_collective["collective_permute"]["count"] == 2 * (v * 8 + 4 - 1)


def test_1f1b_keeps_2p_minus_1_micro_batches_whatever_m():
    """The stash is 2P - 1 slots of a stage's lps layer inputs ([mb, seq, d] bf16 each), whatever M:
    the 1F1B peak at M = 16 micro-batches of 4 rows is the peak at M = 8 of 4 rows (to within a block:
    the token ids grow), where GPipe's
    saved layer inputs are M + P - 1 ticks' worth; at M = 16 GPipe's peak is above 1F1B's by at least
    half the 12 ticks' difference (P = 4)."""
    block = 4 * 2048 * 2048 * 2                    # a micro-batch of 4 rows x 2048 x d 2048, bf16
    lps = 4
    steady = next(e for e in _priced(4, 16, "1f1b", 64).program.eqns if e.prim == "loop" and e.params["length"] == 16)
    stash = [v for v in steady.inputs if v.shape[:2] == (7, lps)]
    assert len(stash) == 1 and stash[0].nbytes == 7 * lps * block, [v.shape for v in stash]
    an = Analyzer()
    peak = {(m, s): an.simulate(_priced(4, m, s, 4 * m), "tpu-v4").peak_bytes_per_device
            for m, s in ((8, "1f1b"), (16, "1f1b"), (16, "gpipe"))}
    assert abs(peak[16, "1f1b"] - peak[8, "1f1b"]) < block, peak
    assert peak[16, "gpipe"] - peak[16, "1f1b"] > (19 - 7) * lps * block / 2, peak


def test_an_mpmd_stack_holds_p_of_the_2p_minus_1_stash_slots():
    """Under a stack that runs each stage as its own program (megatron-lm: ``pipeline = "mpmd"``) the
    peak is the lock-step program's less the P - 1 = 3 of 2P - 1 = 7 stash slots an MPMD stage 0 does
    not hold (the peak is in the tick loops, where the stash lives); the step time is the same; the
    program's own peak stays in the report; under a lock-step stack the two peaks are one."""
    spmd = _priced(4, 8, "1f1b")
    assert spmd.meta["ring_buffers"][0]["slots"] == 7 and spmd.meta["ring_buffers"][0]["held"] == 4
    steady = next(e for e in spmd.program.eqns if e.prim == "loop" and e.params["length"] == 8)
    stash = next(v for v in steady.inputs if v.shape[:2] == (7, 4))
    megatron = load_stack("megatron-lm")
    an = Analyzer()
    mpmd = an.simulate(spmd, load_spec("a100").with_stack(megatron))
    lock = an.simulate(spmd, load_spec("a100").with_stack(dataclasses.replace(megatron, pipeline="spmd")))
    assert lock.peak_bytes_per_device - mpmd.peak_bytes_per_device == stash.nbytes * 3 // 7
    assert mpmd.program_peak_bytes == lock.peak_bytes_per_device == lock.program_peak_bytes
    assert mpmd.step_s == lock.step_s
    assert any("holds 4 of the 7 slots of the 1F1B stash" in n for n in mpmd.notes), mpmd.notes
    assert not any("MPMD" in n for n in lock.notes)


# -- errors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, needle", [
    ("batch=8,layers=4,remat=0,pipeline=2,microbatches=4,schedule=1f1b", r"schedule=1f1b does not support remat=0"),
    ("batch=6,layers=8,remat=1,pipeline=2,microbatches=3,schedule=1f1b,virtual_stages=2",
     r"virtual_stages=2 with microbatches=3, not a multiple of pipeline=2"),
    ("batch=8,layers=4,schedule=1f1b", r"schedule without pipeline"),
])
def test_bad_1f1b_configs_are_clear_errors(overrides, needle):
    assert_schedule_refused(overrides, "bp", "batch=1", needle)


def test_an_unknown_schedule_is_refused():
    from partir_emu.errors import ScenarioError

    with pytest.raises(ScenarioError, match=r"'schedule' .* gpipe\|1f1b, got 'zb'"):
        Experiment("transformer", "bp", Mesh(batch=1), "tiny", f"{TINY},pipeline=2,microbatches=4,schedule=zb")
