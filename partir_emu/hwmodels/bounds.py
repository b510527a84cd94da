"""Lower bounds of a program's step on a placement from some of its collective prices: what lets a
placement search skip placements that cannot win without pricing all their collectives.

The step of one run (:func:`partir_emu.hwmodels.pricing.price`) on a placement depends on the
placement only through the collectives' prices; the compute times are the chip's. With the prices of
some distinct collectives known (the others taken as 0), :meth:`StepBound.value` is a number the
step cannot be below, whatever the unknown prices are:

- without overlap the step is ``compute + sum of the collectives``: that sum over the known ones;
- with overlap on one communication stream (:mod:`partir_emu.hwmodels.timeline.overlap`):

  - the stream runs one collective at a time, so the step is at least the sum of every collective's
    price (each executed one counted);
  - collective ``c`` starts no earlier than the compute stream has finished the equations before
    its ready position ``r_c``, and the compute stream starts its wait position ``w_c`` no earlier
    than ``c`` finished: the stall before ``w_c`` grows by at least ``t_c - slack_c`` (``slack_c``:
    the compute time from ``r_c`` to ``w_c``). For a chain of collectives whose intervals follow
    one another (``r`` of the next after ``w`` of the one before) the stalls add up, so the step is
    at least ``compute + sum over the chain of max(0, t_c - slack_c)``. Any chain gives a bound;
    :meth:`StepBound.fit` picks the one that is largest with a placement's prices (weighted interval
    scheduling), and the bound keeps it for the other placements.

Each of these follows from the schedule's rules alone (readiness, waits, one stream), so it holds
for every placement (a collective the schedule waits for earlier than the plan's wait position, one
that blocks the compute stream, only stalls it more); it is not a re-run of the schedule with unknown prices at 0, which a list
schedule does not bound (shortening one collective may delay another one).

Not bounded (:meth:`StepBound.of` gives None): programs with loops (a loop's time is its body's
step, priced on the same placement), several communication streams (collectives in flight share
links).
"""
from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np

from partir_emu.hwmodels.compute.program import ProgramAnalysis, compute_times
from partir_emu.hwmodels.machine.specs import HardwareSpec


class StepBound:
    """The lower bounds of the module docstring for one program on one chip (every placement)."""

    def __init__(self, entry: ProgramAnalysis, spec: HardwareSpec, overlap: bool, prefetch_bytes: int | None,
                 compute_scale: float) -> None:
        pc = entry.costs
        times = compute_times(pc, spec)
        if compute_scale != 1.0:
            times = times * compute_scale
        times[pc.is_comm] = 0.0
        n = len(times)
        self.overlap = overlap
        self.compute_s = float(times.sum())
        self.counts = np.bincount(pc.comm_inverse, minlength=len(pc.comm_keys)).astype(np.float64)
        self.key = pc.comm_inverse                            # per collective (program order): its distinct key
        self.chain = np.zeros(0, dtype=np.int64)              # collectives of the chain, program order
        self.order: list[int] = list(range(len(pc.comm_keys)))   # distinct keys, the most telling first
        self.lead = 0                                         # keys of the chain (priced first)
        if overlap and len(self.key):
            P = np.zeros(n + 1)
            np.cumsum(times, out=P[1:])
            plan = entry.overlap_plan()
            ready = np.array(plan.ready_pos(prefetch_bytes), dtype=np.int64)
            wait = np.array(plan.wait_pos, dtype=np.int64)
            ok = (wait < n) & (ready <= wait)                   # waited for inside the program
            self.ready, self.wait = ready, wait
            self.slack = np.where(ok, P[np.minimum(wait, n)] - P[np.minimum(ready, n)], np.inf)
        else:
            self.slack = np.zeros(0)

    @staticmethod
    def of(entry: ProgramAnalysis, spec: HardwareSpec, overlap: bool, prefetch_bytes: int | None,
           comm_streams: int, compute_scale: float) -> StepBound | None:
        """The bound of ``entry``'s program on ``spec``, or None where the module docstring says so."""
        if entry.costs.loops or comm_streams != 1:
            return None
        return StepBound(entry, spec, overlap, prefetch_bytes, compute_scale)

    def fit(self, prices: np.ndarray) -> None:
        """Choose the chain that bounds highest with ``prices`` (seconds per distinct collective, one
        placement's) and order the keys for :class:`Probe`: those of the chain by what they add, then
        the others by their total time."""
        total = self.counts * prices
        per_key: np.ndarray
        if self.overlap and len(self.key):
            gain = np.maximum(prices[self.key] - self.slack, 0.0)
            self.chain = _heaviest_chain(self.ready, self.wait, gain)
            per_key = np.bincount(self.key[self.chain], weights=gain[self.chain], minlength=len(prices))
        else:
            per_key = np.zeros(len(prices))
        self.order = sorted(range(len(prices)), key=lambda k: (-per_key[k], -total[k], k))
        self.lead = int(np.count_nonzero(per_key > 0))

    def value(self, prices: np.ndarray) -> float:
        """The bound with ``prices`` (0 for a collective not priced yet)."""
        comm = float(self.counts @ prices)
        if not self.overlap:
            return self.compute_s + comm
        c = self.chain
        stall = float(np.maximum(prices[self.key[c]] - self.slack[c], 0.0).sum()) if len(c) else 0.0
        return max(self.compute_s + stall, comm, self.compute_s)


class Probe:
    """A placement's bound, raised by pricing its distinct collectives one at a time in the bound's
    order (``price(k)``: the seconds of distinct collective ``k`` on that placement). The prices
    found stay valid when the bound is fitted again (:meth:`StepBound.fit`). ``floor(k)``: a lower
    bound of ``price(k)``, cheaper to find (:meth:`~partir_emu.hwmodels.network.comm.CommModel.floor`):
    :meth:`exceeds` tries it first (the bound only grows with the prices it is given, and a price is
    never below its floor, so what exceeds a limit with floors does with the prices)."""

    def __init__(self, bound: StepBound, price: Callable[[int], float],
                 floor: Callable[[int], float] | None = None) -> None:
        self.bound = bound
        self.price = price
        self.floor = floor
        self.prices = np.zeros(len(bound.order))          # the price of a key known, else its floor or 0
        self.known = np.zeros(len(bound.order), dtype=bool)
        self.floored = np.zeros(len(bound.order), dtype=bool)
        self.value = bound.value(self.prices)

    @property
    def done(self) -> int:
        return int(self.known.sum())

    def _next(self, floors: bool = False) -> bool:
        """Price the first key of the order not priced yet (False: all are); with ``floors`` (and a
        ``floor``), floor it first: the floor's work is the first part of its price's."""
        for k in self.bound.order:
            if not self.known[k]:
                if floors and self.floor is not None and not self.floored[k]:
                    self.prices[k] = self.floor(k)
                    self.floored[k] = True
                else:
                    self.prices[k] = self.price(k)
                    self.known[k] = True
                return True
        return False

    def advance(self, upto: int) -> float:
        """Price keys in the bound's order until ``upto`` are known; the bound then (no floors: the
        search orders the placements by it)."""
        while self.done < min(upto, len(self.known)) and self._next():
            pass
        self.value = self.bound.value(self.prices)
        return self.value

    def exceeds(self, limit: float) -> bool:
        """Whether the step is surely above ``limit``: keys floored and priced one by one until the bound
        passes it (True) or every key is priced and it does not (False)."""
        self.value = self.bound.value(self.prices)
        while self.value <= limit:
            if not self._next(floors=True):
                return False
            self.value = self.bound.value(self.prices)
        return True


def _heaviest_chain(ready: np.ndarray, wait: np.ndarray, gain: np.ndarray) -> np.ndarray:
    """The collectives of a chain (``ready`` of each after ``wait`` of the one before) of the largest
    total ``gain`` (weighted interval scheduling; only collectives with a gain take part)."""
    cand = np.flatnonzero(gain > 0)
    if not len(cand):
        return np.zeros(0, dtype=np.int64)
    cand = cand[np.argsort(wait[cand], kind="stable")]
    ends = wait[cand].tolist()
    starts, g = ready[cand].tolist(), gain[cand].tolist()
    best = [0.0] * (len(cand) + 1)           # best[i]: the heaviest chain among the first i (by wait)
    take: list[int] = [0] * len(cand)        # where the chain through i continues (-1: taken alone)
    for i in range(len(cand)):
        j = bisect.bisect_left(ends, starts[i])          # intervals ending before this one is ready
        with_i = g[i] + best[j]
        take[i] = j
        best[i + 1] = max(best[i], with_i)
    out = []
    i = len(cand)
    while i > 0:
        if best[i] == best[i - 1]:
            i -= 1
            continue
        out.append(int(cand[i - 1]))
        i = take[i - 1]
    return np.array(sorted(out), dtype=np.int64)


__all__ = ["Probe", "StepBound"]
