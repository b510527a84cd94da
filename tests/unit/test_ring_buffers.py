"""A pipeline's stash as an MPMD stack holds it (``hwmodels.ring_buffers``), on a hand-built
program whose profile is known by hand: each point loses the unheld slots of the ring buffer live
there, and the peak moves to a point without it when that point is now the highest."""
from __future__ import annotations

import pytest

from partir_emu.core.ir import Eqn, Program, Var
from partir_emu.errors import ArgumentError
from partir_emu.hwmodels.compute.memory import peak_memory
from partir_emu.hwmodels.ring_buffers import UNHELD, mpmd_profile, ring_buffers

F32 = "float32"
B = 32 * 32 * 4                     # bytes of a [32, 32] float32 value
R = 7 * 4 * 64 * 4                  # the ring buffer: 7 slots of [4, 64] float32
U = R * 3 // 7                      # the 3 slots an MPMD stage does not hold
DOT = {"dimension_numbers": (((1,), (0,)), ((), ())), "precision": None, "preferred_element_type": None}
META = {"ring_buffers": [{"what": "stash", "ndim": 3, "slots_dim": 0, "slots": 7, "held": 4, "dtype": F32}]}


def _program() -> Program:
    """``x = w * w; y = sum(ring); z = x @ x; u = z * x``: the ring buffer (an input) is live at the
    start, at x and at y; the program peaks at x (w, ring, x), the MPMD profile at u (x, y, z, u)."""
    w, ring, x, y, z, u = Var(0, (32, 32), F32), Var(1, (7, 4, 64), F32), Var(2, (32, 32), F32), \
        Var(3, (), F32), Var(4, (32, 32), F32), Var(5, (32, 32), F32)
    eqns = (Eqn("mul", (w, w), (x,)), Eqn("reduce_sum", (ring,), (y,), {"axes": (0, 1, 2)}),
            Eqn("dot_general", (x, x), (z,), DOT), Eqn("mul", (z, x), (u,)))
    return Program((w, ring), ("w", "ring"), eqns, (u, y), ("u", "y"))


def test_each_point_loses_the_unheld_slots_of_the_ring_buffer_live_there():
    prog = _program()
    own = peak_memory(prog)
    assert own.live_bytes == (B + R, 2 * B + R, B + R + 4, 2 * B + 4, 3 * B + 4)
    assert (own.peak_bytes, own.peak_at) == (2 * B + R, 0)
    mpmd = mpmd_profile(prog, own, ring_buffers(META))
    assert [a - b for a, b in zip(own.live_bytes, mpmd.live_bytes)] == [U, U, U, 0, 0]
    assert (mpmd.peak_bytes, mpmd.peak_at) == (3 * B + 4, 3)      # 2B + R - U = 12,288 < 3B + 4 = 12,292
    assert sum(mpmd.breakdown.values()) == mpmd.peak_bytes and mpmd.breakdown[UNHELD] == 0


def test_no_ring_buffer_leaves_the_profile_as_it_is():
    prog = _program()
    own = peak_memory(prog)
    assert mpmd_profile(prog, own, ()) is own
    other = {"ring_buffers": [dict(META["ring_buffers"][0], slots=5)]}          # matches no value
    assert mpmd_profile(prog, own, ring_buffers(other)) is own


@pytest.mark.parametrize("entry, needle", [
    ({"what": "stash", "ndim": 3}, r"ring_buffers\[0\] = .* is malformed .* needs what, ndim"),
    ({"what": "stash", "ndim": 3, "slots_dim": 0, "slots": 7, "held": 8, "dtype": F32}, r"0 < held <= slots"),
    ({"what": "stash", "ndim": 3, "slots_dim": 3, "slots": 7, "held": 4, "dtype": F32}, r"slots_dim < ndim"),
])
def test_a_malformed_ring_buffer_is_a_clear_error(entry, needle):
    with pytest.raises(ArgumentError, match=needle):
        ring_buffers({"ring_buffers": [entry]})
