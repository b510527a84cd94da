"""The narrow interfaces the parts of the DES see of each other.

The simulation (:mod:`.model`) wires three kinds of parts together; each part sees the others
only through one of these protocols, so the dependencies run one way: ``model`` imports
``device``, ``collective`` and the networks; none of them imports ``model``.

- a :class:`Network` (:class:`~.network.FlowNetwork`, :class:`~partir_emu.hwmodels.des.network.chunked.ChunkNetwork`) carries the
  flows a collective sends and reports contention to the flows' :class:`ContentionSink`;
- a running collective (:class:`~.collective.CollectiveRun`) is hosted by a
  :class:`CollectiveHost`: the simulation of a step, or the replay of a message trace;
- the devices (:class:`~.device.Devices`) open a collective through a :class:`CollectiveOpener`
  and report compute spans to a :class:`ComputeSink` (the trace recorder).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import simpy

from partir_emu.hwmodels.des.classes import MemberClasses
from partir_emu.hwmodels.des.network.routing import FlowClasses, RoutePattern
from partir_emu.hwmodels.des.plans import FlowStep

Delivered = Callable[[np.ndarray | None, float], None]
"""``on_delivered(flow ids, or None for all flows of the send, time)``."""


class ContentionSink(Protocol):
    """Who is told how crowded the links of its flows were (a collective's statistics)."""

    def contention(self, flows: int, link: int, own: int) -> None:
        """``flows`` flows shared ``link``, ``own`` of them from this sink's send."""


class Network(Protocol):
    """Moves flows over the routed links; counts what crossed each link."""

    kind: str
    flows: int                       # flows started so far
    link_max_flows: np.ndarray       # per link: most flows at once

    @property
    def link_bytes(self) -> np.ndarray:
        """Per link: bytes carried so far (read-only: a network may total them on demand)."""

    def send(self, route: RoutePattern, idx: np.ndarray | None, nbytes: np.ndarray, on_delivered: Delivered,
             owner: ContentionSink | None = None, classes: FlowClasses | None = None) -> None:
        """Start flows ``idx`` of ``route`` (all when ``None``) now, ``nbytes[k]`` bytes for the k-th
        (with ``classes``: ``idx`` names classes of flows; only the flow network takes them)."""


class SpanNetwork(Network, Protocol):
    """A network that can hold lock-step spans (:mod:`.lockstep`; the flow network does): it prices a
    batch alone, reserves links for a span and counts what a span moved."""

    env: simpy.Environment
    resolution_s: float
    span_plans: dict[tuple, Any]             # .lockstep's cache

    def links_of(self, route: RoutePattern, classes: FlowClasses | None, idx: np.ndarray | None) -> np.ndarray: ...

    def free_steps(self, links: np.ndarray, first: np.ndarray, n: int) -> int: ...

    def alone(self, route: RoutePattern, classes: FlowClasses | None, idx: np.ndarray | None
              ) -> tuple[np.ndarray, list[tuple[int, int, int]]] | None: ...

    def reserve(self, links: np.ndarray, on_break: Callable[[float], None]) -> int: ...

    def release(self, sid: int) -> None: ...

    def account(self, route: RoutePattern, classes: FlowClasses | None, idx: np.ndarray | None,
                nbytes: np.ndarray, owner: ContentionSink | None, row: tuple[int, int, int] | None) -> None: ...

    def call_later(self, delay: float, fn: Callable[[float], None]) -> None: ...


class CollectiveHost(Protocol):
    """What a running collective needs from whoever runs it."""

    @property
    def env(self) -> simpy.Environment: ...

    @property
    def network(self) -> Network: ...

    @property
    def message_overhead_s(self) -> float:
        """A sender posts the messages of a step one after another, this long each."""

    def collective_done(self, ci: int, devices: np.ndarray, t: float, complete: bool) -> None:
        """Collective ``ci`` finished on ``devices`` at ``t``; ``complete``: on every device now."""


class SpanRun(ContentionSink, Protocol):
    """What a lock-step span (:mod:`.lockstep`) reads and drives of the collective it belongs to
    (:class:`.collective.CollectiveRun`): its units (members, or classes of members), each unit's
    current step, the step plans, and the entry into and exit from steps."""

    M: int                                 # units
    cur: np.ndarray                        # per unit: the step it is in (-1: not started)
    classes: MemberClasses | None

    @property
    def plans(self) -> Sequence[FlowStep]: ...
    live_spans: set[Any]

    def enter(self, members: np.ndarray, s: int, t: float) -> None:
        """``members`` enter step ``s`` at ``t``."""

    def leave(self, s: int, n: int) -> None:
        """``n`` units left step ``s``."""

    def index_of(self, plan: FlowStep, members: np.ndarray) -> np.ndarray | None:
        """The flows of ``plan`` that ``members`` send (None: all)."""

    def post(self, plan: FlowStep, s: int, idx: np.ndarray | None, nbytes: np.ndarray) -> None:
        """Post step ``s``'s flows ``idx`` with ``nbytes`` left to send."""


class CollectiveOpener(Protocol):
    """What the devices need from the simulation: a collective whose gate opened is started."""

    def open_collective(self, c: int, devices: np.ndarray, t: float) -> None:
        """The gate of collective ``c`` opened for ``devices`` at ``t``."""


class ComputeSpan(Protocol):
    """A run of compute equations, as the trace shows it."""

    @property
    def first(self) -> int: ...

    @property
    def last(self) -> int: ...

    @property
    def name(self) -> str: ...


class ComputeSink(Protocol):
    """Where the devices report what they computed (the Perfetto trace recorder)."""

    def compute(self, devices: np.ndarray, t0: float, t1: float, action: ComputeSpan) -> None: ...


__all__ = ["Delivered", "ContentionSink", "Network", "SpanNetwork", "CollectiveHost", "CollectiveOpener", "ComputeSpan",
           "ComputeSink"]
