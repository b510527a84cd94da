"""What a DES run reports: while it runs, its progress on stderr; at the end, the step time, the
per-collective timings and contention, and the link utilization.

**Progress.** Progress of a long run on stderr: a one-line bar on a terminal, plain lines elsewhere.

``enabled=True`` shows it from the start; ``False`` never; ``None`` (auto) once the run has lasted
``delay_s`` (5 s): short runs stay silent, a long one (a 4096-chip step) says how far it is, on a
terminal as a bar redrawn in place, in a log (stderr not a terminal) as one line every ``line_every_s``.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO


@dataclass(frozen=True)
class DesCollectiveRow:
    """One communicating collective as simulated (times on device 0; ``duration_s`` is the
    longest any member spent in it)."""

    index: int
    prim: str
    axes: tuple[str, ...]
    nbytes: int
    group_size: int
    algorithm: str
    steps: int
    start_s: float
    end_s: float
    duration_s: float
    max_link_flows: int          # most concurrent flows seen on one link it used (any collective's)
    own_link_flows: int          # most flows of this collective (all groups) on one link
    group_link_flows: int        # most messages of one group on one link (all the analytical model sees)
    worst_link: str
    at: tuple[int, ...] = ()     # in a loop body: (loop equation, iteration) per enclosing loop (``index``: in the body)

    @property
    def contention(self) -> str:
        """``""``, ``"groups"`` (its own concurrent groups share a link) or ``"other"`` (another
        collective's flows share a link with it)."""
        if self.max_link_flows > self.own_link_flows:
            return "other"
        if self.own_link_flows > self.group_link_flows:
            return "groups"
        return ""

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["axes"] = list(self.axes)
        d["at"] = list(self.at)
        d["contention"] = self.contention
        return d


@dataclass(frozen=True)
class LinkRow:
    id: int
    label: str
    kind: str
    bytes: float
    utilization: float           # bytes / (bandwidth × step)
    max_flows: int
    bw_factor: float = 1.0

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class DesReport:
    spec: str
    topology: str
    placement: str
    mesh: str
    num_devices: int
    overlap: bool
    network: str
    step_s: float
    compute_s: float               # device 0's compute (its speed factor included)
    comm_s: float                  # device 0's time inside collectives (summed)
    exposed_comm_s: float          # step_s - compute_s
    device_end_min_s: float
    device_end_max_s: float
    mean_link_utilization: float   # over links that carried bytes
    max_link_utilization: float
    links_used: int
    num_links: int
    events: int
    wall_s: float
    flows: int
    walkers: int                   # device-class processes spawned over the run
    classes: int                   # most device classes alive at once (N with symmetry off)
    options: dict[str, Any]
    faults: tuple[str, ...]
    rerouted_routes: int
    collectives: tuple[DesCollectiveRow, ...] = field(repr=False)
    top_links: tuple[LinkRow, ...] = field(repr=False)
    link_utilization: tuple[float, ...] = field(repr=False, default=())

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self, link_utilization: bool = False) -> dict[str, Any]:
        keys = [k for k in self.__dataclass_fields__ if k not in ("collectives", "top_links", "link_utilization")]
        d = {k: getattr(self, k) for k in keys}
        d["faults"] = list(self.faults)
        d["events_per_s"] = self.events_per_s
        d["collectives"] = [r.to_json() for r in self.collectives]
        d["top_links"] = [r.to_json() for r in self.top_links]
        if link_utilization:
            d["link_utilization"] = list(self.link_utilization)
        return d

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def table(self, top: int = 10) -> str:
        lines = [f"{self.spec} | {self.topology}", f"placement: {self.placement}",
                 f"DES ({self.network} network{', overlap' if self.overlap else ''}): step {_t(self.step_s)}"
                 f" = compute {_t(self.compute_s)} + exposed comm {_t(self.exposed_comm_s)}"
                 f"  (device 0 in collectives {_t(self.comm_s)})"]
        if self.device_end_max_s - self.device_end_min_s > 1e-12 * max(self.step_s, 1e-30):
            lines.append(f"devices finish between {_t(self.device_end_min_s)} and {_t(self.device_end_max_s)}")
        if self.faults:
            lines.append("faults: " + "; ".join(self.faults) + f"  ({self.rerouted_routes} routes rerouted)")
        lines.append(f"links: {self.links_used} of {self.num_links} used, mean utilization "
                     f"{100 * self.mean_link_utilization:.1f}%, max {100 * self.max_link_utilization:.1f}%")
        lines.append(f"simulated {self.events} events, {self.flows} flows in {self.wall_s:.2f} s "
                     f"({self.events_per_s:,.0f} events/s; devices in at most {self.classes} equivalence "
                     f"class(es) at once)")
        if self.top_links:
            lines += ["", f"{'busiest links':<44}{'MB':>10}{'util':>8}{'flows':>7}"]
            for r in self.top_links[:top]:
                lines.append(f"{r.label[:43]:<44}{r.bytes / 1e6:>10.3f}{100 * r.utilization:>7.1f}%{r.max_flows:>7}")
        if self.collectives:
            lines += ["", f"slowest collectives (of {len(self.collectives)}):",
                      f"{'eqn':>6} {'prim':<15}{'axes':<14}{'MB':>10}{'algorithm':>12}{'time':>12}  contention"]
            for c in sorted(self.collectives, key=lambda c: -c.duration_s)[:top]:
                why = {"": "-", "groups": f"{c.max_link_flows} flows of its groups on {c.worst_link}",
                       "other": f"{c.max_link_flows} flows incl. other collectives on {c.worst_link}"}[c.contention]
                lines.append(f"{c.index:>6} {c.prim:<15}{','.join(c.axes):<14}{c.nbytes / 1e6:>10.3f}"
                             f"{c.algorithm:>12}{_t(c.duration_s):>12}  {why}")
        return "\n".join(lines)

    __str__ = table


def _t(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if abs(s) >= 1e-3 else f"{s * 1e6:.2f} us"


# -- progress -----------------------------------------------------------------------------------
AUTO_DELAY_S = 5.0          # auto mode: silent until the run has lasted this long
LINE_EVERY_S = 5.0          # not a terminal: one line this often


class Progress:
    """``Progress(total, label)``; ``update(done, note)``; ``close()``. Redraws at most every ``every_s``."""

    def __init__(self, total: float, label: str = "", enabled: bool | None = None, stream: TextIO | None = None,
                 every_s: float = 0.2, width: int = 30, delay_s: float | None = None,
                 line_every_s: float | None = None, t0: float | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled is not False and total > 0
        self.delay_s = 0.0 if enabled else (AUTO_DELAY_S if delay_s is None else delay_s)
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total = total
        self.label = label
        self.every_s = every_s if self.tty else (LINE_EVERY_S if line_every_s is None else line_every_s)
        self.width = width
        self.t0 = time.perf_counter() if t0 is None else t0
        self._last = -float("inf")
        self._shown = False

    @property
    def due(self) -> bool:
        """Whether an :meth:`update` now would draw (callers skip computing the note otherwise)."""
        if not self.enabled:
            return False
        now = time.perf_counter()
        return now - self.t0 >= self.delay_s and now - self._last >= self.every_s

    def update(self, done: float, note: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.t0 < self.delay_s or (not force and now - self._last < self.every_s):
            return
        self._last = now
        frac = min(1.0, done / self.total)
        fill = int(frac * self.width)
        shown = f"{done:g}" if float(done).is_integer() else f"{done:.2f}"
        text = (f"{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {100 * frac:5.1f}% {shown}/{self.total:g} "
                f"{note} {now - self.t0:6.1f}s")
        self.stream.write(f"\r{text} " if self.tty else text + "\n")
        self.stream.flush()
        self._shown = True

    def close(self, done: float | None = None, note: str = "") -> None:
        """The final state (in auto mode only if the run lasted past the delay)."""
        if self.enabled:
            self.update(self.total if done is None else done, note, force=True)
            if self._shown and self.tty:
                self.stream.write("\n")
                self.stream.flush()
