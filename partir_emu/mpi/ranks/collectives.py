"""Run collective schedules over MPI with real data, and the native MPI collectives.

:class:`MpiCollectives` is the executor of one communicator. A rank hosts one
or more emulated devices. :meth:`~MpiCollectives.run_schedules` performs
exactly the transfers of :class:`CollectiveSchedule` s, step by step: a
transfer between two devices on the same rank is a copy, any other is part of
one MPI message per ``(step, source rank, destination rank)`` (bytes,
buffer-based ``Isend``/``Irecv``, never pickled). Values are applied in
schedule order with the same plan (:class:`~partir_emu.collectives.planner.Plan`)
as the in-process executor (:mod:`partir_emu.collectives.local`), so both give
bit-identical results.

:meth:`~MpiCollectives.run_native` calls the MPI library's own collectives on a
sub-communicator of the ranks hosting the group (:mod:`.mpi_native`; faster,
results equal up to rounding, not bit for bit).

The steps themselves run in :mod:`.mpi_steps` (each step's receives posted while
the step before is in flight; persistent requests when a plan re-runs with the
same buffers and tags). The executor owns what it keeps between calls: plans
with their step runners, work and scratch buffers (MPICH moves large messages
faster between buffers whose addresses it has seen before), and
sub-communicators; :meth:`~MpiCollectives.free` releases them. Waiting never
spins in a blocking MPI call (:mod:`.mpi_wait`). Participants
that disagree on the collective (kind, size, dtype, algorithm, group) raise
:class:`CollectiveError` after a header exchange instead of hanging.
"""
from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from mpi4py import MPI

from partir_emu.collectives.algorithms import build_schedule
from partir_emu.collectives.local import check_buffer
from partir_emu.collectives.planner import Plan, StepPlan
from partir_emu.collectives.schedule import KINDS, CollectiveSchedule
from partir_emu.collectives.semantics import REDUCE_OPS, reduce_fn, reference
from partir_emu.errors import CollectiveError
from partir_emu.mpi.ranks.native import MAGIC, SubcommCache, check_header, native, native_layout
from partir_emu.mpi.ranks.steps import StepRunner
from partir_emu.mpi.ranks.wait import DEFAULT_TIMEOUT_S, wait

Job = tuple[CollectiveSchedule, Sequence[int], Mapping[int, np.ndarray]]   # (schedule, group devices, local inputs)
_BYTE = MPI.BYTE


class MpiCollectives:
    """The collective executor on ``comm`` (see the module docstring). Keeps the plans of the last
    ``max_plans`` sets of jobs; :meth:`free` drops everything it keeps."""

    def __init__(self, comm: MPI.Intracomm, max_plans: int = 32) -> None:
        self.comm = comm
        self.tag_ub = int(comm.Get_attr(MPI.TAG_UB) or 32767)
        self.max_plans = max_plans
        self.subcomms = SubcommCache(comm)
        self._plans: OrderedDict[tuple, tuple[Plan, StepRunner]] = OrderedDict()
        self._scratch: dict[object, np.ndarray] = {}

    def free(self) -> None:
        """Free the sub-communicators and drop the kept plans and buffers."""
        self.subcomms.free()
        for _, runner in self._plans.values():
            runner.free()
        self._plans.clear()
        self._scratch.clear()

    def scratch(self, key: object, nbytes: int) -> np.ndarray:
        """``nbytes`` of a byte buffer kept for ``key`` (grown when too small), so that MPI sees the
        same addresses from one call to the next."""
        buf = self._scratch.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = self._scratch[key] = np.empty(max(nbytes, 64), np.uint8)
        return buf[:nbytes]

    # ------------------------------------------------------------------ schedules
    def run_schedule(self, schedule: CollectiveSchedule, group_devices: Sequence[int],
                     rank_of_device: Callable[[int], int], local: Mapping[int, np.ndarray], op: str = "sum",
                     tag_base: int = 0, trace: list | None = None, *, check: bool = True,
                     timeout_s: float | None = DEFAULT_TIMEOUT_S) -> dict[int, np.ndarray]:
        """Execute ``schedule`` for one group; return this rank's outputs.

        ``group_devices[pos]`` is the device at group position ``pos``; ``rank_of_device(dev)`` the
        rank of ``comm`` hosting it; ``local`` maps each position hosted by this rank to its flat
        input. Uses tags ``tag_base .. tag_base + num_steps``. ``trace``, if given, receives
        ``(step, src_device, dst_device, nbytes)`` for each transfer this rank sends (copies included).
        """
        return self.run_schedules([(schedule, group_devices, local)], rank_of_device, op, tag_base, trace,
                                  check=check, timeout_s=timeout_s)[0]

    def run_schedules(self, jobs: Sequence[Job], rank_of_device: Callable[[int], int], op: str = "sum",
                      tag_base: int = 0, trace: list | None = None, *, check: bool = True,
                      timeout_s: float | None = DEFAULT_TIMEOUT_S,
                      on_step: Callable[[int], None] | None = None) -> list[dict[int, np.ndarray]]:
        """Run several groups' schedules at once, step by step: one call per rank for every group
        of one collective that its devices belong to (e.g. all rows of a mesh axis).

        ``jobs`` is a list of ``(schedule, group_devices, local)``; results come back in the same
        order. Ranks may list shared jobs in any order: they are put in a canonical order (by
        device list) before any message is posted. Receives are posted before sends. ``trace``
        collects ``(step, src, dst, nbytes)`` of what this rank sends; ``on_step(s)`` is called
        before step ``s`` runs (the fault hook of :mod:`partir_emu.mpi.faults`).
        """
        fn = reduce_fn(op)
        comm, me = self.comm, self.comm.Get_rank()
        order = sorted(range(len(jobs)), key=lambda j: tuple(jobs[j][1]))
        prepared = [_prepare(jobs[j], rank_of_device, me, comm.Get_size()) for j in order]
        plan, runner = self._plan_for(prepared, me)
        if check:
            _exchange_headers(comm, prepared, plan, op, tag_base % (self.tag_ub + 1), timeout_s)
        # When every output is one range of the work buffer (all_reduce, all_gather, all_to_all, ...) the
        # work buffer is fresh and the outputs are views of it. Otherwise the outputs are copied out anyway
        # and the work buffer is one kept between calls, like the scratch buffers: MPICH moves large
        # messages faster between buffers whose addresses it has seen before (measured: a kept buffer plus
        # a copy of the output is still slower than a fresh buffer and no copy).
        works = [space.start(pj.local, pj.dtype, None if space.views else
                             self.scratch(("work", j), space.size * pj.dtype.itemsize).view(pj.dtype))
                 for j, (space, pj) in enumerate(zip(plan.spaces, prepared))]
        before_step = None
        if trace is not None or on_step is not None:
            devices = [pj.devices for pj in prepared]

            def before_step(sp: StepPlan) -> None:
                if on_step is not None:
                    on_step(sp.step)
                if trace is not None:
                    trace.extend(plan.trace_rows(sp, devices))
        runner.run(comm, works, [space.views for space in plan.spaces],
                   (self.scratch("recv0", plan.rbytes), self.scratch("recv1", plan.rbytes)),
                   self.scratch("send", plan.sbytes), fn, tag_base, self.tag_ub + 1, timeout_s,
                   lambda sp: _step_what(sp, prepared), before_step)
        results: list[dict[int, np.ndarray]] = [{} for _ in jobs]
        for j, pj, space, work in zip(order, prepared, plan.spaces, works):
            results[j] = {pos: space.output(work, pos, pj.dtype, view_ok=space.views) for pos in pj.hosted}
        return results

    def _plan_for(self, prepared: list[_Prepared], me: int) -> tuple[Plan, StepRunner]:
        """The kept plan of these jobs on this rank (by schedules and placement), with its step runner."""
        key = (me, tuple((pj.sched, tuple(pj.devices), tuple(pj.ranks)) for pj in prepared))
        hit = self._plans.get(key)
        if hit is not None:
            self._plans.move_to_end(key)
            return hit
        plan = Plan([(pj.sched, np.asarray(pj.ranks, np.int64), pj.hosted) for pj in prepared], me)
        hit = self._plans[key] = (plan, StepRunner(plan, [pj.sched.itemsize for pj in prepared]))
        while len(self._plans) > self.max_plans:
            self._plans.popitem(last=False)[1][1].free()
        return hit

    # ------------------------------------------------------------------ native
    def run_native(self, kind: str, group_devices: Sequence[int], rank_of_device: Callable[[int], int],
                   local: Mapping[int, np.ndarray], op: str = "sum", *,
                   permutation: Sequence[tuple[int, int]] | None = None, tag_base: int = 0, check: bool = True,
                   timeout_s: float | None = DEFAULT_TIMEOUT_S) -> dict[int, np.ndarray]:
        """``kind`` over a group with the MPI library's own collective (:mod:`.mpi_native`); return
        this rank's outputs. Any placement works. collective_permute has no native collective: it
        runs a direct schedule with :meth:`run_schedule`. Compare with ``allclose``."""
        if kind not in KINDS:
            raise CollectiveError(f"unknown collective kind {kind!r}; use one of {KINDS}")
        reduce_fn(op)
        me, p = self.comm.Get_rank(), len(group_devices)
        mine, ranks, hosted, regular = native_layout(tuple(map(rank_of_device, group_devices)), me)
        if tuple(sorted(local)) != mine:
            raise CollectiveError(f"rank {me}: local buffers for positions {sorted(local)} but it hosts positions "
                                  f"{list(mine)} of group {list(group_devices)}")
        if not mine:
            return {}
        bufs = _same_flat_inputs(kind, local, mine)
        if kind == "collective_permute":
            sched = build_schedule(kind, (p,), bufs[0].nbytes, itemsize=bufs[0].dtype.itemsize,
                                   permutation=tuple(permutation) if permutation is not None else None)
            return self.run_schedule(sched, group_devices, rank_of_device, dict(zip(mine, bufs)), op, tag_base,
                                     check=check, timeout_s=timeout_s)
        dtype, size = bufs[0].dtype, bufs[0].size
        if kind in ("reduce_scatter", "all_to_all") and size % p:
            raise CollectiveError(f"{kind} of {size} elements over {p} members: size must divide by the group size")
        if len(ranks) == 1:
            return dict(zip(mine, reference(kind, bufs, op)))
        sub = self.subcomms.get(ranks)
        if check:
            check_header(sub, kind, op, size, dtype, list(group_devices), ranks, timeout_s)
        try:
            return native(kind, sub, op, bufs, mine, hosted, p, timeout_s, regular, self.scratch)
        except MPI.Exception as e:
            raise CollectiveError(f"native {kind} of {dtype} over ranks {ranks} failed in MPI: {e}; the MPI library "
                                  "may not support this dtype/op, use run_schedule instead") from e


def _same_flat_inputs(kind: str, local: Mapping[int, np.ndarray], mine: Sequence[int]) -> list[np.ndarray]:
    """The hosted members' inputs, contiguous; CollectiveError unless all are flat, of one dtype and size."""
    bufs = [np.ascontiguousarray(local[pos]) for pos in mine]
    dtype, size = bufs[0].dtype, bufs[0].size
    for pos, b in zip(mine, bufs):
        if b.ndim != 1 or b.dtype != dtype or b.size != size:
            raise CollectiveError(f"{kind}: member {pos} input {b.dtype}{list(b.shape)} differs from member "
                                  f"{mine[0]}'s {dtype}[{size}]; give every member a flat array of one dtype and size")
    return bufs


class _Prepared:
    """One job: its schedule, devices, ranks, dtype and this rank's checked inputs."""

    def __init__(self, sched: CollectiveSchedule, devices: list[int], ranks: list[int], dtype: np.dtype,
                 local: dict[int, np.ndarray]):
        self.sched, self.devices, self.ranks, self.dtype, self.local = sched, devices, ranks, dtype, local
        self.hosted = sorted(local)


def _prepare(job: Job, rank_of_device: Callable[[int], int], me: int, nranks: int) -> _Prepared:
    sched, devices, local = job
    devices = [int(d) for d in devices]
    if len(devices) != sched.p or len(set(devices)) != len(devices):
        raise CollectiveError(f"{sched.describe()}: group_devices {devices} must list {sched.p} distinct devices")
    ranks = [int(rank_of_device(d)) for d in devices]
    if any(not 0 <= r < nranks for r in ranks):
        raise CollectiveError(f"rank_of_device maps group {devices} to ranks {ranks}, outside 0..{nranks - 1}")
    hosted = [pos for pos in range(sched.p) if ranks[pos] == me]
    if sorted(local) != hosted:
        raise CollectiveError(f"{sched.describe()}: rank {me} hosts positions {hosted} of group {devices} but got "
                              f"buffers for positions {sorted(local)}; pass exactly the local members")
    dtype = None
    bufs = {}
    for pos in hosted:
        buf = check_buffer(sched, pos, local[pos], dtype)
        dtype = buf.dtype
        bufs[pos] = buf
    if dtype is None:
        dtype = np.dtype(np.uint8) if sched.itemsize == 1 else np.dtype(f"V{sched.itemsize}")
    return _Prepared(sched, devices, ranks, dtype, bufs)


def _header(pj: _Prepared, op: str) -> np.ndarray:
    s = pj.sched
    fingerprint = zlib.crc32(repr((s.kind, s.algorithm, s.group_shape, s.nbytes, s.num_chunks, len(s.steps),
                                   pj.devices)).encode())
    return np.array([MAGIC, KINDS.index(s.kind), s.nbytes, pj.dtype.num, s.itemsize, len(s.steps),
                     list(REDUCE_OPS).index(op), fingerprint], np.int64)


_HEADER_FIELDS = ("magic", "kind", "nbytes", "dtype", "itemsize", "num_steps", "op", "fingerprint")


def _exchange_headers(comm: MPI.Comm, prepared: list[_Prepared], plan: Plan, op: str, tag: int,
                      timeout_s: float | None) -> None:
    """Send each peer a header per shared job; compare what comes back."""
    outs: dict[int, list[np.ndarray]] = {}
    mine: dict[int, list[np.ndarray]] = {}
    for pj, peers_out, peers_in in zip(prepared, plan.peers_out, plan.peers_in):
        h = _header(pj, op)
        for r in peers_out:
            outs.setdefault(r, []).append(h)
        for r in peers_in:
            mine.setdefault(r, []).append(h)
    send_bufs = {r: np.concatenate(hs) for r, hs in outs.items()}
    recv_bufs = {r: np.empty(sum(h.size for h in hs), np.int64) for r, hs in mine.items()}
    reqs = [comm.Irecv([b, MPI.INT64_T], source=r, tag=tag) for r, b in recv_bufs.items()]
    reqs += [comm.Isend([b, MPI.INT64_T], dest=r, tag=tag) for r, b in send_bufs.items()]
    statuses = [MPI.Status() for _ in reqs]
    wait(reqs, statuses, timeout_s, lambda: f"header exchange of {_names(prepared)} with ranks {sorted(mine)}")
    for (r, buf), st in zip(recv_bufs.items(), statuses):
        expect = np.concatenate(mine[r])
        if st.Get_count(MPI.BYTE) != buf.nbytes or not np.array_equal(buf, expect):
            diff = [f"{name}: rank {comm.Get_rank()} has {a}, rank {r} has {b}"
                    for name, a, b in zip(_HEADER_FIELDS, expect[:8], buf[:8]) if a != b]
            raise CollectiveError(f"ranks {comm.Get_rank()} and {r} disagree on {_names(prepared)}: "
                                  f"{'; '.join(diff) or 'different collectives or groups'}; make every rank "
                                  "issue the same collective with the same size, dtype and group")


def _step_what(sp: StepPlan, prepared: list[_Prepared]) -> str:
    return (f"step {sp.step} of {_names(prepared)} (receiving from ranks {sorted(r[0] for r in sp.recvs)}, "
            f"sending to ranks {sorted(r[0] for r in sp.sends)})")


def _names(prepared: list[_Prepared]) -> str:
    s = prepared[0].sched if prepared else None
    extra = f" (+{len(prepared) - 1} groups)" if len(prepared) > 1 else ""
    return f"{s.kind}[{s.algorithm}] over devices {prepared[0].devices}{extra}" if s else "no collective"
