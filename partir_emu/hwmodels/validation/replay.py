"""Replay an MPI message trace on the DES, and check it against the schedules.

The MPI emulator (``partir-emu run --backend mpi --trace-messages FILE``) writes
every transfer it made; the file format, its writer and its reader are
:mod:`partir_emu.core.msgtrace` (a header naming each collective's prim, axes,
bytes and element size, then one JSON line per transfer).

- :func:`check_trace` rebuilds, for every collective of the header, the schedule
  the MPI executor runs (``build_schedule(prim, axis sizes, bytes, algorithm,
  itemsize)`` over every group ``mesh.groups(axes)``) and compares transfer by
  transfer: counts and bytes per collective and per step must be equal. The
  element size is the header's (recorded by the writer, never guessed).
- :func:`replay` runs the recorded transfers on the modelled hardware: each
  collective's steps with the DES's per-member ``sendrecv`` dependencies, the
  collectives one after the other per device (one communication stream), every
  message routed and sharing links. No compute: the result is the communication
  time of the recorded traffic on that machine.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from partir_emu.collectives.algorithms import build_schedule
from partir_emu.core.mesh import Mesh
from partir_emu.core.msgtrace import check_header
from partir_emu.errors import ArtifactError, CollectiveError
from partir_emu.hwmodels.des.collective import CollectiveRun, Groups, build_plan
from partir_emu.hwmodels.des.model import DesOptions
from partir_emu.hwmodels.des.network.routing import FlowRouter, link_factors
from partir_emu.hwmodels.des.network.spans import FlowNetwork
from partir_emu.hwmodels.machine.placement import Placement, place
from partir_emu.hwmodels.machine.specs import HardwareSpec, load_spec
from partir_emu.hwmodels.network.comm import CommModel


# -- what the schedules predict ------------------------------------------------------------------------
def expected_rows(head: Mapping[str, Any], coll: int, itemsize: int | None = None) -> np.ndarray:
    """The transfers the MPI executor makes for collective ``coll`` of the header (with the
    header's element size unless ``itemsize`` is given)."""
    mesh = Mesh.from_json(head["mesh"])
    c = head["collectives"][str(coll)]
    axes = tuple(c["axes"])
    shape = tuple(mesh.axis_size(a) for a in axes)
    if int(np.prod(shape)) == 1 or int(c["bytes"]) == 0:
        return np.zeros((0, 5), dtype=np.int64)
    try:
        sched = build_schedule(c["prim"], shape, int(c["bytes"]), head["algorithm"],
                               itemsize=int(c["itemsize"]) if itemsize is None else itemsize,
                               devices_per_node=head.get("devices_per_node"), permutation=_pairs(c))
    except CollectiveError as exc:
        raise ArtifactError(f"message trace: collective {coll} of the header ({c['prim']} over {list(axes)}, "
                            f"{c['bytes']} B) has no schedule: {exc}") from None
    out = []
    for g in mesh.groups(axes):
        for s, step in enumerate(sched.steps):
            out += [(coll, s, g[t.src], g[t.dst], t.nbytes) for t in step.transfers]
    return np.array(out, dtype=np.int64).reshape(-1, 5)


def least_transfers(head: Mapping[str, Any], coll: int) -> int:
    """A lower bound on the transfers collective ``coll`` of the header makes, known without its
    schedule: every member of every group receives at least one message (the others' data reach it
    somehow) — for collective_permute, each pair that moves. A trace with fewer is not a trace of
    it; a 255-byte file claiming an all-reduce over 4,096 devices must not cost a 33-million-row
    schedule to say so."""
    mesh = Mesh.from_json(head["mesh"])
    c = head["collectives"][str(coll)]
    p = int(np.prod([mesh.axis_size(a) for a in c["axes"]]))
    if p == 1 or int(c["bytes"]) == 0:
        return 0
    groups = mesh.size // p
    if c["prim"] == "collective_permute":
        return groups * sum(1 for a, b in (_pairs(c) or ()) if a != b)
    return groups * p


def _pairs(c: Mapping[str, Any]) -> tuple[tuple[int, int], ...] | None:
    """A header entry's collective_permute pairs (None for the other collectives)."""
    pairs = c.get("pairs")
    if c.get("prim") != "collective_permute":
        return None
    if not isinstance(pairs, list):
        raise ArtifactError(f"message trace: the collective_permute entry {dict(c)!r} of the header has no \"pairs\"; "
                            "re-record the trace with this version")
    return tuple((int(a), int(b)) for a, b in pairs)


@dataclass(frozen=True)
class CollCheck:
    coll: int
    prim: str
    axes: tuple[str, ...]
    itemsize: int
    expected_transfers: int
    traced_transfers: int
    expected_bytes: int
    traced_bytes: int
    equal: bool                  # the same multiset of (step, src, dst, bytes)
    first_difference: str = ""

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["axes"] = list(self.axes)
        return d


@dataclass(frozen=True)
class TraceCheck:
    algorithm: str
    collectives: tuple[CollCheck, ...]
    note: str = ""

    @property
    def ok(self) -> bool:
        return all(c.equal for c in self.collectives)

    @property
    def transfers(self) -> tuple[int, int]:
        return (sum(c.expected_transfers for c in self.collectives), sum(c.traced_transfers for c in self.collectives))

    @property
    def bytes(self) -> tuple[int, int]:
        return (sum(c.expected_bytes for c in self.collectives), sum(c.traced_bytes for c in self.collectives))

    def to_json(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "ok": self.ok, "note": self.note,
                "expected_transfers": self.transfers[0], "traced_transfers": self.transfers[1],
                "expected_bytes": self.bytes[0], "traced_bytes": self.bytes[1],
                "collectives": [c.to_json() for c in self.collectives]}


def check_trace(head: Mapping[str, Any], rows: np.ndarray) -> TraceCheck:
    """Compare the traced transfers with what the schedules predict, collective by collective."""
    check_header(head, "the message-trace header")
    algorithm = head["algorithm"]
    if algorithm == "native":
        return TraceCheck(algorithm, (), "native MPI collectives move data inside the library: no transfers "
                                         "are traced, nothing to compare")
    by_coll: dict[int, np.ndarray] = {}
    if len(rows):
        order = np.argsort(rows[:, 0], kind="stable")
        srt = rows[order]
        cut = np.flatnonzero(np.diff(srt[:, 0])) + 1
        for part in np.split(srt, cut):
            by_coll[int(part[0, 0])] = part
    checks = []
    colls = sorted(int(k) for k in head["collectives"])
    for extra in sorted(set(by_coll) - set(colls)):
        part = by_coll[extra]
        checks.append(CollCheck(extra, "?", (), 0, 0, len(part), 0, int(part[:, 4].sum()), False,
                                f"collective {extra} is not in the header"))
    for coll in colls:
        c = head["collectives"][str(coll)]
        got = by_coll.get(coll, np.zeros((0, 5), dtype=np.int64))
        got_key = Counter(map(tuple, got[:, 1:].tolist()))
        isz = int(c["itemsize"])
        need = least_transfers(head, coll)
        if len(got) < need:          # before its schedule is built: that costs what the header claims
            raise ArtifactError(f"message trace: collective {coll} of the header ({c['prim']} over {list(c['axes'])}, "
                                f"{c['bytes']} B) needs at least {need} transfers, the trace has {len(got)}: it is "
                                f"truncated or was not written by `partir-emu run --trace-messages`")
        exp = expected_rows(head, coll, isz)
        exp_key = Counter(map(tuple, exp[:, 1:].tolist()))
        equal = exp_key == got_key
        diff = ""
        if not equal:
            missing = exp_key - got_key
            unexpected = got_key - exp_key
            if missing:
                s, a, b, n = next(iter(missing))
                diff = f"step {s}: {a}->{b} {n} B expected, not traced"
            elif unexpected:
                s, a, b, n = next(iter(unexpected))
                diff = f"step {s}: {a}->{b} {n} B traced, not expected"
        checks.append(CollCheck(coll, c["prim"], tuple(c["axes"]), isz, len(exp), len(got), int(exp[:, 4].sum()),
                                int(got[:, 4].sum()), equal, diff))
    return TraceCheck(algorithm, tuple(checks))


# -- replaying the traffic on the DES ------------------------------------------------------------------
@dataclass(frozen=True)
class ReplayReport:
    spec: str
    topology: str
    placement: str
    algorithm: str
    comm_s: float                         # all devices done with the last collective
    analytical_comm_s: float              # sum of the analytical prices (same algorithm) of the same collectives
    collectives: tuple[dict[str, Any], ...]
    check: TraceCheck
    messages: int
    events: int
    wall_s: float
    top_links: tuple[dict[str, Any], ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {"spec": self.spec, "topology": self.topology, "placement": self.placement,
                "algorithm": self.algorithm, "comm_s": self.comm_s, "analytical_comm_s": self.analytical_comm_s,
                "messages": self.messages, "events": self.events, "wall_s": self.wall_s,
                "check": self.check.to_json(), "collectives": list(self.collectives),
                "top_links": list(self.top_links)}

    def table(self) -> str:
        et, tt = self.check.transfers
        eb, tb = self.check.bytes
        lines = [f"replay on {self.spec} | {self.topology}", f"placement: {self.placement}",
                 f"algorithm {self.algorithm}: {len(self.collectives)} collectives, {self.messages} messages",
                 f"transfers: traced {tt}, schedules predict {et};  bytes: traced {tb}, schedules predict {eb}"
                 f"  -> {'EQUAL' if self.check.ok else 'DIFFERENT'}"]
        if self.check.note:
            lines.append(self.check.note)
        for c in self.check.collectives:
            if not c.equal:
                lines.append(f"  coll {c.coll} {c.prim}({','.join(c.axes)}): traced {c.traced_transfers} transfers "
                             f"/ {c.traced_bytes} B, expected {c.expected_transfers} / {c.expected_bytes} B; "
                             f"{c.first_difference}")
        lines.append(f"replayed communication time {self.comm_s * 1e3:.4f} ms "
                     f"(analytical price of the same collectives {self.analytical_comm_s * 1e3:.4f} ms); "
                     f"{self.events} events in {self.wall_s:.2f} s")
        return "\n".join(lines)

    __str__ = table


class _Replay:
    """The :class:`~partir_emu.hwmodels.des.protocols.CollectiveHost` of a replay: the collectives run one after the other
    on each device (when collective ``ci`` finishes on a device, ``ci + 1`` starts there)."""

    def __init__(self, env: simpy.Environment, network: FlowNetwork, options: DesOptions, num_devices: int) -> None:
        self.env = env
        self.network = network
        self.message_overhead_s = options.message_overhead_s
        self.runs: list[CollectiveRun] = []
        self.end = np.zeros(num_devices)

    def collective_done(self, ci: int, devices: np.ndarray, t: float, complete: bool) -> None:
        nxt = ci + 1
        if nxt < len(self.runs):
            self.runs[nxt].start(devices, t)
        else:
            self.end[devices] = t


def replay(head: Mapping[str, Any], rows: np.ndarray, spec: HardwareSpec | str,
           placement: Placement | str | Mapping | None = None, slice_dims: tuple[int, ...] | None = None,
           options: DesOptions | None = None) -> ReplayReport:
    """Run the traced transfers on ``spec`` hardware (see the module docstring)."""
    t0 = time.perf_counter()
    spec = load_spec(spec)
    options = options or DesOptions()
    mesh = Mesh.from_json(head["mesh"])
    if not isinstance(placement, Placement):
        placement = place(mesh, spec, placement, slice_dims)
    n = mesh.size
    if len(rows) and (rows[:, 2:4].min() < 0 or rows[:, 2:4].max() >= n):
        raise ArtifactError(f"the trace names device {int(rows[:, 2:4].max())}, but its mesh {mesh} has {n} devices")
    check = check_trace(head, rows)
    env = simpy.Environment()
    factors = link_factors(placement.topology, options.degraded_links, options.failed_links)
    router = FlowRouter(placement.topology, factors)
    network = FlowNetwork(env, router)
    sim = _Replay(env, network, options, n)
    chips = np.array([placement.chip_of(d) for d in range(n)], dtype=np.int64)
    groups = Groups(("replay",), np.arange(n, dtype=np.int64)[None, :], chips[None, :], np.arange(n, dtype=np.int64))
    colls = sorted(set(rows[:, 0].tolist())) if len(rows) else []
    # the analytical figure is priced with the same faults the replay runs on
    model = CommModel(placement, None if head["algorithm"] == "native" else head["algorithm"], link_factors=factors)
    ana = 0.0
    messages = 0
    for ci, coll in enumerate(colls):
        part = rows[rows[:, 0] == coll]
        plans = []
        for s in sorted(set(part[:, 1].tolist())):
            st = part[part[:, 1] == s]
            pairs: dict[tuple[int, int], int] = {}
            for a, b, nb in st[:, 2:5].tolist():
                pairs[(a, b)] = pairs.get((a, b), 0) + nb
            ms = np.array([k[0] for k in pairs], dtype=np.int64)
            md = np.array([k[1] for k in pairs], dtype=np.int64)
            mb = np.array(list(pairs.values()), dtype=np.float64)
            messages += len(pairs)
            plans.append(build_plan(ms, md, mb, 1, n, chips, router))
        meta = head["collectives"].get(str(coll), {"prim": "?", "axes": [], "bytes": 0})
        sim.runs.append(CollectiveRun(sim, ci, coll, meta["prim"], tuple(meta["axes"]), int(meta["bytes"]),
                                      head["algorithm"], groups, plans))
        if meta["prim"] != "?" and head["algorithm"] != "native":
            perm = (("pairs", _pairs(meta)),) if meta["prim"] == "collective_permute" else None
            ana += model.cost(meta["prim"], tuple(meta["axes"]), int(meta["bytes"]), perm=perm).time_s
    if sim.runs:
        sim.runs[0].start(np.arange(n, dtype=np.int64), 0.0)
    events = 0
    try:
        while True:
            env.step()
            events += 1
    except simpy.core.EmptySchedule:
        pass
    rows_out = tuple({"coll": r.index, "prim": r.prim, "axes": list(r.axes), "steps": r.num_steps,
                      "start_s": float(np.nanmin(r.t_start)), "end_s": float(np.nanmax(r.t_end)),
                      "max_link_flows": r.max_flows} for r in sim.runs)
    topo = placement.topology
    order = np.argsort(-network.link_bytes, kind="stable")[:10]
    top = tuple({"link": str(topo.links[i]), "bytes": float(network.link_bytes[i])}
                for i in order if network.link_bytes[i] > 0)
    return ReplayReport(spec.name, topo.describe(), placement.describe(), head["algorithm"],
                        float(sim.end.max()) if n else 0.0, ana, rows_out, check, messages, events,
                        time.perf_counter() - t0, top)
