"""A pipeline's stash as an MPMD stack holds it: the memory of the schedule the SPMD program emulates.

The 1F1B step (``scenarios/transformer/pipeline_1f1b.py``) runs its pipeline in lock-step: every stage
does a forward and a backward unit each tick and a micro-batch moves one stage a tick either way, so
stage ``k`` holds its inputs for ``2(P - 1 - k) + 1`` ticks and the ring buffer they go to (the *stash*)
has ``2P - 1`` slots on every device. A stack that runs each stage as its own program (Megatron-LM's
``forward_backward_pipelining_without_interleaving``: ``P - k - 1`` warm-up forwards, then one forward
and one backward alternately, each stage at its own pace) holds ``P - k`` micro-batches at stage ``k``:
the hops take one unit, not one tick. The program's time is the same (the bubble is
``(P-1)/(M+P-1)`` either way); its memory is not.

The scenario says which buffers are such ring buffers in the lowered program's ``meta``
(``"ring_buffers"``: rank, slot dim, slots, slots an MPMD stage 0 holds, dtype), and a stack whose
``[memory] pipeline = "mpmd"`` prices them at ``held / slots`` of their bytes while they are live
(:func:`mpmd_profile`): the peak over the enclosing program's points, each less the unheld slots of
the ring buffer live there. Only ring buffers live in the top-level program are seen (a stash inside
a loop's body is priced as the program holds it).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from partir_emu.core.ir import Program, Var
from partir_emu.errors import ArgumentError
from partir_emu.hwmodels.compute.costs import nbytes_of
from partir_emu.hwmodels.compute.memory import MemoryProfile, breakdown_at, lifetimes

UNHELD = "mpmd_unheld_slots"       # the breakdown's (negative) entry: ring buffer slots an MPMD stage does not hold


@dataclass(frozen=True)
class RingBuffer:
    """A buffer of ``slots`` slots along dim ``slots_dim`` of which an MPMD stage holds ``held``."""

    what: str
    ndim: int
    slots_dim: int
    slots: int
    held: int
    dtype: str

    def matches(self, v: Var) -> bool:
        return len(v.shape) == self.ndim and v.shape[self.slots_dim] == self.slots and v.dtype == self.dtype

    def unheld(self, v: Var) -> int:
        """The bytes of ``v`` in the slots an MPMD stage does not hold."""
        return nbytes_of(v) * (self.slots - self.held) // self.slots

    def to_json(self) -> dict[str, Any]:
        return {"what": self.what, "ndim": self.ndim, "slots_dim": self.slots_dim, "slots": self.slots,
                "held": self.held, "dtype": self.dtype}


def ring_buffers(meta: Mapping[str, Any]) -> tuple[RingBuffer, ...]:
    """The ring buffers a lowered program's ``meta`` names (none: ``()``)."""
    out = []
    for i, d in enumerate(meta.get("ring_buffers", ())):
        try:
            rb = RingBuffer(str(d["what"]), int(d["ndim"]), int(d["slots_dim"]), int(d["slots"]), int(d["held"]),
                            str(d["dtype"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ArgumentError(f"program meta ring_buffers[{i}] = {d!r} is malformed ({exc}); it needs what, "
                                f"ndim, slots_dim, slots, held and dtype") from None
        if not (0 <= rb.slots_dim < rb.ndim and 0 < rb.held <= rb.slots):
            raise ArgumentError(f"program meta ring_buffers[{i}] = {d!r}: needs 0 <= slots_dim < ndim and "
                                f"0 < held <= slots")
        out.append(rb)
    return tuple(out)


def unheld_at_points(prog: Program, points: int, released: Mapping[int, int],
                     rings: Sequence[RingBuffer]) -> list[int]:
    """Per program point (start, then each equation: ``points`` of them), the bytes an MPMD stack does
    not hold of the ring buffers live there. ``released``: Var id -> the point after which it is gone
    (-1: the start point). Each point counts one ring buffer value per ring: a loop's carry-in and
    carry-out of the stash are one buffer (the loop's carry is donated)."""
    out = [0] * points
    defined = {v.id: -1 for v in prog.inputs}
    values: list[Var] = list(prog.inputs)
    for i, e in enumerate(prog.eqns):
        for o in e.outputs:
            defined[o.id] = i
            values.append(o)
    for rb in rings:
        best = [0] * points
        for v in values:
            if type(v) is not Var or not rb.matches(v):
                continue
            lo, hi = defined[v.id] + 1, released.get(v.id, len(prog.eqns) - 1) + 1
            n = rb.unheld(v)
            for p in range(lo, min(hi, points - 1) + 1):
                best[p] = max(best[p], n)
        out = [a + b for a, b in zip(out, best)]
    return out


def mpmd_profile(program: Program, profile: MemoryProfile, rings: Sequence[RingBuffer]) -> MemoryProfile:
    """``profile`` (of ``program``, program order) as an MPMD stack holds ``rings``: each point less
    the slots it does not hold of the ring buffers live there; the peak and its breakdown at the new
    peak point (with a negative :data:`UNHELD` entry, so the breakdown still sums to the peak). The
    profile as it is when it has no points (a schedule's profile) or no ring buffer is live."""
    if not rings or not profile.live_bytes:
        return profile
    lv = lifetimes(program, profile.policy)
    released = {v.id: -1 for v in lv.at_start} | {v.id: i for i, gone in enumerate(lv.after) for v in gone}
    unheld = unheld_at_points(program, len(profile.live_bytes), released, rings)
    if not any(unheld):
        return profile
    points = tuple(b - u for b, u in zip(profile.live_bytes, unheld))
    at = max(range(len(points)), key=points.__getitem__)
    bd = breakdown_at(program, at - 1, profile.bodies, profile.policy)
    bd[UNHELD] = -unheld[at]
    return replace(profile, peak_bytes=points[at], peak_at=at - 1, breakdown=bd, live_bytes=points)


__all__ = ["UNHELD", "RingBuffer", "mpmd_profile", "ring_buffers", "unheld_at_points"]
