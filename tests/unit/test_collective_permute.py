"""collective_permute as a first-class collective: its meaning, the in-process mesh, the file
format, the statistics, the analytical price (closed forms) and the DES (equal where nothing contends).

Expected values are computed independently of the code under test: blocks stacked along the
permuted mesh axes and moved with ``np.roll`` (plus zeroing where a shift falls off the end).
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from partir_emu.collectives.semantics import reference
from partir_emu.core.ir import Eqn, Program, Var
from partir_emu.core.mesh import Mesh
from partir_emu.core.sharding import Sharding
from partir_emu.core.spmd import SpmdProgram, permute_pairs, shift_pairs
from partir_emu.errors import CollectiveError
from partir_emu.hwmodels import Placement, Topology, load_spec, place, simulate
from partir_emu.hwmodels.des import simulate_des
from partir_emu.runtime.local_mesh import LocalMesh

REL = 1e-9


def rolled(stack: np.ndarray, shift: int, wrap: bool, axis: int = 0) -> np.ndarray:
    """Member i gets member i - shift's block (zeros off the end when not wrapping)."""
    out = np.roll(stack, shift, axis=axis)
    if not wrap:
        idx = [slice(None)] * stack.ndim
        idx[axis] = slice(0, shift) if shift > 0 else slice(stack.shape[axis] + shift, None)
        out[tuple(idx)] = 0
    return out


# -- the numpy meaning -------------------------------------------------------------------------------
def test_shift_pairs_by_hand():
    assert shift_pairs(4, 1, False) == ((0, 1), (1, 2), (2, 3))
    assert shift_pairs(4, -1, False) == ((1, 0), (2, 1), (3, 2))
    assert shift_pairs(4, 1, True) == ((0, 1), (1, 2), (2, 3), (3, 0))
    assert shift_pairs(3, -1, True) == ((0, 2), (1, 0), (2, 1))
    assert permute_pairs({"axes": ("x",), "shift": 1, "wrap": False}, 4) == shift_pairs(4, 1, False)
    assert permute_pairs({"axes": ("x",), "pairs": [[0, 2], [2, 0]]}, 4) == ((0, 2), (2, 0))


@pytest.mark.parametrize("p", [2, 3, 5])
@pytest.mark.parametrize("shift", [1, -1])
@pytest.mark.parametrize("wrap", [False, True])
def test_reference_shift(p, shift, wrap):
    rng = np.random.default_rng(p)
    bufs = [rng.standard_normal((2, 3)).astype(np.float32) for _ in range(p)]
    out = reference("collective_permute", bufs, permutation=shift_pairs(p, shift, wrap))
    np.testing.assert_array_equal(np.stack(out), rolled(np.stack(bufs), shift, wrap))


def test_reference_arbitrary_pairs():
    bufs = [np.full(3, i, np.int32) for i in range(5)]
    out = reference("collective_permute", bufs, permutation=((0, 3), (3, 0), (4, 1), (2, 2)))
    assert [int(o[0]) for o in out] == [3, 4, 2, 0, 0]   # member 4 is no target: zeros
    assert not any(np.shares_memory(o, b) for o in out for b in bufs)


# -- hand-built SPMD programs on LocalMesh -----------------------------------------------------------
def permute_program(mesh: Mesh, axes: tuple[str, ...], n: int = 3, m: int = 2, dtype: str = "float32",
                    **params) -> SpmdProgram:
    """x (dim 0 tiled by every mesh axis, in mesh order) -> collective_permute over ``axes``."""
    all_axes = mesh.axis_names
    p = mesh.size
    x = Var(0, (n, m), dtype)
    y = Var(1, (n, m), dtype)
    eqn = Eqn("collective_permute", (x,), (y,), {"axes": axes, **params})
    prog = Program((x,), ("x",), (eqn,), (y,), ("y",))
    sh = Sharding((all_axes, ()))
    return SpmdProgram(mesh, prog, (sh,), (sh,), ((p * n, m),), ((p * n, m),))


def expected(mesh: Mesh, axes: tuple[str, ...], g: np.ndarray, shift: int | None = None, wrap: bool = False,
             pairs=None) -> np.ndarray:
    """Blocks as a [size(a) for a in mesh] grid; the permuted axes flattened (major→minor) and moved."""
    sizes = [mesh.axis_size(a) for a in mesh.axis_names]
    grid = g.reshape(*sizes, -1, g.shape[1])
    pos = [mesh.axis_names.index(a) for a in axes]
    rest = [i for i in range(len(sizes)) if i not in pos]
    t = np.transpose(grid, pos + rest + [len(sizes), len(sizes) + 1])
    gp = math.prod(sizes[i] for i in pos)
    t = t.reshape((gp,) + t.shape[len(pos):])
    if pairs is None:
        t = rolled(t, shift, wrap)
    else:
        out = np.zeros_like(t)
        for s, d in pairs:
            out[d] = t[s]
        t = out
    t = t.reshape(tuple(sizes[i] for i in pos) + t.shape[1:])
    t = np.transpose(t, np.argsort(pos + rest + [len(sizes), len(sizes) + 1]))
    return t.reshape(g.shape)


CASES = [
    (Mesh(x=4), ("x",)),
    (Mesh(x=2, y=3), ("y",)),
    (Mesh(x=2, y=3), ("x",)),
    (Mesh(x=2, y=3), ("x", "y")),
    (Mesh(x=2, y=3), ("y", "x")),
]


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("mesh,axes", CASES, ids=str)
def test_local_mesh_shift(mesh, axes, algorithm):
    rng = np.random.default_rng(0)
    g = rng.standard_normal((mesh.size * 3, 2)).astype(np.float32)
    lm = LocalMesh(mesh, algorithm)
    for shift, wrap in itertools.product((1, -1), (False, True)):
        spmd = permute_program(mesh, axes, shift=shift, wrap=wrap)
        (out,) = lm.run(spmd, [g]).outputs
        np.testing.assert_array_equal(out, expected(mesh, axes, g, shift, wrap))


@pytest.mark.parametrize("mesh,axes", CASES, ids=str)
def test_local_mesh_arbitrary_pairs(mesh, axes):
    p = mesh.group_size(axes)
    rng = np.random.default_rng(p)
    dst = rng.permutation(p)
    pairs = tuple((s, int(d)) for s, d in enumerate(dst) if s != p - 1)   # the last source sends nothing
    g = np.arange(mesh.size * 3 * 2, dtype=np.int32).reshape(-1, 2)
    spmd = permute_program(mesh, axes, dtype="int32", pairs=pairs)
    for algorithm in ("ring", "direct"):
        (out,) = LocalMesh(mesh, algorithm).run(spmd, [g]).outputs
        np.testing.assert_array_equal(out, expected(mesh, axes, g, pairs=pairs))


def test_shift_and_pairs_spell_the_same_permute():
    mesh = Mesh(x=4)
    g = np.arange(24, dtype=np.float32).reshape(12, 2)
    a = LocalMesh(mesh).run(permute_program(mesh, ("x",), shift=-1, wrap=True), [g]).outputs[0]
    b = LocalMesh(mesh).run(permute_program(mesh, ("x",), pairs=((1, 0), (2, 1), (3, 2), (0, 3))), [g]).outputs[0]
    np.testing.assert_array_equal(a, b)


def test_stats_count_it():
    mesh = Mesh(x=4)
    spmd = permute_program(mesh, ("x",), shift=1, wrap=False)
    assert [e.prim for e in spmd.collectives()] == ["collective_permute"]
    st = spmd.stats()
    block = 3 * 2 * 4
    assert st.count == {"collective_permute": 1} and st.bytes == {"collective_permute": block}
    assert st.by_axes == {"x": {"count": 1, "bytes": block}}
    assert st.wire_bytes_per_device == pytest.approx(block * 3 / 4)    # 3 of 4 devices send their block
    wrapped = permute_program(mesh, ("x",), shift=1, wrap=True).stats()
    assert wrapped.wire_bytes_per_device == pytest.approx(block)


@pytest.mark.parametrize("params", [{"shift": 1, "wrap": False}, {"pairs": ((0, 2), (2, 0), (1, 1))}])
def test_save_load_round_trip(tmp_path, params):
    mesh = Mesh(x=2, y=2)
    spmd = permute_program(mesh, ("x", "y"), **params)
    path = tmp_path / "p.json"
    spmd.save(path)
    back = SpmdProgram.load(path)
    assert back.program.eqns[0].params == spmd.program.eqns[0].params
    assert back.dumps() == spmd.dumps()
    g = np.arange(24, dtype=np.float32).reshape(12, 2)
    np.testing.assert_array_equal(LocalMesh(mesh).run(back, [g]).outputs[0],
                                  LocalMesh(mesh).run(spmd, [g]).outputs[0])


@pytest.mark.parametrize("params, match", [
    ({"pairs": ((0, 1), (2, 1))}, "repeats"),
    ({"pairs": ((0, 4),)}, "outside"),
    ({"shift": 1}, "wrap"),
    ({"shift": 1, "wrap": True, "pairs": ((0, 1),)}, "either"),
    ({}, "either"),
])
def test_bad_params_are_named(params, match):
    mesh = Mesh(x=4)
    with pytest.raises(CollectiveError, match=match):
        LocalMesh(mesh).run(permute_program(mesh, ("x",), **params), [np.zeros((12, 2), np.float32)])


# -- the analytical price and the DES ----------------------------------------------------------------
A, B = 1e-6, 4.5e10


def _price(spmd: SpmdProgram, spec, placement) -> float:
    rep = simulate(spmd, spec, placement)
    (row,) = rep.collectives
    assert (row.prim, row.algorithm) == ("collective_permute", "direct")
    return row.time_s


@pytest.mark.parametrize("wrap", [False, True])
@pytest.mark.parametrize("shift", [1, -1, 2])
def test_price_on_a_ring(shift, wrap):
    """One step: each source's block crosses |shift| hops (the wrapped shift of a ring goes the short
    way round only for neighbours on the ring, which shift ±1 always are) with every link used once."""
    p = 8
    mesh = Mesh(x=p)
    spec = load_spec("tpu-v5e")
    topo = Topology.torus((p,), (True,), link_bw_bytes_per_s=B, link_latency_s=A)
    spmd = permute_program(mesh, ("x",), n=256, m=4, shift=shift, wrap=wrap)
    n = 256 * 4 * 4
    t = _price(spmd, spec, Placement(mesh, topo))
    hops = abs(shift)
    # shift 2: routes i->i+2 pass links (i,i+1),(i+1,i+2): every link carries two messages
    share = hops                       # shift 2: each link carries the messages of two sources
    assert t == pytest.approx(hops * A + n / (B / share), rel=REL)


def test_price_on_a_3d_torus_and_des_agrees():
    spec = load_spec("tpu-v4")
    mesh = Mesh(a=4, b=4, c=4)
    pl = place(mesh, spec, "a=x,b=y,c=z")
    assert pl.topology.wrap == (True, True, True)
    bw, lat = spec.network.link_bw_bytes_per_s, spec.network.link_latency_s
    n = 64 * 8 * 4
    for axes in (("a",), ("c",)):
        spmd = permute_program(mesh, axes, n=64, m=8, shift=1, wrap=True)
        t = _price(spmd, spec, pl)
        assert t == pytest.approx(lat + n / bw, rel=REL)
        des = simulate_des(spmd, spec, pl)                     # 16 groups, each on its own ring of links
        (row,) = des.collectives
        assert row.duration_s == pytest.approx(t, rel=REL)
        assert des.step_s == pytest.approx(simulate(spmd, spec, pl).step_s, rel=REL)


def test_wrapped_shift_on_an_open_line_walks_back():
    """v5e 4x4 has no wraparound: the wrapped shift's message 3 -> 0 crosses 3 hops back (on links
    nothing else uses), so the step takes 3 latencies + n / bw."""
    spec = load_spec("tpu-v5e")
    mesh = Mesh(x=4, y=4)
    pl = place(mesh, spec, "x=x,y=y")
    assert pl.topology.wrap == (False, False)
    bw, lat = spec.network.link_bw_bytes_per_s, spec.network.link_latency_s
    n = 64 * 8 * 4
    for wrap, hops in ((True, 3), (False, 1)):
        spmd = permute_program(mesh, ("y",), n=64, m=8, shift=1, wrap=wrap)
        t = _price(spmd, spec, pl)
        assert t == pytest.approx(hops * lat + n / bw, rel=REL)
        assert simulate_des(spmd, spec, pl).collectives[0].duration_s == pytest.approx(t, rel=REL)


@pytest.mark.parametrize("pairs", [None, ((0, 5), (5, 0), (3, 7))])
def test_price_on_nvswitch_and_des_agrees(pairs):
    """One H100 node: every message crosses GPU -> NVSwitch -> GPU, each link once."""
    spec = load_spec("h100")
    nv = spec.network
    mesh = Mesh(model=8)
    pl = place(mesh, spec)
    params = {"pairs": pairs} if pairs else {"shift": 1, "wrap": False}
    spmd = permute_program(mesh, ("model",), n=128, m=16, **params)
    n = 128 * 16 * 4
    t = _price(spmd, spec, pl)
    assert t == pytest.approx(2 * nv.nvlink_latency_s + n / nv.nvlink_bw_bytes_per_s, rel=REL)
    des = simulate_des(spmd, spec, pl)
    assert des.collectives[0].duration_s == pytest.approx(t, rel=REL)


def test_gpu_pairs_name_group_positions_across_nodes():
    """Two H100 nodes and a group over ("b", "a") with ``a`` across nodes: the schedule orders the
    chips by node (as NCCL orders ranks), yet the pairs still name group positions (b-major): 0 -> 1
    crosses InfiniBand (GPU 0 to GPU 8), 0 -> 2 stays on NVLink (GPU 0 to GPU 1)."""
    spec = load_spec("h100")
    nv = spec.network
    mesh = Mesh(a=2, b=8)
    pl = place(mesh, spec, "a=node,b=gpu")
    assert pl.group(("b", "a")).chips[:3] == (0, 8, 1)
    n = 32 * 4 * 4
    ib = _price(permute_program(mesh, ("b", "a"), n=32, m=4, pairs=((0, 1),)), spec, pl)
    assert ib == pytest.approx(2 * nv.ib_latency_s + n / nv.nic_bw_bytes_per_s, rel=REL)
    nvl = _price(permute_program(mesh, ("b", "a"), n=32, m=4, pairs=((0, 2),)), spec, pl)
    assert nvl == pytest.approx(2 * nv.nvlink_latency_s + n / nv.nvlink_bw_bytes_per_s, rel=REL)
    des = simulate_des(permute_program(mesh, ("b", "a"), n=32, m=4, pairs=((0, 1),)), spec, pl)
    assert des.collectives[0].duration_s == pytest.approx(ib, rel=REL)
