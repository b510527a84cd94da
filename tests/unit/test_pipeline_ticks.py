"""The 1F1B tick arithmetic (``scenarios/transformer/pipeline_ticks.py``), checked by enumeration on
plain integers: every device runs every (chunk, micro-batch) unit forward and backward exactly once;
a unit's input is its neighbour's output of the tick before (the ring wraps from the last device to
the first for the next chunk, and back); a backward unit comes after its forward unit and reads the
slot that unit wrote before the ring buffer comes round; the head runs on exactly the ticks the last
device runs the last chunk; and the phases cover the ticks in order."""
from __future__ import annotations

import numpy as np
import pytest

from scenarios.transformer.pipeline_ticks import Units, held, phases, slots

CASES = [(2, 1, 4), (4, 1, 2), (4, 1, 8), (2, 2, 4), (4, 2, 8), (3, 3, 6)]


def _cfg(p: int, v: int, m: int) -> dict:
    return {"pipeline": p, "virtual_stages": v, "microbatches": m}


def _schedule(p: int, v: int, m: int):
    """{(k, chunk, j): tick} of the forward and backward units, the slot each backward unit reads, and
    the head ticks, from the phases and Units."""
    cfg, units, ids = _cfg(p, v, m), Units(_cfg(p, v, m)), np.arange(p)
    fwd, bwd, slot_of, heads = {}, {}, {}, []
    for ph in phases(cfg):
        for t in range(ph.start, ph.start + ph.ticks):
            if ph.forward:
                for k, c, j, ok in zip(ids, *units.forward(t, ids)):
                    if ok:
                        assert (k, c, j) not in fwd
                        fwd[int(k), int(c), int(j)] = t
            if ph.head:
                heads.append(t)
            if ph.backward:
                for k, c, j, ok, s in zip(ids, *units.backward(t, ids)):
                    if ok:
                        assert (k, c, j) not in bwd
                        bwd[int(k), int(c), int(j)] = t
                        slot_of[int(k), int(c), int(j)] = int(s)
    return fwd, bwd, slot_of, heads


@pytest.mark.parametrize("p, v, m", CASES)
def test_every_unit_runs_once_after_its_input(p, v, m):
    fwd, bwd, slot_of, heads = _schedule(p, v, m)
    every = {(k, c, j) for k in range(p) for c in range(v) for j in range(m)}
    assert set(fwd) == every and set(bwd) == every
    for k, c, j in every:
        if k > 0:
            assert fwd[k, c, j] == fwd[k - 1, c, j] + 1              # from the device before, a tick on
        elif c > 0:
            assert fwd[0, c, j] == fwd[p - 1, c - 1, j] + 1          # round the ring: the next chunk
        if k < p - 1:
            assert bwd[k, c, j] == bwd[k + 1, c, j] + 1
        elif c < v - 1:
            assert bwd[p - 1, c, j] == bwd[0, c + 1, j] + 1
        else:
            assert bwd[k, c, j] == fwd[k, c, j]                      # the head's tick: forward, head, backward
        assert 0 <= bwd[k, c, j] - fwd[k, c, j] < slots(_cfg(p, v, m))   # read before the ring buffer comes round
        assert slot_of[k, c, j] == fwd[k, c, j] % slots(_cfg(p, v, m))
    assert heads == sorted(fwd[p - 1, v - 1, j] for j in range(m))


@pytest.mark.parametrize("p, v, m", CASES)
def test_the_phases_cover_the_ticks_and_give_the_bubble(p, v, m):
    ph = phases(_cfg(p, v, m))
    assert ph[0].start == 0 and all(a.start + a.ticks == b.start for a, b in zip(ph, ph[1:]))
    f_ticks = sum(x.ticks for x in ph if x.forward)
    b_ticks = sum(x.ticks for x in ph if x.backward)
    assert f_ticks == b_ticks == v * m + p - 1                      # (P-1) of them idle on every device
    if v == 1:
        assert [(x.ticks, x.forward, x.head, x.backward) for x in ph] == \
            [(p - 1, True, False, False), (m, True, True, True), (p - 1, False, False, True)][(p == 1):]


def test_what_an_mpmd_stage_0_holds():
    assert [held(_cfg(4, 1, 8)), held(_cfg(4, 1, 2)), held(_cfg(4, 2, 8)), held(_cfg(35, 3, 280))] == \
        [4, 2, 2 * 3 + 4 + 1, 2 * 34 + 2 * 35 + 1]
