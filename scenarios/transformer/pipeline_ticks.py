"""Which unit each stage of a 1F1B pipeline runs on each tick (``schedule=1f1b``; interleaved with
``virtual_stages=V``), as integer arithmetic on the tick number: the schedule of
:mod:`scenarios.transformer.pipeline_1f1b`, apart from the units it runs.

Device ``k`` of ``P`` holds the layer chunks ``k, P + k, ..., (V - 1)P + k`` (the circular layout of
:mod:`scenarios.transformer.pipeline`); a micro-batch's forward pass visits chunk ``0`` on devices
``0 .. P-1``, wraps to device 0 for chunk 1, and so on; its backward pass runs the same way back.
Micro-batches go in groups of ``P`` (Megatron's interleaved grouping, Narayanan et al. 2021 sec.
2.2.2): micro-batch ``j = gP + q`` of group ``g`` runs chunk ``c`` forward on device ``k`` on tick

    gPV + cP + q + k

and backward on tick ``T0 + gPV + (V-1-c)P + q + (P-1-k)`` with ``T0 = VP - 1``, the first tick a
micro-batch's last chunk runs on the last device (its head and its first backward unit follow its
forward unit on that tick). Each device thus runs one forward and one backward unit a tick, and a
unit's input is always its neighbour's output of the tick before (the last device's output wraps to
device 0, the first device's gradient to the last): no buffer between them. ``V = 1`` is PipeDream-
flush: forward on tick ``j + k``, backward on tick ``j + 2P - 2 - k``.

Forward units run on ticks ``0 .. VM + P - 2``, backward units on ``VP - 1 .. VM + VP + P - 3``, and
the head on the ticks the last device runs the last chunk: with ``(P - 1)/V`` idle forward and as many
idle backward units of a full stage a device, the bubble is ``(P - 1)/(VM + P - 1)``, Megatron's
interleaved one. A forward unit's input is kept (the stash) until its backward unit: ``2P(V - c) -
2(k + 1)`` ticks, so ``2PV - 1`` slots written by tick; an MPMD stage 0 (Megatron-LM
``schedules.py``) holds ``P`` units non-interleaved, ``2(P - 1) + (V - 1)P + 1`` interleaved.
"""
from __future__ import annotations

from dataclasses import dataclass

from scenarios.common import Config
from scenarios.transformer.pipeline import stages


def virtual(cfg: Config) -> int:
    return int(cfg.get("virtual_stages", 1))


def slots(cfg: Config) -> int:
    """The stash's slots: ``2PV - 1``."""
    return 2 * stages(cfg) * virtual(cfg) - 1


def held(cfg: Config) -> int:
    """The stash slots an MPMD stage 0 holds: Megatron-LM's warm-up forwards plus one, at most the
    ``VM`` units of a step."""
    p, v, m = stages(cfg), virtual(cfg), int(cfg["microbatches"])
    return min(p if v == 1 else 2 * (p - 1) + (v - 1) * p + 1, v * m)


@dataclass(frozen=True)
class Phase:
    """A run of ticks ``start .. start + ticks - 1`` that run the same kinds of unit: one tick loop."""

    start: int
    ticks: int
    forward: bool
    head: bool
    backward: bool


def phases(cfg: Config) -> list[Phase]:
    """The step's tick loops: warm-up (forward units), the ticks with both (the head on the last
    device's last-chunk ticks only), cool-down (backward units); consecutive ticks of one kind are one
    loop. ``V = 1``: three loops of ``P - 1``, ``M`` and ``P - 1`` ticks."""
    p, v, m = stages(cfg), virtual(cfg), int(cfg["microbatches"])
    t0, last_f, last_b = v * p - 1, v * m + p - 2, v * m + v * p + p - 3
    out: list[Phase] = []
    for t in range(last_b + 1):
        x = t - (p - 1)
        kind = (t <= last_f, t <= last_f and t >= t0 and 0 <= x < v * m and x % (p * v) >= (v - 1) * p, t >= t0)
        if out and (out[-1].forward, out[-1].head, out[-1].backward) == kind:
            out[-1] = Phase(out[-1].start, out[-1].ticks + 1, *kind)
        else:
            out.append(Phase(t, 1, *kind))
    return out


class Units:
    """The unit each stage runs on a tick: ``(chunk, micro-batch, runs)`` from traced ticks (jnp int32
    values; ``ids`` the stage ids, or one stage's id as a scalar)."""

    def __init__(self, cfg: Config) -> None:
        self.p, self.v, self.m = stages(cfg), virtual(cfg), int(cfg["microbatches"])
        self.t0, self.n_slots = self.v * self.p - 1, slots(cfg)

    def _decode(self, x, forward: bool):
        p, v = self.p, self.v
        r = x % (p * v)
        chunk = r // p if forward else v - 1 - r // p
        return chunk, (x // (p * v)) * p + r % p, (x >= 0) & (x < v * self.m)

    def forward(self, t, ids):
        """Each stage's forward unit on tick ``t``."""
        return self._decode(t - ids, True)

    def backward(self, t, ids):
        """Each stage's backward unit on tick ``t``, and the stash slot its forward unit wrote."""
        x = t - self.t0 - (self.p - 1 - ids)
        chunk, j, ok = self._decode(x, False)
        r = x % (self.p * self.v)
        f_tick = x - r + chunk * self.p + r % self.p + ids
        return chunk, j, ok, f_tick % self.n_slots


__all__ = ["Phase", "Units", "held", "phases", "slots", "virtual"]
