"""Hybrid ZeRO over part of the data axes (``bp+z3@batch``: FSDP inside a slice, data parallelism
across slices over DCN, as MaxText's multi-slice runs and PyTorch's hybrid shard): it verifies
against ``jax.jit``; the state is sharded over ``batch`` only; each gradient is reduce-scattered over
``batch`` first and only its shard is all-reduced over ``dcn``; priced on two TPU slices the ``dcn``
bytes are those shards.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from partir_emu.app.experiment import Experiment
from partir_emu.core.mesh import Mesh
from partir_emu.errors import ScenarioError
from partir_emu.hwmodels import simulate
from partir_emu.runtime.local_mesh import LocalMesh

TINY = "batch=8,layers=1"


@functools.cache
def _exp(strategy: str, mesh: Mesh, overrides: str = TINY, strict: bool = True) -> Experiment:
    return Experiment("transformer", strategy, mesh, "tiny", overrides, strict=strict)


@pytest.mark.parametrize("strategy, mesh", [("bp+z3@batch", Mesh(dcn=2, batch=2)),
                                            ("bp+mp+z3@batch", Mesh(dcn=2, batch=2, model=2)),
                                            ("bp+z2@batch", Mesh(dcn=2, batch=2))])
def test_hybrid_zero_verifies(strategy, mesh):
    exp = _exp(strategy, mesh)
    low = exp.lower()
    inputs = exp.inputs(low.spmd.input_names)
    ver = exp.check(LocalMesh(mesh).run(low.spmd, inputs).outputs, inputs, low.spmd.output_names)
    assert ver.verified, ver.to_json()["worst"]


def test_state_is_sharded_over_batch_only_and_gradient_shards_cross_dcn():
    mesh = Mesh(dcn=2, batch=2)
    spmd = _exp("bp+z3@batch", mesh, strict=False).lower().spmd
    params = [(n, s) for n, s in zip(spmd.input_names, spmd.in_shardings) if n.startswith(("params/", "opt/"))]
    tiled = [n for n, s in params if any("batch" in d for d in s.dims)]
    assert tiled and not [n for n, s in params if any("dcn" in d for d in s.dims)]
    colls = spmd.collectives()
    assert not [c for c in colls if c.prim == "all_gather" and "dcn" in c.params["axes"]]   # replicated there
    rs = [c for c in colls if c.prim == "reduce_scatter" and c.params["axes"] == ("batch",)]
    dcn = [c for c in colls if c.prim == "all_reduce" and c.params["axes"] == ("dcn",)]
    # each sharded gradient: reduce-scatter over batch, then the all-reduce of its shard over dcn
    shard_elems = sorted(math.prod(c.outputs[0].shape) for c in rs)
    assert rs and [math.prod(c.inputs[0].shape) for c in dcn if math.prod(c.inputs[0].shape) in shard_elems]
    big = [c for c in dcn if math.prod(c.inputs[0].shape) > max(shard_elems)]
    assert not big, [(c.inputs[0].shape, c.source) for c in big]      # no full-size gradient crosses dcn
    order = {id(c): i for i, c in enumerate(colls)}
    first_rs = min(order[id(c)] for c in rs)
    assert all(order[id(c)] > first_rs for c in dcn if math.prod(c.inputs[0].shape) in shard_elems)


def test_priced_on_two_slices_only_the_shards_cross_dcn():
    """On 2 v5e slices of 4x4 (the mesh's dcn axis on the slice dim) the dcn axis carries the
    all-reduces of the gradient shards, each priced as the closed form of a 2-member ring whose 16
    flows per slice share 2 host NICs: 2 steps of (b/2 * 8 / host_bw + the route's latency)."""
    from partir_emu.hwmodels import load_spec

    dcn_spec = load_spec("tpu-v5e").network.dcn
    mesh = Mesh(dcn=2, batch=16)
    spmd = _exp("bp+z3@batch", mesh, "batch=32,layers=2", strict=False).lower().spmd
    rep = simulate(spmd, "tpu-v5e", slice_dims=(2, 4, 4))
    assert "2 slice(s)" in rep.topology and "DCN" in rep.topology
    sizes = [math.prod(c.inputs[0].shape) * np.dtype(c.inputs[0].dtype).itemsize
             for c in spmd.collectives() if c.prim == "all_reduce" and c.params["axes"] == ("dcn",)]
    assert rep.by_axes["dcn"]["bytes"] == sum(sizes) > 0
    f = dcn_spec.achieved_fraction           # the NIC as achieved: f x its bandwidth, its latency / f
    want = sum(2 * (b / 2 * dcn_spec.chips_per_host / (f * dcn_spec.host_bw_bytes_per_s) + 2 * dcn_spec.latency_s / f)
               for b in sizes)
    assert rep.by_axes["dcn"]["time_s"] == pytest.approx(want, rel=1e-4)     # (ring chunks are whole elements)


def test_dcn_collectives_that_do_not_overlap_compute_are_exposed_in_both_models():
    """With ``[dcn] overlaps_compute = false`` the compute stream waits for every collective across
    slices where it is issued: each one's whole time is exposed, so the step grows by at least the dcn
    collectives' time over the overlapped step (which hides them), and the DES replays the same waits."""
    from partir_emu.hwmodels import load_spec
    from partir_emu.hwmodels.des import simulate_des

    mesh = Mesh(dcn=2, batch=16)       # 8k tokens per chip: compute enough to hide the dcn all-reduces
    spmd = _exp("bp+z3@batch", mesh, "batch=256,seq=1024,layers=2,d_model=512,d_ff=2048", strict=False).lower().spmd
    hidden, blocking = (load_spec("tpu-v5e", overrides={"dcn.overlaps_compute": v}) for v in (True, False))
    a = simulate(spmd, hidden, slice_dims=(2, 4, 4), overlap=True)
    b = simulate(spmd, blocking, slice_dims=(2, 4, 4), overlap=True)
    dcn_s = b.by_axes["dcn"]["time_s"]
    assert a.by_axes["dcn"]["time_s"] == pytest.approx(dcn_s, rel=1e-12)     # the same prices, only the waits move
    assert a.exposed_comm_s < 0.5 * dcn_s                                     # hidden behind the backward pass
    assert b.exposed_comm_s >= dcn_s * (1 - 1e-9)
    assert b.step_s >= a.step_s + dcn_s - a.exposed_comm_s - 1e-12
    des = simulate_des(spmd, blocking, slice_dims=(2, 4, 4), overlap=True)
    assert des.step_s == pytest.approx(b.step_s, rel=0.02)
    assert simulate_des(spmd, hidden, slice_dims=(2, 4, 4), overlap=True).step_s == pytest.approx(a.step_s, rel=0.02)


@pytest.mark.parametrize("strategy, needle", [("bp+z3@model", r"z3@model names \['model'\]"),
                                              ("bp+z3@nope", r"z3@nope names \['nope'\]"),
                                              ("bp+z3@", r"names no axis")])
def test_zero_over_an_axis_that_is_not_a_data_axis_is_refused(strategy, needle):
    with pytest.raises(ScenarioError, match=needle):
        _exp(strategy, Mesh(dcn=2, batch=2, model=2)).lower()


def test_the_cli_prices_a_run_on_two_slices(capsys):
    from partir_emu.app.cli.main import main

    assert main(["simulate", "transformer", "--size", "tiny", "--strategy", "bp+z3@batch", "--mesh", "dcn=2,batch=16",
                 "--set", "batch=32", "--hardware", "tpu-v5e", "--slice", "2x4x4"]) == 0
    out = capsys.readouterr().out
    assert "2 slice(s) of 2D torus 4(open)x4(open) (16 chips) joined by DCN" in out
    assert main(["simulate", "transformer", "--size", "tiny", "--strategy", "bp+z3@batch", "--mesh", "dcn=2,batch=16",
                 "--set", "batch=32", "--hardware", "tpu-v3", "--slice", "2x4x4"]) != 0
    assert "no [dcn] table" in capsys.readouterr().err
