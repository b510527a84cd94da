"""The analytical model on real lowered programs: memory against the runtime, sanity from practice, full sizes.

Every program is lowered once per session (``_lowered`` is cached); lowering traces abstractly, so the
full-size presets cost only the compiler's time (a few seconds each), never their arrays.
"""
from __future__ import annotations

import functools
import math
from collections import Counter

import pytest

from partir_emu.core.ir import Program, Var
from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import collective_bytes
from partir_emu.hwmodels import load_spec, peak_memory, simulate

pytestmark = pytest.mark.xdist_group("hw_integration")    # its cached programs and references: made once, on one worker

TINY_MESH = "batch=2,model=2"
SANITY_MESH = "batch=4,model=2"          # 8 devices; simulated only
STRATEGIES = ("bp", "mp", "z2", "z3", "bp+mp", "bp+mp+z3")
F32 = 4


@functools.cache
def _lowered(scenario: str, strategy: str, mesh: str, preset: str, overrides: str | None = None):
    from partir_emu.app.experiment import Experiment
    exp = Experiment(scenario, strategy, Mesh.parse(mesh), preset, overrides)
    return exp, exp.lower()


def _param_inputs(spmd) -> list[tuple[str, Var]]:
    return [(n, v) for n, v in zip(spmd.input_names, spmd.program.inputs) if n.startswith("params/")]


def _dce(p: Program) -> Program:
    """The program without equations whose results nobody uses (what XLA's DCE would drop)."""
    need = {o.id for o in p.outputs if type(o) is Var}
    keep = []
    for e in reversed(p.eqns):
        if any(o.id in need for o in e.outputs):
            keep.append(e)
            need.update(a.id for a in e.inputs if type(a) is Var)
    return Program(p.inputs, p.input_names, tuple(reversed(keep)), p.outputs, p.output_names, p.consts)


def _cone(p: Program, out_index: int) -> set[int]:
    """Indices of the equations that program output ``out_index`` depends on."""
    producer = {o.id: i for i, e in enumerate(p.eqns) for o in e.outputs}
    seen: set[int] = set()
    stack = [p.outputs[out_index]]
    while stack:
        a = stack.pop()
        i = producer.get(a.id) if type(a) is Var else None
        if i is None or i in seen:
            continue
        seen.add(i)
        stack.extend(p.eqns[i].inputs)
    return seen


# -- memory: the analytical peak is the runtime's, byte for byte -----------------------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("scenario", ["mlp", "transformer"])
def test_peak_memory_matches_local_mesh(scenario, strategy):
    from partir_emu.runtime.local_mesh import LocalMesh
    exp, low = _lowered(scenario, strategy, TINY_MESH, "tiny")
    predicted = peak_memory(low.spmd).peak_bytes
    measured = LocalMesh(exp.mesh).run(low.spmd, exp.inputs()).peak_bytes_per_device
    assert len(measured) == exp.mesh.size
    assert max(measured) == predicted
    # every device runs the same program on same-shaped shards: each device's peak is the prediction
    assert measured == [predicted] * exp.mesh.size
    assert simulate(low.spmd, "tpu-v4").peak_bytes_per_device == predicted


# -- sanity from practice, on the transformer at the small size (8 devices, simulated only) --------
def _small(strategy: str):
    return _lowered("transformer", strategy, SANITY_MESH, "small")


def test_memory_bp_gt_bp_mp_gt_bp_mp_z3():
    peaks = {s: simulate(_small(s)[1].spmd, "tpu-v4").peak_bytes_per_device for s in ("bp", "bp+mp", "bp+mp+z3")}
    assert peaks["bp"] > peaks["bp+mp"] > peaks["bp+mp+z3"], peaks
    # and the state itself shrinks as practice says: MP halves the matrices, Z3 divides everything by batch=4
    state = {s: sum(v.nbytes for _, v in _param_inputs(_small(s)[1].spmd)) for s in peaks}
    exp = _small("bp")[0]
    assert state["bp"] == F32 * exp.scenario.param_count(exp.cfg)
    assert state["bp"] > state["bp+mp"] > state["bp+mp+z3"] == state["bp+mp"] // 4


def test_bp_only_traffic_is_the_gradient_all_reduce():
    exp, low = _small("bp")
    spmd = low.spmd
    cs = spmd.collectives()
    params = _param_inputs(spmd)
    assert {(e.prim, e.params["axes"]) for e in cs} == {("all_reduce", ("batch",))}
    # one all-reduce per parameter gradient (its full size) plus the scalar loss
    assert sorted(collective_bytes(e) for e in cs) == sorted([v.nbytes for _, v in params] + [F32])
    r = simulate(spmd, "tpu-v4")
    assert set(r.by_collective) == {"all_reduce"} and set(r.by_axes) == {"batch"}
    assert r.by_collective["all_reduce"]["bytes"] == F32 * exp.scenario.param_count(exp.cfg) + F32
    assert r.comm_s == pytest.approx(sum(row.time_s for row in r.collectives), rel=1e-9)


def test_mp_adds_two_all_reduces_per_layer_each_way():
    exp, low = _small("bp+mp")
    cfg, spmd = exp.cfg, low.spmd
    eqns = spmd.program.eqns
    local_batch = cfg["batch"] // exp.mesh.axis_size("batch")
    act_bytes = local_batch * cfg["seq"] * cfg["d_model"] * F32
    model = [i for i, e in enumerate(eqns) if e.prim in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
             and "model" in e.params["axes"]]
    assert all(eqns[i].prim == "all_reduce" and eqns[i].params["axes"] == ("model",) for i in model)
    assert len(model) == 4 * cfg["layers"]
    assert all(collective_bytes(eqns[i]) == act_bytes for i in model)     # batch·seq·d_model, local batch
    # forward = the all-reduces the loss depends on (after attention and after the MLP, Megatron's g);
    # the other half are in the backward pass (Megatron's f, transposed)
    fwd = _cone(spmd.program, spmd.output_names.index("0"))     # output 0 of the step is the loss
    assert sum(i in fwd for i in model) == 2 * cfg["layers"]
    # the rest of bp+mp is bp's traffic on the model-sharded gradients
    r = simulate(spmd, "tpu-v4")
    assert r.by_axes["model"]["count"] == 4 * cfg["layers"]
    assert r.by_axes["model"]["bytes"] == 4 * cfg["layers"] * act_bytes
    assert r.by_axes["batch"]["bytes"] == sum(v.nbytes for _, v in _param_inputs(spmd)) + F32


def _gathered_param(spmd, e) -> str | None:
    """The parameter input an all_gather gathers (following layout-only ops back), or None."""
    producer = {o.id: x for x in spmd.program.eqns for o in x.outputs}
    names = {v.id: n for n, v in zip(spmd.input_names, spmd.program.inputs)}
    v = e.inputs[0]
    while type(v) is Var and v.id not in names and v.id in producer and \
            producer[v.id].prim in ("broadcast_in_dim", "reshape", "transpose", "convert_element_type"):
        v = producer[v.id].inputs[0]
    n = names.get(v.id) if type(v) is Var else None
    return n if n and n.startswith("params/") else None


@pytest.mark.parametrize("strategy", ["z3", "bp+mp+z3"])
def test_z3_all_gathers_the_parameters_once_per_pass(strategy):
    """ZeRO-3 gathers each parameter before its forward use and again for the backward pass.

    ``P`` = the bytes of the parameters one gather group reassembles (per device, after MP).
    Forward: every parameter is gathered exactly once, P bytes. Backward: the weight matrices and
    the layernorm scales are gathered again (the input gradients multiply by them); embeddings
    (gather/add) and biases are not, so the total is 2P minus those. Tolerance: the non-matrix share of P,
    which the test computes (14 % at the small size, ~5 % at t48): total ∈ [2P(1 - share), 2P].
    """
    exp, low = _small(strategy)
    spmd = low.spmd
    base = _small("bp+mp" if "mp" in strategy else "bp")[1].spmd
    assert not [e for e in base.collectives() if e.prim == "all_gather"]     # without Z3: no gathers
    params = dict(_param_inputs(base))          # same names; local bytes before the Z3 split = P
    P = sum(v.nbytes for v in params.values())
    again = {n for n, v in params.items() if (v.ndim == 2 and not n.startswith("params/embed/")) or n.endswith("/scale")}
    matrices = sum(v.nbytes for n, v in params.items() if n in again)
    gathers = [e for e in spmd.collectives() if e.prim == "all_gather"]
    assert all(e.params["axes"] == ("batch",) for e in gathers)
    per_param: dict[str, list[int]] = {}
    for e in gathers:
        n = _gathered_param(spmd, e)
        assert n is not None, f"all_gather of a non-parameter: {e}"
        per_param.setdefault(n, []).append(collective_bytes(e))
    assert set(per_param) == set(params)                                   # every parameter is gathered
    assert all(b == params[n].nbytes for n, bs in per_param.items() for b in bs)   # to its full (MP) size
    forward = sum(bs[0] for bs in per_param.values())
    backward = sum(sum(bs[1:]) for bs in per_param.values())
    assert forward == P
    assert backward == matrices
    assert Counter(len(bs) for bs in per_param.values()) == Counter(2 if n in again else 1 for n in params)
    total = simulate(spmd, "tpu-v4").by_collective["all_gather"]["bytes"]
    share = 1 - matrices / P
    assert 2 * P * (1 - share) <= total <= 2 * P
    assert total == pytest.approx(2 * P, rel=share)
    # and Z3 turns the gradient all-reduce into a reduce-scatter of the same P bytes
    assert sum(collective_bytes(e) for e in spmd.collectives() if e.prim == "reduce_scatter") == P


# -- full size: simulated, never allocated ---------------------------------------------------------
GiB = 2 ** 30


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["t32", "t48"])
def test_full_size_on_512_chips_fits_with_remat_and_not_without(preset):
    """bp+mp+z3 on a 512-chip tpu-v4 slice (8x8x8): finite step time, state < 1 % of HBM.

    Z3 x MP shard the parameters and both Adam moments 512 ways (embeddings 64 ways, they have no
    MP dim), so the state is tiny. What decides the fit is activations: the full-size presets
    recompute each layer in the backward pass (remat=1) and fit in 32 GiB; without remat every layer
    keeps its activations, among them the softmax probabilities einsum(p, v)'s gradient needs —
    local batch (256/64 or 512/64) x local heads (32/8) x seq² x 4 B per layer — and t32 no longer fits."""
    spec = load_spec("tpu-v4")
    reports = {}
    for remat in (1, 0) if preset == "t32" else (1,):
        # the float32, naive-attention model, whose probabilities stay in HBM (the presets are bf16/flash)
        exp, low = _lowered("transformer", "bp+mp+z3", "batch=64,model=8", preset,
                            f"remat={remat},precision=f32,attention=naive")
        cfg = exp.cfg
        r = reports[remat] = simulate(low.spmd, spec)
        assert r.num_devices == 512 and "8x8x8" in r.topology
        assert math.isfinite(r.step_s) and r.step_s > 0 and r.compute_s > 0 and r.comm_s > 0
        assert r.step_s == pytest.approx(r.compute_s + r.comm_s, rel=1e-12)
        tokens = cfg["batch"] * cfg["seq"]
        # at least 6·N·tokens / devices matmul FLOPs (about 8·N·tokens with remat's second forward)
        assert r.by_op_kind["matmul"]["flops"] >= (6 + 2 * remat) * exp.scenario.param_count(cfg) * tokens / 512 * 0.9
        assert r.memory["params"] + r.memory["optimizer"] < 0.01 * spec.hbm_bytes
    probs = (cfg["batch"] // 64) * (cfg["heads"] // 8) * cfg["seq"] ** 2 * F32
    assert reports[1].fits and reports[1].memory["activations"] < cfg["layers"] * probs
    if 0 in reports:
        assert reports[0].memory["activations"] >= cfg["layers"] * probs
        assert not reports[0].fits and reports[0].memory["activations"] > spec.hbm_bytes
        assert reports[0].compute_s < reports[1].compute_s      # remat trades compute for memory


@pytest.mark.slow
def test_full_size_t48_fits_on_a_4096_chip_pod_with_no_dead_buffers():
    """t48 bp+mp+z3 on the whole tpu-v4 pod (batch=512, model=8): local batch 1, 4 heads. The compiler
    drops dead code at trace time (jax's backward of ``where(causal, scores, -1e9)`` leaves a zeros
    [batch, heads, seq, seq] nobody reads): the lowered program's peak is the dead-code-free peak."""
    exp, low = _lowered("transformer", "bp+mp+z3", "batch=512,model=8", "t48")
    spec = load_spec("tpu-v4")
    r = simulate(low.spmd, spec)
    assert r.num_devices == 4096 and math.isfinite(r.step_s) and r.step_s > 0
    assert r.peak_bytes_per_device == peak_memory(_dce(low.spmd.program)).peak_bytes
    assert r.fits
