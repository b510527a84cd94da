"""What a DES run reports: step time, per-collective timings and contention, link utilization."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


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
