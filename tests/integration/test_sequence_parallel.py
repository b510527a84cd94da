"""Megatron's sequence parallelism (``sp``, Korthikanti et al. 2022): the step verifies against
``jax.jit`` under every strategy it combines with; the model axis carries all-gathers over the
sequence into the column-parallel matmuls and reduce-scatters of the row-parallel outputs in place
of Megatron's activation all-reduces; the activations kept for the backward pass shrink by the
tensor-parallel size in the norm regions; a sequence the model axis cannot split, or a scenario without a sequence, is
a clear error.
"""
from __future__ import annotations

import functools
from collections import Counter

import pytest

from partir_emu.app.experiment import Experiment
from partir_emu.core.mesh import Mesh
from partir_emu.errors import PartirError, ScenarioError
from partir_emu.hwmodels import simulate
from partir_emu.runtime.local_mesh import LocalMesh

MESH = Mesh(batch=2, model=2)


@functools.cache
def _exp(strategy: str, mesh: Mesh = MESH, preset: str = "tiny", overrides: str = "batch=8,layers=1",
         strict: bool = True) -> Experiment:
    return Experiment("transformer", strategy, mesh, preset, overrides, strict=strict)


@pytest.mark.parametrize("strategy, overrides", [
    ("mp+sp", "batch=8,layers=1"), ("bp+mp+sp", "batch=8,layers=1"), ("bp+mp+sp+z3", "batch=8,layers=1"),
    ("bp+mp+sp", "batch=8,layers=2,remat=1,attention=flash"), ("bp+mp+emb+sp", "batch=8,layers=1"),
    ("bp+mp+sp", "batch=8,layers=1,microbatches=2")])
def test_sequence_parallel_step_verifies(strategy, overrides):
    exp = _exp(strategy, overrides=overrides)
    low = exp.lower()
    inputs = exp.inputs(low.spmd.input_names)
    ver = exp.check(LocalMesh(MESH).run(low.spmd, inputs).outputs, inputs, low.spmd.output_names)
    assert ver.verified, ver.to_json()["worst"]
    assert not low.warnings, low.warnings


def _model_axis(strategy: str) -> list:
    spmd = _exp(strategy, strict=False).lower().spmd
    return [c for c in spmd.collectives() if c.params["axes"] == ("model",)]


def test_all_gathers_and_reduce_scatters_over_the_sequence_replace_the_all_reduces():
    mp = Counter(c.prim for c in _model_axis("bp+mp"))
    assert set(mp) == {"all_reduce"}                              # Megatron: activations all-reduced
    sp = _model_axis("bp+mp+sp")
    kinds = Counter(c.prim for c in sp)
    assert kinds["all_gather"] >= 2 and kinds["reduce_scatter"] >= 2 and kinds["all_reduce"] < mp["all_reduce"]
    seq = 8                                                       # the tiny preset's sequence
    for c in sp:
        if c.prim == "all_gather":                                # [b, s/2, d] -> [b, s, d], into a matmul
            assert c.params["dim"] == 1 and c.inputs[0].shape[1] == seq // 2 and c.outputs[0].shape[1] == seq
        if c.prim == "reduce_scatter":                            # [b, s, d] partial -> [b, s/2, d]
            assert c.params["dim"] == 1 and c.outputs[0].shape[1] == seq // 2


def test_activations_of_the_norm_regions_shrink():
    """Priced on TPU v4 without recompute: what two more layers add to the peak activations. Under sp
    the norms' and residual adds' tensors are split over the 4 tensor-parallel chips, so a layer keeps
    less than under Megatron's mp (where they are whole on every chip; the attention and MLP
    tensors are split by heads and d_ff in both)."""
    mesh = Mesh(batch=2, model=4)

    def kept(strategy: str, layers: int) -> float:
        spmd = _exp(strategy, mesh, "small", f"batch=8,remat=0,layers={layers}", strict=False).lower().spmd
        return simulate(spmd, "tpu-v4").memory["activations"]

    per_mp = kept("bp+mp", 4) - kept("bp+mp", 2)
    per_sp = kept("bp+mp+sp", 4) - kept("bp+mp+sp", 2)
    assert 0 < per_sp < 0.8 * per_mp, (per_sp, per_mp)


def test_a_sequence_the_model_axis_cannot_split_and_a_scenario_without_one_are_refused():
    with pytest.raises(PartirError, match=r"batch/\w+.*not divisible by 4"):
        _exp("bp+mp+sp", Mesh(batch=2, model=4), overrides="batch=8,layers=1,seq=6").lower()
    from scenarios import get_scenario
    mlp = get_scenario("mlp")
    with pytest.raises(ScenarioError, match="no sequence dim"):
        mlp.strategy("bp+mp+sp", MESH, mlp.config())
