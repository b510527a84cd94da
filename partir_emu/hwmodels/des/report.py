"""What a DES run reports: while it runs, its progress on stderr; at the end, the step time, the
per-collective timings and contention, and the link utilization.

**Progress.** Progress of a long run on stderr: a one-line bar on a terminal, plain lines elsewhere.

``enabled=True`` shows it from the start; ``False`` never; ``None`` (auto) once the run has lasted
``delay_s`` (5 s): short runs stay silent, a long one (a 4096-chip step) says how far it is, on a
terminal as a bar redrawn in place, in a log (stderr not a terminal) as one line every ``line_every_s``.

**Trace export.** Chrome / Perfetto trace JSON of a DES run: device timelines and link utilization.

Open the file in https://ui.perfetto.dev (or ``chrome://tracing``). Layout:

- process ``devices``: per traced device two threads, ``dev N compute`` (one
  slice per run of compute equations, named after the op that dominates it)
  and ``dev N comm`` (one slice per collective, from its gate opening to its
  completion on that device);
- process ``links``: one counter track per traced link, its utilization
  (sum of the rates of the flows on it / its bandwidth, 0..1) over time — every
  change, or for a busy link of a long run its time-weighted mean over 2000
  equal intervals of the step (a 4096-chip step toggles a link ~20k times).

Which devices: the first ``trace_devices`` plus every straggler; which links:
those attached to the traced devices' chips plus every degraded or failed link
(a pod has tens of thousands of links; a trace of all of them is unreadable).
Times are microseconds (the format's unit).
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

# -- the Perfetto trace ---------------------------------------------------------------------------------
DEVICES_PID, LINKS_PID = 1, 2


class Recorder:
    """Collects the events of the traced devices and links while the simulation runs."""

    def __init__(self, devices: Iterable[int], links: Iterable[int], num_devices: int, cap: np.ndarray,
                 max_points: int = 2000) -> None:
        self.devices = sorted(set(int(d) for d in devices))
        self.mask = np.zeros(num_devices, dtype=bool)
        self.mask[self.devices] = True
        self.links = np.array(sorted(set(int(x) for x in links)), dtype=np.int64)
        self.cap = cap
        self.events: list[dict[str, Any]] = []
        self.max_points = max_points
        self._changes: list[tuple[float, np.ndarray, np.ndarray]] = []
        self._last = np.full(len(self.links), -1.0)

    def compute(self, devices: np.ndarray, t0: float, t1: float, action: Any) -> None:
        sel = devices[self.mask[devices]]
        for d in sel.tolist():
            self.events.append({"ph": "X", "pid": DEVICES_PID, "tid": 2 * d, "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6,
                                "name": action.name, "cat": "compute",
                                "args": {"eqns": f"{action.first}..{action.last}"}})

    def link_rates(self, t: float, links: np.ndarray | None, rates: np.ndarray | None) -> None:
        if not len(self.links):
            return
        if links is None or not len(links):
            util = np.zeros(len(self.links))
        else:
            assert rates is not None   # why: the network passes rates whenever it passes links
            fl = links.ravel()
            ok = fl >= 0
            total = np.bincount(fl[ok], weights=np.repeat(rates, links.shape[1])[ok], minlength=len(self.cap))
            with np.errstate(divide="ignore", invalid="ignore"):
                util = np.where(self.cap[self.links] > 0, total[self.links] / self.cap[self.links], 0.0)
        changed = np.flatnonzero(np.abs(util - self._last) > 1e-9)
        if changed.size:
            self._changes.append((t, changed, util[changed]))
            self._last[changed] = util[changed]

    def _counters(self, step_s: float) -> list[dict[str, Any]]:
        """Each traced link's utilization as counter events: every change, or — for a link that changes
        more than ``max_points`` times — its time-weighted mean over ``max_points`` equal buckets."""
        per: list[list[tuple[float, float]]] = [[] for _ in self.links]
        for t, ks, us in self._changes:
            for k, u in zip(ks.tolist(), us.tolist()):
                per[k].append((t, u))
        out = []
        edges = np.linspace(0.0, step_s, self.max_points + 1) if step_s > 0 else None
        for k, pts in enumerate(per):
            name = f"link {int(self.links[k])}"
            if len(pts) <= self.max_points or edges is None:
                out += [{"ph": "C", "pid": LINKS_PID, "ts": t * 1e6, "name": name, "args": {"util": round(u, 6)}}
                        for t, u in pts]
                continue
            mean = _bucket_means(pts, edges)
            last = None
            for t0, m in zip(edges[:-1].tolist(), mean.tolist()):
                m = round(m, 4)
                if m != last:
                    out.append({"ph": "C", "pid": LINKS_PID, "ts": t0 * 1e6, "name": name, "args": {"util": m}})
                    last = m
        return out

    def chrome_trace(self, sim: Any) -> dict[str, Any]:
        """The whole trace (adds the collective slices and the track names)."""
        ev = list(self.events) + self._counters(sim.step_s)
        for run in sim.runs:
            if run is None:
                continue
            m = run.groups.member_of_device[self.devices]
            for d, mm in zip(self.devices, m.tolist()):
                t0, t1 = run.t_start[mm], run.t_end[mm]
                if np.isfinite(t0) and np.isfinite(t1):
                    ev.append({"ph": "X", "pid": DEVICES_PID, "tid": 2 * d + 1, "ts": t0 * 1e6,
                               "dur": (t1 - t0) * 1e6, "name": f"{run.prim}({','.join(run.axes)})",
                               "cat": "collective",
                               "args": {"eqn": run.index, "bytes": run.nbytes, "algorithm": run.algorithm,
                                        "steps": run.num_steps}})
        meta = [{"ph": "M", "pid": DEVICES_PID, "name": "process_name", "args": {"name": "devices"}},
                {"ph": "M", "pid": LINKS_PID, "name": "process_name", "args": {"name": "links (utilization)"}}]
        for d in self.devices:
            meta.append({"ph": "M", "pid": DEVICES_PID, "tid": 2 * d, "name": "thread_name",
                         "args": {"name": f"dev {d} compute"}})
            meta.append({"ph": "M", "pid": DEVICES_PID, "tid": 2 * d + 1, "name": "thread_name",
                         "args": {"name": f"dev {d} comm"}})
        labels = {f"link {int(lid)}": str(sim.router.topology.links[int(lid)]) for lid in self.links}
        for e in ev:
            if e["ph"] == "C":
                e["name"] = labels.get(e["name"], e["name"])
        return {"traceEvents": meta + ev, "displayTimeUnit": "ms",
                "otherData": {"generator": "partir_emu.hwmodels.des", "step_s": sim.step_s}}


def _bucket_means(pts: list[tuple[float, float]], edges: np.ndarray) -> np.ndarray:
    """Time-weighted means, between consecutive ``edges``, of the step function that takes value ``u``
    from each ``(t, u)`` of ``pts`` on (0 before the first)."""
    ts = np.array([p[0] for p in pts] + [max(float(edges[-1]), pts[-1][0])])
    us = np.array([p[1] for p in pts])
    cum = np.concatenate(([0.0], np.cumsum(us * np.diff(ts))))           # the integral up to ts[i]
    i = np.clip(np.searchsorted(ts, edges, side="right") - 1, 0, len(us) - 1)
    integral = np.where(edges <= ts[0], 0.0, cum[i] + us[i] * (edges - ts[i]))
    return np.diff(integral) / np.diff(edges)


def write_chrome_trace(trace: dict[str, Any], path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        json.dump(trace, f, separators=(",", ":"))


# --------------------------------------------------------------------------------------------------
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
