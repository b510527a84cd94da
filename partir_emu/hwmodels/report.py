"""What the analytical simulator reports: :class:`SimReport` (one step on one device) and its
:class:`CollectiveRow` (one executed collective: a collective in a loop body has one row per
iteration, ``at`` naming the enclosing loop equations and iterations)."""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class CollectiveRow(NamedTuple):
    """One communicating collective of the program, priced (a NamedTuple: cheap to build in bulk)."""

    # equation index. The field shadows tuple.index (allowed at runtime, the row's public name);
    # mypy reads it as overriding the method, hence the ignore
    index: int  # type: ignore[assignment]
    prim: str
    axes: tuple[str, ...]
    nbytes: int               # full buffer per device (nccl-tests "size")
    group_size: int
    algorithm: str
    time_s: float
    start_s: float = 0.0      # when it starts (with overlap: on the communication stream)
    at: tuple[int, ...] = ()  # in a loop body: (loop equation, iteration) per enclosing loop, outermost first;
                              # ``index`` is then the equation's index in the innermost body

    def to_json(self) -> dict:
        return {"index": self.index, "prim": self.prim, "axes": list(self.axes), "nbytes": self.nbytes,
                "group_size": self.group_size, "algorithm": self.algorithm, "time_s": self.time_s,
                "start_s": self.start_s, "at": list(self.at)}


@dataclass(frozen=True)
class SimReport:
    """What ``simulate`` predicts for one step on one device (all devices run the same program)."""

    spec: str
    topology: str
    placement: str
    mesh: str
    num_devices: int
    overlap: bool
    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float           # step_s - compute_s: communication not hidden behind compute
    flops_per_device: float
    hbm_traffic_bytes: float        # bytes moved to/from HBM by compute ops
    peak_bytes_per_device: int
    hbm_bytes: int                  # HBM capacity of one chip
    fits: bool
    memory: dict[str, int]          # breakdown of the peak (memory.CATEGORIES)
    peak_at: int
    by_op_kind: dict[str, dict[str, float]]
    by_prim: dict[str, dict[str, float]]
    by_collective: dict[str, dict[str, float]]
    by_axes: dict[str, dict[str, float]]
    hfu: float                      # matmul FLOPs per device (recompute included) / (step_s * bf16 peak)
    mfu: float | None               # model_flops / (step_s * bf16 peak); None when no model_flops was given
    fusion: dict[str, float]        # kernels, fused groups, hand kernels, bytes saved (fusion.FusionPlan.summary)
    collectives: Sequence[CollectiveRow] = field(repr=False)     # built when first read (pricing.CollectiveRows)
    faults: tuple[str, ...] = ()    # the faults applied: degraded/failed links, stragglers (hwmodels.links)
    comm_streams: int = 1           # collectives run at once with overlap
    stack: str = "xla"              # the software stack priced (hwmodels.compute.stack)
    needed_bytes: float = 0.0       # what the peak needs with the stack's allocator and reserved memory
    notes: tuple[str, ...] = ()     # how the pricing departs from the program (FP8 matmuls on a chip without FP8)
    program_peak_bytes: int | None = None   # the lowered program's own peak (differs under an MPMD pipeline stack)

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (
            "spec", "topology", "placement", "mesh", "num_devices", "overlap", "step_s", "compute_s", "comm_s",
            "exposed_comm_s", "flops_per_device", "hbm_traffic_bytes", "peak_bytes_per_device", "hbm_bytes",
            "fits", "memory", "peak_at", "hfu", "mfu", "fusion", "by_op_kind", "by_prim", "by_collective", "by_axes",
            "comm_streams", "program_peak_bytes")}
        d["faults"] = list(self.faults)
        d["notes"] = list(self.notes)
        d["collectives"] = [r.to_json() for r in self.collectives]
        return d

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def table(self, top: int = 10) -> str:
        """A readable summary: totals, memory, time by op kind, by collective, by axes, slowest collectives."""
        gib = 2 ** 30
        lines = [f"{self.spec} | {self.topology}",
                 f"placement: {self.placement}",
                 *([f"faults: {'; '.join(self.faults)}"] if self.faults else []),
                 *(f"note: {n}" for n in self.notes),
                 f"step {_t(self.step_s)}  = compute {_t(self.compute_s)} + comm {_t(self.comm_s)}"
                 + (f" (overlap on, {self.comm_streams} comm stream{'s' if self.comm_streams > 1 else ''}, "
                    f"exposed comm {_t(self.exposed_comm_s)})" if self.overlap else ""),
                 f"flops/device {self.flops_per_device:.3g}   HBM traffic {self.hbm_traffic_bytes / 1e9:.3g} GB",
                 f"HFU {100 * self.hfu:.1f}%   MFU " + (f"{100 * self.mfu:.1f}%" if self.mfu is not None
                                                      else "- (no model FLOPs given)"),
                 _fusion_line(self.fusion),
                 f"peak memory {self.peak_bytes_per_device / gib:.3f} GiB"
                 + (f" (needs {self.needed_bytes / gib:.3f} GiB with the {self.stack} stack's allocator and "
                    f"reserved memory)" if self.needed_bytes > self.peak_bytes_per_device else "")
                 + f" of {self.hbm_bytes / gib:.3f} GiB -> {'fits' if self.fits else 'DOES NOT FIT'}",
                 "  " + "  ".join(f"{k} {v / gib:.3f}" for k, v in self.memory.items() if v), ""]
        lines.append(f"{'op kind':<14}{'count':>7}{'time':>12}{'share':>8}{'GFLOP':>12}{'GB':>10}")
        total = self.step_s if not self.overlap else self.compute_s + self.comm_s
        for k, r in sorted(self.by_op_kind.items(), key=lambda kv: -kv[1]["time_s"]):
            lines.append(f"{k:<14}{int(r['count']):>7}{_t(r['time_s']):>12}{_pct(r['time_s'], total):>8}"
                         f"{r['flops'] / 1e9:>12.3f}{r['bytes'] / 1e9:>10.3f}")
        if self.by_collective:
            lines += ["", f"{'collective':<16}{'count':>7}{'time':>12}{'MB':>12}"]
            for k, r in sorted(self.by_collective.items(), key=lambda kv: -kv[1]["time_s"]):
                lines.append(f"{k:<16}{int(r['count']):>7}{_t(r['time_s']):>12}{r['bytes'] / 1e6:>12.3f}")
            lines += ["", f"{'axes':<16}{'count':>7}{'time':>12}{'MB':>12}"]
            for k, r in sorted(self.by_axes.items(), key=lambda kv: -kv[1]["time_s"]):
                lines.append(f"{k:<16}{int(r['count']):>7}{_t(r['time_s']):>12}{r['bytes'] / 1e6:>12.3f}")
            lines += ["", f"slowest collectives (of {len(self.collectives)} executed):",
                      f"{'eqn':>10} {'prim':<15}{'axes':<14}{'MB':>10}{'algorithm':>14}{'time':>12}"]
            for c in sorted(self.collectives, key=lambda c: -c.time_s)[:top]:
                lines.append(f"{_eqn(c):>10} {c.prim:<15}{','.join(c.axes):<14}{c.nbytes / 1e6:>10.3f}"
                             f"{c.algorithm:>14}{_t(c.time_s):>12}")
        return "\n".join(lines)

    __str__ = table


def _fusion_line(f: Mapping[str, float]) -> str:
    return (f"fusion: {int(f['kernels'])} kernels ({int(f['fused_groups'])} fused groups, "
            f"{int(f['hand_kernels'])} hand-fused), HBM bytes {f['fused_bytes'] / 1e9:.3g} GB "
            f"(unfused {f['unfused_bytes'] / 1e9:.3g} GB, saved {f['bytes_saved'] / 1e9:.3g} GB)")


def _eqn(r: CollectiveRow) -> str:
    """``index``, or in a loop body ``index@loop:iteration`` per enclosing loop (outermost first)."""
    if not r.at:
        return str(r.index)
    return f"{r.index}@" + ",".join(f"{r.at[j]}:{r.at[j + 1]}" for j in range(0, len(r.at), 2))


def _t(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.2f} us"


def _pct(x: float, total: float) -> str:
    return f"{100 * x / total:.1f}%" if total > 0 else "-"
