"""Bad input gets a PartirError subclass that names the problem."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from partir_emu import REPLICATED, ManualPartition, Mesh, jit
from partir_emu.api import lower_program, trace
from partir_emu.errors import (
    ArgumentError,
    MeshError,
    PartirError,
    ShardingError,
    TacticError,
    UnsupportedPrimitiveError,
)


def f(x, w):
    return jnp.tanh(x @ w)


X = np.ones((8, 4), np.float32)
W = np.ones((4, 6), np.float32)


def lower(schedule, mesh=None):
    mesh = mesh or Mesh(batch=2, model=2)
    return lower_program(trace(f, X, W), mesh, schedule)


def test_unknown_axis():
    with pytest.raises(MeshError, match="'data'.*not in mesh"):
        lower([ManualPartition({"x": 0}, axis="data")])


def test_axis_used_twice_on_one_value():
    with pytest.raises(ShardingError, match="'batch' is used twice on input 'x'"):
        lower([ManualPartition({"x": 0}, axis="batch"), ManualPartition({"x": 1}, axis="batch")])


def test_dim_out_of_range():
    with pytest.raises(TacticError, match="dim 2 is out of range for input 'w'"):
        lower([ManualPartition({"w": 2}, axis="model")])


def test_dim_not_divisible():
    with pytest.raises(ShardingError, match="dim 1 of input 'w' has size 6, which is not divisible by 4"):
        lower([ManualPartition({"w": 1}, axis="model")], Mesh(batch=2, model=4))


def test_pattern_matches_nothing():
    with pytest.raises(TacticError, match="pattern 'params/\\*' matches no input.*x, w"):
        lower([ManualPartition({"params/*": 0}, axis="batch")])


@pytest.mark.parametrize("sizes", [{"batch": 0}, {"batch": -2}, {"batch": 2, "model": 0}])
def test_mesh_size_below_one(sizes):
    with pytest.raises(MeshError, match="size .* every axis needs an integer size >= 1"):
        Mesh(**sizes)


def test_mesh_parse_errors():
    with pytest.raises(MeshError, match="not AXIS=SIZE"):
        Mesh.parse("batch2")
    with pytest.raises(MeshError, match="not an integer"):
        Mesh.parse("batch=two")
    assert Mesh.parse("batch=2, model=4").axes == (("batch", 2), ("model", 4))


def test_unsupported_primitive_names_it_and_where():
    def g(x):
        return jax.lax.cumlogsumexp(x)
    with pytest.raises(UnsupportedPrimitiveError, match="primitive 'cumlogsumexp' at .*test_compiler_errors.py"):
        trace(g, X)


def test_wrong_number_of_arguments():
    fn = jit(f, mesh=Mesh(batch=2), schedule=[ManualPartition({"x": 0}, axis="batch")])
    with pytest.raises(ArgumentError, match="takes 2 argument"):
        fn(X)


def test_wrong_shape_at_call_time():
    fn = jit(f, mesh=Mesh(batch=2), schedule=[ManualPartition({"x": 0}, axis="batch")])
    low = fn.lower(X, W)
    with pytest.raises(ArgumentError, match=r"input 'w': expected float32\[4, 6\], got float32\[4, 5\]"):
        low.run(X, np.ones((4, 5), np.float32))
    with pytest.raises(ArgumentError, match=r"takes 2 inputs \['x', 'w'\], got 1"):
        low.run(X)


def test_replicated_pin_blocks_propagation():
    low = lower([ManualPartition({"x": 1, "w": REPLICATED}, axis="model")])
    assert low.spmd.in_shardings[1].is_replicated()
    # the contraction dim of x is tiled, w is pinned: w is sliced locally, result partial → all_reduce
    kinds = [e.prim for e in low.spmd.program.eqns if e.prim in ("all_reduce", "all_slice", "all_gather")]
    assert kinds == ["all_gather"] or "all_reduce" in kinds


def test_errors_are_partir_errors():
    for cls in (ArgumentError, MeshError, ShardingError, TacticError, UnsupportedPrimitiveError):
        assert issubclass(cls, PartirError)
    assert jax  # imported for tracing
