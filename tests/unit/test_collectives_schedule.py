"""Pure tests of collective schedules: correctness (symbolically), step counts and traffic."""
from __future__ import annotations

import math
from fractions import Fraction

import pytest

from partir_emu.collectives.algorithms import ALGORITHMS, build_schedule, default_algorithm
from partir_emu.collectives.schedule import KINDS, CollectiveSchedule, Step, Transfer, validate_schedule
from partir_emu.errors import CollectiveError

SHAPES = [(1,), (2,), (3,), (4,), (5,), (8,), (2, 2), (2, 4), (4, 4), (2, 2, 2), (3, 2)]


def _perm(p: int) -> tuple[tuple[int, int], ...]:
    return tuple((i, (i + 1) % p) for i in range(p) if i % 3 != 2)


def _build(kind, shape, n_elems, alg, dpn=2, itemsize=4):
    p = math.prod(shape)
    perm = _perm(p) if kind == "collective_permute" else None
    return build_schedule(kind, shape, n_elems * itemsize, alg, itemsize=itemsize, devices_per_node=dpn,
                          permutation=perm)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("alg", ALGORITHMS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_schedule_computes_its_collective(kind, alg, shape):
    p = math.prod(shape)
    sizes = [4 * p, p, 1, 4 * p + 3] if kind == "all_reduce" else [4 * p, p]
    for n in sizes:
        for dpn in (2, 4):
            s = _build(kind, shape, n, alg, dpn)
            validate_schedule(s)
            assert s.p == p and s.kind == kind
            assert all(t.nbytes > 0 for st in s.steps for t in st.transfers)
            assert all(st.transfers for st in s.steps)
            assert CollectiveSchedule.from_json(s.to_json()) == s


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_ring_traffic_closed_forms(p):
    n = 8 * p * 4
    for kind, factor, steps in (("all_gather", 1, p - 1), ("reduce_scatter", 1, p - 1), ("all_reduce", 2, 2 * (p - 1))):
        s = build_schedule(kind, (p,), n, "ring")
        assert s.algorithm == "ring" and s.num_steps == steps
        for i in range(p):
            assert s.bytes_sent_by(i) == factor * Fraction(p - 1, p) * n
            assert s.bytes_received_by(i) == s.bytes_sent_by(i)
        assert all(len(st.transfers) == p for st in s.steps)  # one message per member per step
    s = build_schedule("all_to_all", (p,), n, "ring")
    assert s.algorithm == "pairwise" and s.num_steps == p - 1
    assert all(s.bytes_sent_by(i) == Fraction(p - 1, p) * n for i in range(p))


@pytest.mark.parametrize("p", [3, 4, 5, 8])
def test_bidir_ring_halves_each_direction(p):
    n = 16 * p * 4
    s = build_schedule("all_reduce", (p,), n, "bidir_ring")
    assert s.num_steps == 2 * (p - 1)
    for i in range(p):
        fwd = sum(t.nbytes for st in s.steps for t in st.transfers if t.src == i and t.dst == (i + 1) % p)
        bwd = sum(t.nbytes for st in s.steps for t in st.transfers if t.src == i and t.dst == (i - 1) % p)
        assert fwd == bwd == Fraction(p - 1, p) * n  # = half of the ring's 2(p-1)/p n, per direction
    assert all(len(msgs) == 2 * p for msgs in s.messages())


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_recursive_uses_log_steps(p):
    n = 4 * p * 4
    lg = int(math.log2(p))
    for kind, steps, factor in (("all_gather", lg, 1), ("reduce_scatter", lg, 1), ("all_reduce", 2 * lg, 2)):
        s = build_schedule(kind, (p,), n, "recursive")
        assert s.algorithm == "recursive" and s.num_steps == steps
        assert all(s.bytes_sent_by(i) == factor * Fraction(p - 1, p) * n for i in range(p))
        for st in s.steps:  # every member talks to exactly one partner per step
            assert len({(t.src, t.dst) for t in st.transfers}) == p
    # distances: halving p/2 .. 1, doubling 1 .. p/2
    rs = build_schedule("reduce_scatter", (p,), n, "recursive")
    assert [st.transfers[0].src ^ st.transfers[0].dst for st in rs.steps] == [p >> (k + 1) for k in range(lg)]


def test_fallbacks_record_the_algorithm_used():
    assert build_schedule("all_reduce", (6,), 96, "recursive").algorithm == "ring"
    assert build_schedule("all_reduce", (6,), 96, "torus").algorithm == "bidir_ring"
    assert build_schedule("all_reduce", (1, 6, 1), 96, "torus").algorithm == "bidir_ring"
    assert build_schedule("all_reduce", (2, 3), 96, "torus").algorithm == "torus"
    assert build_schedule("all_reduce", (8,), 96, "hierarchical", devices_per_node=3).algorithm == "ring"
    assert build_schedule("all_reduce", (8,), 96, "hierarchical", devices_per_node=8).algorithm == "ring"
    assert build_schedule("all_reduce", (8,), 96, "hierarchical", devices_per_node=4).algorithm == "hierarchical"
    assert build_schedule("all_to_all", (2, 4), 128, "torus").algorithm == "torus"
    assert build_schedule("all_to_all", (8,), 128, "torus").algorithm == "pairwise"
    assert build_schedule("all_to_all", (8,), 128, "hierarchical", devices_per_node=2).algorithm == "direct"
    assert build_schedule("collective_permute", (4,), 16, permutation=((0, 1),)).algorithm == "direct"


@pytest.mark.parametrize("shape", [(2, 2), (2, 4), (4, 4), (2, 2, 2), (3, 2)], ids=str)
def test_torus_traffic_and_steps(shape):
    p = math.prod(shape)
    n = 4 * p * 4
    s = build_schedule("all_reduce", shape, n, "torus")
    # reduce-scatter dim by dim: dim t moves (d_t - 1)/d_t of what is left, then all-gather the same back
    per_dev, left = Fraction(0), Fraction(n)
    for d in shape:
        per_dev += Fraction(d - 1, d) * left
        left /= d
    assert all(s.bytes_sent_by(i) == 2 * per_dev for i in range(p))
    assert s.num_steps == 2 * sum(d - 1 for d in shape if d > 1)
    for st in s.steps:  # every transfer stays on one line of the torus (differs in one coordinate)
        for t in st.transfers:
            a, b = _unravel(t.src, shape), _unravel(t.dst, shape)
            assert sum(x != y for x, y in zip(a, b)) == 1
    a2a = build_schedule("all_to_all", shape, n, "torus")
    assert a2a.num_steps == sum(d - 1 for d in shape if d > 1)


def _unravel(i, shape):
    out = []
    for d in reversed(shape):
        out.append(i % d)
        i //= d
    return tuple(reversed(out))


@pytest.mark.parametrize("p,d", [(4, 2), (8, 2), (8, 4), (12, 3)])
def test_hierarchical_traffic(p, d):
    n = 4 * p * 4
    q = p // d
    s = build_schedule("all_reduce", (p,), n, "hierarchical", devices_per_node=d)
    assert s.num_steps == 2 * ((d - 1) + (q - 1))
    intra = Fraction(d - 1, d) * n
    inter = Fraction(q - 1, q) * n / d
    assert all(s.bytes_sent_by(i) == 2 * (intra + inter) for i in range(p))
    cross = sum(t.nbytes for st in s.steps for t in st.transfers if t.src // d != t.dst // d)
    assert cross == p * 2 * inter  # only the inter-node phase leaves a node
    ag = build_schedule("all_gather", (p,), n, "hierarchical", devices_per_node=d)
    assert ag.num_steps == (d - 1) + (q - 1)
    assert all(ag.bytes_sent_by(i) == intra + inter for i in range(p))


def test_uneven_all_reduce_sends_no_empty_transfers():
    s = build_schedule("all_reduce", (8,), 4, "ring")  # a scalar over 8 members
    validate_schedule(s)
    assert s.total_bytes_sent() == 2 * 7 * 4
    assert sum(1 for b in s.chunk_bytes if b == 0) == 7
    r = build_schedule("all_reduce", (8,), 4, "recursive")
    validate_schedule(r)
    assert all(t.nbytes == 4 for st in r.steps for t in st.transfers)


def test_collective_permute_is_one_direct_step():
    s = build_schedule("collective_permute", (4,), 32, permutation=((0, 2), (2, 0), (1, 1)))
    assert s.num_steps == 1 and {(t.src, t.dst) for t in s.steps[0].transfers} == {(0, 2), (2, 0)}
    assert s.output_chunks(3) is None and s.output_chunks(1) == (1,)


def test_messages_group_transfers_by_pair():
    s = build_schedule("all_reduce", (4, 4), 4 * 16 * 4, "torus")
    for st, msgs in zip(s.steps, s.messages()):
        assert sum(m.nbytes for m in msgs) == sum(t.nbytes for t in st.transfers)
        assert len({(m.src, m.dst) for m in msgs}) == len(msgs)
    assert s.num_messages() == sum(len(m) for m in s.messages())
    assert "torus" in s.describe()


def test_default_algorithm():
    assert default_algorithm("all_reduce", (8,)) == "bidir_ring"
    assert default_algorithm("all_reduce", (2,)) == "ring"
    assert default_algorithm("all_reduce", (4, 4)) == "torus"
    assert default_algorithm("all_reduce", (16,), devices_per_node=8) == "hierarchical"
    assert default_algorithm("all_gather", (8,), devices_per_node=8) == "bidir_ring"
    for kind in KINDS:
        assert default_algorithm(kind, (2, 4), 4) in ALGORITHMS


@pytest.mark.parametrize("call,match", [
    (lambda: build_schedule("all_sum", (4,), 16), "unknown collective kind"),
    (lambda: build_schedule("all_reduce", (4,), 16, "nope"), "unknown collective algorithm"),
    (lambda: build_schedule("all_gather", (4,), 12), "divisible by p"),
    (lambda: build_schedule("all_reduce", (4,), 10), "multiple of itemsize"),
    (lambda: build_schedule("all_reduce", (0, 4), 16), "group_shape"),
    (lambda: build_schedule("all_reduce", (4,), 16, "hierarchical"), "devices_per_node"),
    (lambda: build_schedule("collective_permute", (4,), 16), "permutation"),
    (lambda: build_schedule("collective_permute", (4,), 16, permutation=((0, 4),)), "outside"),
    (lambda: build_schedule("collective_permute", (4,), 16, permutation=((0, 1), (2, 1))), "repeats"),
    (lambda: build_schedule("all_reduce", (4,), 16, permutation=((0, 1),)), "only meaningful"),
    (lambda: build_schedule("all_reduce", (4,), 16, itemsize=0), "itemsize"),
    (lambda: CollectiveSchedule.from_json('{"format": "x"}'), "format"),
    (lambda: CollectiveSchedule.from_json("not json"), "JSON"),
])
def test_bad_input_raises_collective_error(call, match):
    with pytest.raises(CollectiveError, match=match):
        call()


def test_validate_catches_broken_schedules():
    good = build_schedule("all_reduce", (4,), 64, "ring")
    dropped = CollectiveSchedule(**{**_fields(good), "steps": good.steps[:-1]})
    with pytest.raises(CollectiveError, match="ends without"):
        validate_schedule(dropped)
    t = good.steps[0].transfers[0]
    twice = CollectiveSchedule(**{**_fields(good), "steps": (Step((t, t)),) + good.steps[1:]})
    with pytest.raises(CollectiveError, match="twice"):
        validate_schedule(twice)
    wrong_size = Transfer(t.src, t.dst, t.nbytes + 4, t.chunk, t.reduce)
    bad = CollectiveSchedule(**{**_fields(good), "steps": (Step((wrong_size,)),)})
    with pytest.raises(CollectiveError, match="nbytes"):
        validate_schedule(bad)


def _fields(s: CollectiveSchedule) -> dict:
    return {k: getattr(s, k) for k in ("kind", "algorithm", "group_shape", "nbytes", "num_chunks", "steps",
                                       "chunk_bytes", "itemsize", "permutation", "layout")}


# ------------------------------------------------------------------------ compact storage
def test_built_schedules_are_tables_behind_the_steps_api():
    s = build_schedule("all_reduce", (8,), 8 * 16 * 4, "bidir_ring")
    tab = s.table()
    assert len(tab) == sum(len(st.transfers) for st in s.steps) and tab.num_steps == s.num_steps
    # the lazy steps behave as the tuple of Step objects
    steps = tuple(s.steps)
    assert s.steps == steps and steps == s.steps and hash(s.steps) == hash(steps)
    assert s.steps[0] == steps[0] and s.steps[-1] == steps[-1] and s.steps[1:3] == steps[1:3]
    assert (Step(()),) + s.steps[1:] == (Step(()),) + steps[1:]
    # a schedule made from Step objects has the same table and compares equal
    same = CollectiveSchedule(**{**_fields(s), "steps": steps})
    assert same == s and same.table().same(tab)
    assert same.num_messages() == s.num_messages() and same.total_bytes_sent() == s.total_bytes_sent()
    assert same.touching([0, 3]) == s.touching([0, 3])
    import pickle
    back = pickle.loads(pickle.dumps(s))
    assert back == s and back.table().same(tab)


def test_touching_lists_transfers_of_the_positions():
    s = build_schedule("all_reduce", (2, 4), 8 * 8 * 4, "torus")
    got = s.touching([1, 6])
    want = [[i for i, t in enumerate(st.transfers) if {t.src, t.dst} & {1, 6}] for st in s.steps]
    assert got == want


def test_big_ring_schedule_is_compact_and_lazy():
    s = build_schedule("all_reduce", (1024,), 1024 * 64 * 4, "bidir_ring")
    tab = s.table()
    assert len(tab) == 2 * 1024 * 2 * 1023 and s.num_steps == 2 * 1023
    arrays = (tab.ptr, tab.src, tab.dst, tab.chunk, tab.count, tab.reduce)
    assert sum(a.nbytes for a in arrays) < 80 * 2 ** 20      # 4 M transfers in well under 100 MB
    assert s.steps._steps is None                            # no Step objects made ...
    st = s.steps[5]
    assert len(st.transfers) == 2048 and s.steps._steps is None  # ... not even when one is read
    assert s.total_bytes_sent() == 2 * 1023 * (1024 * 64 * 4)  # 2(p-1)/p of the buffer from each member
