"""Fault injection for the MPI tier's tests: a rank that raises, exits, dies, hangs or lies at a chosen
collective, passed into the mesh as an object (:class:`FaultInjector`), not read from the environment.

The mesh asks its injector once per communicating collective for that collective's :class:`Fault`
and calls its hooks at fixed points: :meth:`Fault.reached` (the rank has reached the collective),
:meth:`Fault.entered` (it reported "waiting for the other ranks"), :attr:`Fault.mismatch` (the
agreement check), :meth:`Fault.step` (before each step of our schedules) and :meth:`Fault.done`
(after them). The default injector's fault does nothing at any of them, so a production run has
no fault branch at all, only these calls.

A test names the fault in the job (``MpiRun(..., fault="rank:1:op:0:raise")`` or the CLI's hidden
``--inject-fault``); the driver writes it into the job file, and the worker builds the injector
from there with :func:`parse_fault` (a malformed spec is refused by the driver before launch).
``rank:R:op:K:MODE`` makes rank ``R`` misbehave at the first communicating collective whose
equation index is ``>= K`` (once; a collective in a loop body has its outermost loop's index):

``raise``    raise an EmulationError there (the rank reports it and aborts the job);
``exit``     ``os._exit(3)`` without a word (a crashing rank);
``kill``     SIGKILL itself in the middle of the collective (before step 1 of its schedule, or
             once it is inside MPI's own collective with ``--algorithm native``);
``hang``     sleep forever just before the collective (the run's ``--timeout`` must end it);
``mismatch`` claim a different operand shape in the agreement check.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

from partir_emu.errors import EmulationError

FAULT_MODES = ("raise", "exit", "kill", "hang", "mismatch")


class Fault:
    """What one collective does under injection; this base does nothing (no fault)."""

    mismatch = False

    def reached(self) -> None:
        """The rank reached the collective (before it says so)."""

    def entered(self, native: bool) -> None:
        """The rank is inside the collective, waiting for the others (``native``: MPI's own algorithm)."""

    def step(self, s: int) -> None:
        """Step ``s`` of our schedule is about to run."""

    def done(self) -> None:
        """The schedule's steps are done."""


NO_FAULT = Fault()


class FaultInjector:
    """Decides which collective of which rank misbehaves; this base injects nothing."""

    def at(self, rank: int, index: int) -> Fault:
        """The fault of the collective at equation ``index`` (outermost loop's index) on ``rank``."""
        return NO_FAULT


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _Mode(Fault):
    """The fault of :class:`InjectedFault` at its collective."""

    def __init__(self, mode: str, spec: str) -> None:
        self.mode, self.spec = mode, spec
        self.mismatch = mode == "mismatch"

    def reached(self) -> None:
        if self.mode == "hang":
            while True:
                time.sleep(1.0)

    def entered(self, native: bool) -> None:
        if self.mode == "raise":
            raise EmulationError(f"fault injected by {self.spec!r} (test hook)")
        if self.mode == "exit":
            os._exit(3)
        if self.mode == "kill" and native:
            _die()

    def step(self, s: int) -> None:
        if self.mode == "kill" and s >= 1:
            _die()

    def done(self) -> None:
        if self.mode == "kill":                # a one-step schedule: die after it
            _die()


@dataclass
class InjectedFault(FaultInjector):
    """Rank ``rank`` misbehaves as ``mode`` at its first communicating collective at or after equation ``op``."""

    rank: int
    op: int
    mode: str
    fired: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in FAULT_MODES:
            raise EmulationError(f"fault mode {self.mode!r}: use one of {FAULT_MODES}")

    @property
    def spec(self) -> str:
        return f"rank:{self.rank}:op:{self.op}:{self.mode}"

    def at(self, rank: int, index: int) -> Fault:
        if self.fired or rank != self.rank or index < self.op:
            return NO_FAULT
        self.fired = True
        return _Mode(self.mode, self.spec)


def parse_fault(text: str | None) -> FaultInjector:
    """The injector of a ``rank:R:op:K:MODE`` spec (None or empty: none)."""
    if not text:
        return FaultInjector()
    parts = text.split(":")
    if len(parts) != 5 or parts[0] != "rank" or parts[2] != "op" or parts[4] not in FAULT_MODES:
        raise EmulationError(f"fault {text!r}: expected rank:R:op:K:MODE with MODE in {FAULT_MODES}")
    try:
        return InjectedFault(int(parts[1]), int(parts[3]), parts[4])
    except ValueError:
        raise EmulationError(f"fault {text!r}: R and K must be integers") from None


__all__ = ["FAULT_MODES", "Fault", "FaultInjector", "InjectedFault", "NO_FAULT", "parse_fault"]
