"""The network models the timeline engine (:mod:`.engine`) runs its collectives on.

The engine decides *when* each collective starts (the issue rule); a network model says *when it
ends*, given what else is in flight. The protocol is two calls, so that a model may be a closed
form or a simulation that only knows the future by running it:

- ``begin(c, t)``: collective ``c`` starts at ``t`` (never earlier than the last call's time);
- ``run_until(t)``: advance to ``t``, stopping early at the first instant one or more collectives
  in flight finish; returns that instant (or ``t``) and those collectives (possibly none).

Models here:

- :class:`Standalone`: the closed form; a collective takes its standalone price ``tc[c]`` whatever
  else is in flight (one stream; or links that nothing shares);
- :class:`Shared`: collectives in flight together share links by the contention-aware analytical
  model (:class:`~partir_emu.hwmodels.network.concurrency.Contention`): each advances through its
  standalone time phase by phase at the speed the set in flight gives, recomputed whenever one
  starts, changes phase or finishes (a fluid model).

The DES's flow network is a third (:class:`partir_emu.hwmodels.des.engine_network.FlowModel`): the
engine run on it decides with the DES's timings, so the analytical and DES timelines differ only
by the network model.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Protocol

from partir_emu.hwmodels.network.concurrency import Contention

_INF = math.inf


class NetworkModel(Protocol):
    """What the timeline engine needs of a network (module docstring)."""

    def begin(self, c: int, t: float) -> None:
        """Collective ``c`` starts at ``t``."""

    def run_until(self, t: float) -> tuple[float, list[int]]:
        """Advance to ``t`` or to the first finish before it: (that time, the collectives finished)."""


class Standalone:
    """Each collective takes its standalone seconds ``tc[c]`` (the closed form)."""

    def __init__(self, tc: Sequence[float]) -> None:
        self.tc = tc
        self._ends: list[tuple[float, int]] = []      # (finish, collective) of those in flight

    def begin(self, c: int, t: float) -> None:
        heapq.heappush(self._ends, (t + self.tc[c], c))

    def run_until(self, t: float) -> tuple[float, list[int]]:
        ends = self._ends
        if not ends or ends[0][0] > t:
            return t, []
        when = ends[0][0]
        done = []
        while ends and ends[0][0] == when:
            done.append(heapq.heappop(ends)[1])
        return when, done


class Shared:
    """Collectives in flight share links by ``contention`` (module docstring); ``keys``: per
    collective, its index among the contention's collectives (``ProgramCosts.comm_inverse``)."""

    def __init__(self, tc: Sequence[float], contention: Contention, keys: Sequence[int]) -> None:
        self.tc, self.contention, self.keys = tc, contention, keys
        self.now = 0.0
        self.active: list[int] = []
        self.remaining: dict[int, float] = {}      # standalone seconds left in the current phase
        self.phase: dict[int, int] = {}
        self.speed: dict[int, float] = {}
        self.started: dict[int, float] = {}
        self._shares: dict[int, list[float]] = {}  # per distinct collective: its phases' time shares
        self._instant: list[int] = []              # begun with nothing to send: finished at once

    def begin(self, c: int, t: float) -> None:
        self._advance(t)
        self.started[c] = t
        if self.tc[c] > 0.0 and self._enter(c, 0):
            self.active.append(c)
            self._rates()
        else:
            self._instant.append(c)

    def run_until(self, t: float) -> tuple[float, list[int]]:
        if self._instant:
            done, self._instant = self._instant, []
            return self.now, done
        while True:
            first, t_end = -1, _INF
            for c in self.active:
                te = self.now + self.remaining[c] / self.speed[c]
                if te < t_end:
                    first, t_end = c, te
            if first < 0 or t_end > t:
                self._advance(t)
                return t, []
            self._advance(t_end)
            tc, rem = self.tc, self.remaining
            ended = [c for c in self.active if c == first or rem[c] <= 1e-12 * tc[c]]
            done = [c for c in ended if not self._enter(c, self.phase[c] + 1)]
            for c in done:
                self.active.remove(c)
                del rem[c]
            self._rates()
            if done:
                return t_end, done

    def _advance(self, to: float) -> None:
        dt = to - self.now
        if dt > 0.0:
            for c in self.active:
                self.remaining[c] -= self.speed[c] * dt
        self.now = max(self.now, to)

    def _rates(self) -> None:
        active, speed = self.active, self.speed
        if len(active) < 2:
            for c in active:
                speed[c] = 1.0
            return
        keys, phase, started = self.keys, self.phase, self.started
        for c, s in zip(active, self.contention.speeds([(keys[c], phase[c], started[c]) for c in active])):
            speed[c] = s

    def _phases(self, c: int) -> list[float]:
        """Standalone seconds of each phase of ``c``."""
        k = self.keys[c]
        sh = self._shares.get(k)
        if sh is None:
            sh = self._shares[k] = self.contention.shares(k)
        return [self.tc[c] * x for x in sh]

    def _enter(self, c: int, phase: int) -> bool:
        """Put ``c`` in its first phase from ``phase`` that takes time; False when none is left."""
        durs = self._phases(c)
        while phase < len(durs) and durs[phase] <= 0.0:
            phase += 1
        if phase == len(durs):
            return False
        self.phase[c], self.remaining[c] = phase, durs[phase]
        return True
