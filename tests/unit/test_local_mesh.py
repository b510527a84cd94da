"""The in-process mesh: layout, every collective on several meshes and algorithms,
peak-memory accounting and argument checks, on hand-built SPMD programs."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from partir_emu.core.analysis import liveness
from partir_emu.core.ir import Eqn, Literal, Program, Var
from partir_emu.core.mesh import Mesh
from partir_emu.core.sharding import Sharding
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import ArgumentError, EmulationError, MeshError, UnsupportedPrimitiveError
from partir_emu.runtime.engine import run_spmd
from partir_emu.runtime.layout import shard, unshard
from partir_emu.runtime.local_mesh import LocalMesh

MESHES = {
    "2x2": Mesh(a=2, b=2),
    "4x2": Mesh(a=4, b=2),
    "2x2x2": Mesh(a=2, b=2, c=2),
}
# axis groups per mesh: one axis, several axes (including out of mesh order)
GROUPS = {
    "2x2": [("a",), ("b",), ("a", "b"), ("b", "a")],
    "4x2": [("a",), ("b",), ("a", "b"), ("b", "a")],
    "2x2x2": [("a",), ("c",), ("b", "c"), ("c", "a"), ("a", "b", "c")],
}
CASES = [(m, g) for m in MESHES for g in GROUPS[m]]
ALGORITHMS = ["direct", "ring", "bidir_ring", "recursive", "torus"]


class Builder:
    """Hand-builds one-collective SPMD programs with local shapes."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh, self.n, self.eqns = mesh, 0, []
        self.inputs, self.in_sh, self.in_global = [], [], []

    def var(self, shape, dtype="float32") -> Var:
        self.n += 1
        return Var(self.n - 1, tuple(shape), dtype)

    def input(self, global_shape, sharding: Sharding, dtype="float32") -> Var:
        v = self.var(sharding.local_shape(global_shape, self.mesh), dtype)
        self.inputs.append(v)
        self.in_sh.append(sharding)
        self.in_global.append(tuple(global_shape))
        return v

    def eqn(self, prim, ins, shape, dtype="float32", **params) -> Var:
        out = self.var(shape, dtype)
        self.eqns.append(Eqn(prim, tuple(ins), (out,), params, source="test"))
        return out

    def build(self, outs, out_sh, out_global, consts=()) -> SpmdProgram:
        prog = Program(tuple(self.inputs), tuple(f"in{i}" for i in range(len(self.inputs))), tuple(self.eqns),
                       tuple(outs), tuple(f"out{i}" for i in range(len(outs))), tuple(consts))
        return SpmdProgram(self.mesh, prog, tuple(self.in_sh), tuple(out_sh), tuple(self.in_global),
                           tuple(tuple(g) for g in out_global))


def _dims(ndim, dim, axes) -> Sharding:
    return Sharding(tuple(tuple(axes) if i == dim else () for i in range(ndim)))


def _rand(shape, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(-50, 50, shape).astype(dtype)


def _run(spmd, inputs, algorithm):
    return LocalMesh(spmd.mesh, algorithm).run(spmd, inputs)


# -- layout ------------------------------------------------------------------------
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_shard_unshard_round_trip(mesh_name):
    mesh = MESHES[mesh_name]
    names = mesh.axis_names
    x = _rand((8, 4, 16), seed=1)
    for perm in itertools.permutations(names):
        for cut in range(len(perm) + 1):
            # perm[:cut] tiles dim 0 (in that major→minor order), the rest tile dim 2
            s = Sharding((tuple(perm[:cut]), (), tuple(perm[cut:])))
            blocks = [shard(x, s, mesh, d) for d in range(mesh.size)]
            assert all(b.shape == s.local_shape(x.shape, mesh) for b in blocks)
            np.testing.assert_array_equal(unshard(blocks, s, mesh), x)


def test_shard_block_index_is_major_to_minor():
    mesh = Mesh(a=2, b=4)
    x = np.arange(8)
    for d in range(mesh.size):
        c = mesh.coords(d)
        assert shard(x, Sharding((("a", "b"),)), mesh, d)[0] == c["a"] * 4 + c["b"]
        assert shard(x, Sharding((("b", "a"),)), mesh, d)[0] == c["b"] * 2 + c["a"]


def test_unshard_rejects_disagreeing_replicas():
    mesh = Mesh(a=2, b=2)
    s = Sharding((("a",), ()))
    x = _rand((4, 3))
    blocks = [shard(x, s, mesh, d) for d in range(4)]
    blocks[3] = blocks[3].copy()
    blocks[3][0, 0] = np.nextafter(blocks[3][0, 0], np.float32(np.inf))
    with pytest.raises(EmulationError, match="logits.*disagree"):
        unshard(blocks, s, mesh, name="logits")


def test_unshard_sums_partial_axes():
    mesh = Mesh(a=2, b=2)
    s = Sharding(((), ("a",)), partial=("b",))
    x = _rand((2, 4))
    blocks = [shard(x, s, mesh, d) for d in range(4)]
    assert sum(np.abs(b).sum() > 0 for b in blocks) == 2  # only group member 0 of "b" holds it
    np.testing.assert_array_equal(unshard(blocks, s, mesh), x)


# -- collectives ----------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("mesh_name,axes", CASES)
def test_all_gather(mesh_name, axes, algorithm):
    mesh = MESHES[mesh_name]
    p = mesh.group_size(axes)
    for dim in (0, 1):
        b = Builder(mesh)
        g = (2 * p, 3 * p)
        x = b.input(g, _dims(2, dim, axes))
        shape = list(x.shape)
        shape[dim] *= p
        y = b.eqn("all_gather", [x], shape, axes=axes, dim=dim)
        spmd = b.build([y], [Sharding.replicated(2)], [g])
        xs = _rand(g, seed=dim)
        np.testing.assert_array_equal(_run(spmd, [xs], algorithm).outputs[0], xs)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("mesh_name,axes", CASES)
def test_reduce_scatter(mesh_name, axes, algorithm):
    mesh = MESHES[mesh_name]
    p = mesh.group_size(axes)
    b = Builder(mesh)
    g = (2 * p, 3 * p, 2)   # dim 0 tiled: each member holds a different (2, 3p, 2) block
    x = b.input(g, _dims(3, 0, axes), dtype="int32")
    y = b.eqn("reduce_scatter", [x], (2, 3, 2), "int32", axes=axes, dim=1)
    spmd = b.build([y], [_dims(3, 1, axes)], [(2, 3 * p, 2)])
    xs = _rand(g, "int32")
    np.testing.assert_array_equal(_run(spmd, [xs], algorithm).outputs[0], xs.reshape(p, 2, 3 * p, 2).sum(0))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("mesh_name,axes", CASES)
def test_all_reduce(mesh_name, axes, algorithm):
    mesh = MESHES[mesh_name]
    p = mesh.group_size(axes)
    for op, ref in (("sum", np.sum), ("max", np.max), ("min", np.min)):
        b = Builder(mesh)
        g = (3 * p, 5)          # 15 elements per member: not divisible by p
        x = b.input(g, _dims(2, 0, axes))
        y = b.eqn("all_reduce", [x], (3, 5), axes=axes, op=op)
        spmd = b.build([y], [Sharding.replicated(2)], [(3, 5)])
        xs = _rand(g).round(1)  # sums of one-decimal values: exact whatever the order
        got = _run(spmd, [xs], algorithm).outputs[0]
        np.testing.assert_allclose(got, ref(xs.reshape(p, 3, 5), axis=0), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("mesh_name,axes", CASES)
def test_all_to_all(mesh_name, axes, algorithm):
    """all_to_all moves the tiling from concat_dim to split_dim: the global value is unchanged."""
    mesh = MESHES[mesh_name]
    p = mesh.group_size(axes)
    g = (2 * p, 3 * p, p)
    xs = _rand(g, seed=3)
    for split_dim, concat_dim in itertools.permutations(range(3), 2):
        b = Builder(mesh)
        x = b.input(g, _dims(3, concat_dim, axes))
        shape = list(x.shape)
        shape[concat_dim] *= p
        shape[split_dim] //= p
        y = b.eqn("all_to_all", [x], shape, axes=axes, split_dim=split_dim, concat_dim=concat_dim)
        spmd = b.build([y], [_dims(3, split_dim, axes)], [g])
        np.testing.assert_array_equal(_run(spmd, [xs], algorithm).outputs[0], xs)


@pytest.mark.parametrize("mesh_name,axes", CASES)
def test_all_slice_and_to_partial(mesh_name, axes):
    mesh = MESHES[mesh_name]
    p = mesh.group_size(axes)
    b = Builder(mesh)
    g = (2, 2 * p)
    x = b.input(g, Sharding.replicated(2))
    s = b.eqn("all_slice", [x], (2, 2), axes=axes, dim=1)
    t = b.eqn("to_partial", [x], g, axes=axes)
    r = b.eqn("all_reduce", [t], g, axes=axes, op="sum")
    spmd = b.build([s, t, r], [_dims(2, 1, axes), Sharding(((), ()), partial=axes), Sharding.replicated(2)],
                   [g, g, g])
    xs = _rand(g)
    out = _run(spmd, [xs], "ring").outputs
    for o in out:
        np.testing.assert_array_equal(o, xs)


def test_collectives_compose_on_a_2d_sharded_matmul():
    """x[b, k] tiled (a, b-axis) @ w[k, n] tiled on k by the second axis: a partial
    sum over that axis, all_reduced, then all_gathered over the first."""
    mesh = Mesh(a=2, b=4)
    bld = Builder(mesh)
    x = bld.input((4, 8), Sharding((("a",), ("b",))))
    w = bld.input((8, 6), Sharding((("b",), ())))
    dn = (((1,), (0,)), ((), ()))
    part = bld.eqn("dot_general", [x, w], (2, 6), dimension_numbers=dn, preferred_element_type="float32")
    red = bld.eqn("all_reduce", [part], (2, 6), axes=("b",), op="sum")
    full = bld.eqn("all_gather", [red], (4, 6), axes=("a",), dim=0)
    spmd = bld.build([full, red], [Sharding.replicated(2), Sharding((("a",), ()))], [(4, 6), (4, 6)])
    xs, ws = _rand((4, 8), seed=1), _rand((8, 6), seed=2)
    for alg in ("direct", "ring"):
        out = _run(spmd, [xs, ws], alg).outputs
        np.testing.assert_allclose(out[0], xs @ ws, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out[1], xs @ ws, rtol=1e-5, atol=1e-5)


# -- peak memory -----------------------------------------------------------------------
def _tiny_program(mesh: Mesh) -> SpmdProgram:
    b = Builder(mesh)
    a = b.input((4,), Sharding.replicated(1))                 # 16 B
    bb = b.input((4,), Sharding.replicated(1))                # 16 B
    b.input((2,), Sharding.replicated(1))                     # 8 B, never read
    c = b.var((2,), "int32")                                  # const, 8 B
    t = b.eqn("mul", [a, bb], (4,))                           # +16
    b.eqn("neg", [bb], (4,))                                  # +16, dead
    u = b.eqn("add", [t, a], (4,))
    s = b.eqn("reduce_sum", [u], (), axes=(0,))
    k = b.eqn("convert_element_type", [c], (2,), new_dtype="float32")
    m = b.eqn("mul", [k, Literal(2.0, "float32")], (2,))
    return b.build([s, a, m], [Sharding.replicated(0), Sharding.replicated(1), Sharding.replicated(1)],
                   [(), (4,), (2,)], consts=[(c, np.array([1, 2], np.int32))])


def test_peak_bytes_by_hand():
    # start: a16 + b16 + unused8 + const8 = 48, then the unused input goes  -> 40
    # mul: +16 = 56;  neg: +16 = 72 (peak), then b and the dead result go -> 40
    # add: +16 = 56, t goes -> 40; reduce_sum: +4 = 44, u goes -> 28
    # convert: +8 = 36, const goes -> 28; mul by literal: +8 = 36, k goes -> 28
    spmd = _tiny_program(Mesh(a=2))
    plan = liveness(spmd.program)
    assert [v.id for v in plan.at_start] == [2]
    res = _run(spmd, [np.ones(4, np.float32), np.ones(4, np.float32), np.ones(2, np.float32)], "direct")
    assert res.peak_bytes_per_device == [72, 72]
    np.testing.assert_array_equal(res.outputs[2], [2.0, 4.0])
    assert res.outputs[0] == 8.0 and res.outputs[0].dtype == np.float32


def test_peak_bytes_counts_local_shapes_and_collective_buffers():
    mesh = Mesh(a=4)
    b = Builder(mesh)
    x = b.input((16, 4), _dims(2, 0, ("a",)))                 # local 4x4 = 64 B
    y = b.eqn("all_gather", [x], (16, 4), axes=("a",), dim=0)  # 256 B, x dies after it
    z = b.eqn("reduce_sum", [y], (4,), axes=(0,))              # 16 B
    spmd = b.build([z], [Sharding.replicated(1)], [(4,)])
    res = _run(spmd, [_rand((16, 4))], "ring")
    assert res.peak_bytes_per_device == [64 + 256] * 4


# -- errors ----------------------------------------------------------------------------
def test_argument_errors_name_the_input():
    spmd = _tiny_program(Mesh(a=2))
    lm = LocalMesh(spmd.mesh, "direct")
    ok = [np.ones(4, np.float32), np.ones(4, np.float32), np.ones(2, np.float32)]
    with pytest.raises(ArgumentError, match="takes 3 inputs"):
        lm.run(spmd, ok[:2])
    with pytest.raises(ArgumentError, match=r"'in1'.*float32\[4\].*float32\[5\]"):
        lm.run(spmd, [ok[0], np.ones(5, np.float32), ok[2]])
    with pytest.raises(ArgumentError, match=r"'in0'.*float32\[4\].*float64\[4\]"):
        lm.run(spmd, [np.ones(4), ok[1], ok[2]])
    with pytest.raises(MeshError):
        LocalMesh(Mesh(a=4)).run(spmd, ok)


def test_engine_names_unsupported_primitive():
    mesh = Mesh(a=2)
    b = Builder(mesh)
    x = b.input((2,), Sharding.replicated(1))
    y = b.eqn("fft", [x], (2,))
    spmd = b.build([y], [Sharding.replicated(1)], [(2,)])
    with pytest.raises(UnsupportedPrimitiveError, match="'fft'.*test"):
        run_spmd(spmd, [0, 1], {0: [np.ones(2, np.float32)], 1: [np.ones(2, np.float32)]}, lambda e, ops: ops)
