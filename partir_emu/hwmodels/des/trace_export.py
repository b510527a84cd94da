"""Chrome / Perfetto trace JSON of a DES run: device timelines and link utilization.

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
from collections.abc import Iterable
from typing import Any

import numpy as np

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
