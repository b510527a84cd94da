"""Run collective schedules over MPI with real data, and the native MPI collectives.

A rank hosts one or more emulated devices. :func:`run_schedule_mpi` performs
exactly the transfers of a :class:`CollectiveSchedule`: a transfer between two
devices on the same rank is a copy, any other is part of one MPI message per
``(step, source rank, destination rank)`` (bytes, buffer-based ``Isend``/``Irecv``,
never pickled). Values are applied in schedule order with the same arithmetic
as :func:`partir_emu.collectives.local.run_schedule`, so both executors give
bit-identical results.

:func:`run_native_mpi` calls the MPI library's own collectives on a
sub-communicator of the ranks hosting the group (faster; results equal up to
rounding, not bit for bit).

Waiting never spins in a blocking MPI call (MPICH busy-polls): requests are
tested, yielding the CPU in between for the first 2 ms and then sleeping, up to
``timeout_s``. Plans, work and scratch buffers are kept between calls
(:func:`release_buffers` frees them). Participants that
disagree on the collective (kind, size, dtype, algorithm, group) raise
:class:`CollectiveError` after a header exchange instead of hanging.
"""
from __future__ import annotations

import functools
import os
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
from mpi4py import MPI

from partir_emu.collectives.algorithms import build_schedule
from partir_emu.collectives.local import REDUCE_OPS, Plan, check_buffer, reduce_fn
from partir_emu.collectives.schedule import KINDS, CollectiveSchedule
from partir_emu.errors import CollectiveError

_MAGIC = 0x50434F4C  # "PCOL"
_POLL_S = 0.0002   # sleep between tests once a wait is long
_SPIN_S = 0.002    # before that, test and yield the CPU (MPICH progresses requests only inside a test)
DEFAULT_TIMEOUT_S = 300.0

Job = tuple[CollectiveSchedule, Sequence[int], Mapping[int, np.ndarray]]


def run_schedule_mpi(schedule: CollectiveSchedule, comm: MPI.Comm, group_devices: Sequence[int],
                     rank_of_device: Callable[[int], int], local: Mapping[int, np.ndarray], op: str = "sum",
                     tag_base: int = 0, trace: list | None = None, *, check: bool = True,
                     timeout_s: float | None = DEFAULT_TIMEOUT_S) -> dict[int, np.ndarray]:
    """Execute ``schedule`` for one group over ``comm``; return this rank's outputs.

    ``group_devices[pos]`` is the device at group position ``pos``;
    ``rank_of_device(dev)`` the rank of ``comm`` hosting it; ``local`` maps each
    position hosted by this rank to its flat input. Uses tags ``tag_base ..
    tag_base + num_steps``. ``trace``, if given, receives ``(step, src_device,
    dst_device, nbytes)`` for each transfer this rank sends (copies included).
    """
    return run_schedules_mpi(comm, [(schedule, group_devices, local)], rank_of_device, op, tag_base, trace,
                             check=check, timeout_s=timeout_s)[0]


def run_schedules_mpi(comm: MPI.Comm, jobs: Sequence[Job], rank_of_device: Callable[[int], int], op: str = "sum",
                      tag_base: int = 0, trace: list | None = None, *, check: bool = True,
                      timeout_s: float | None = DEFAULT_TIMEOUT_S) -> list[dict[int, np.ndarray]]:
    """Run several groups' schedules at once, step by step: one call per rank for every group
    of one collective that its devices belong to (e.g. all rows of a mesh axis).

    ``jobs`` is a list of ``(schedule, group_devices, local)``; results come back
    in the same order. Ranks may list shared jobs in any order: they are put in
    a canonical order (by device list) before any message is posted.

    Each step is planned once per (schedules, placement) and cached (see
    :class:`partir_emu.collectives.local.Plan`): per peer rank one message, sent straight
    from the work buffer when it is one range and received straight into it when nothing
    else in the step touches that range; whole runs of chunks are copied or reduced per
    numpy call. Receives are posted before sends.
    """
    fn = reduce_fn(op)
    me = comm.Get_rank()
    order = sorted(range(len(jobs)), key=lambda j: tuple(jobs[j][1]))
    prepared = [_prepare(jobs[j], rank_of_device, me, comm.Get_size()) for j in order]
    plan = _plan_for(prepared, me)
    tag_ub = _TAG_UB.get(comm.py2f())
    if tag_ub is None:
        tag_ub = _TAG_UB[comm.py2f()] = int(comm.Get_attr(MPI.TAG_UB) or 32767)
    if check:
        _exchange_headers(comm, prepared, plan, op, tag_base % (tag_ub + 1), timeout_s)
    # When every output is one range of the work buffer (all_reduce, all_gather, all_to_all, ...) the
    # work buffer is fresh and the outputs are views of it. Otherwise the outputs are copied out anyway
    # and the work buffer is one kept between calls, like the scratch buffers: MPICH moves large
    # messages faster between buffers whose addresses it has seen before (measured: a kept buffer plus
    # a copy of the output is still slower than a fresh buffer and no copy).
    views = [space.outputs_are_views() for space in plan.spaces]
    works = [space.start(pj.local, pj.dtype, None if view else
                         _scratch(("work", j), space.size * pj.dtype.itemsize).view(pj.dtype))
             for j, (space, pj, view) in enumerate(zip(plan.spaces, prepared, views))]
    wbytes = [w.view(np.uint8) for w in works]
    rbuf = _scratch("recv", plan.rbytes)
    sbuf = _scratch("send", plan.sbytes)
    devices = [pj.devices for pj in prepared]
    for sp in plan.steps:
        s = sp.step
        tag = (tag_base + 1 + s) % (tag_ub + 1)
        if trace is not None:
            for row in plan.trace_rows(sp, devices):
                trace.append(row)
        reqs = [comm.Irecv([rbuf[off:off + nb] if j < 0 else wbytes[j][off:off + nb], _BYTE], source=peer, tag=tag)
                for peer, nb, j, off in sp.recvs]
        if sp.packs:
            sp.pack(works, sbuf)
        reqs += [comm.Isend([sbuf[off:off + nb] if j < 0 else wbytes[j][off:off + nb], _BYTE], dest=peer, tag=tag)
                 for peer, nb, j, off in sp.sends]
        if sp.gathers:
            sp.gather_local(works, rbuf)
        if reqs:
            statuses = sp.statuses
            if statuses is None:
                statuses = sp.statuses = [MPI.Status() for _ in reqs]
            _wait(reqs, statuses, timeout_s, functools.partial(_step_what, s, prepared, sp))
            for (peer, nb, _, _), st in zip(sp.recvs, statuses):
                if st.Get_count(_BYTE) != nb:
                    raise CollectiveError(f"step {s} of {_names(prepared)}: rank {peer} sent {st.Get_count(_BYTE)} "
                                          f"bytes, expected {nb}; the ranks disagree on the collective")
        if sp.applies:
            sp.apply(works, rbuf, fn)
    results: list[dict[int, np.ndarray]] = [{} for _ in jobs]
    for j, pj, space, work, view in zip(order, prepared, plan.spaces, works, views):
        results[j] = {pos: space.output(work, pos, pj.dtype, view_ok=view) for pos in pj.hosted}
    return results


_BYTE = MPI.BYTE
_SCRATCH: dict[object, np.ndarray] = {}
_TAG_UB: dict[int, int] = {}


def _scratch(key: object, nbytes: int) -> np.ndarray:
    """``nbytes`` of a buffer kept for ``key`` (grown when too small), so that MPI sees the same
    addresses from one call to the next. :func:`release_buffers` drops them."""
    buf = _SCRATCH.get(key)
    if buf is None or buf.nbytes < nbytes:
        buf = _SCRATCH[key] = np.empty(max(nbytes, 64), np.uint8)
    return buf[:nbytes]


def release_buffers() -> None:
    """Free the work and scratch buffers the executors keep between calls (and the cached plans)."""
    _SCRATCH.clear()
    _PLANS.clear()


def _step_what(s: int, prepared: list[_Prepared], sp) -> str:
    return (f"step {s} of {_names(prepared)} (receiving from ranks {sorted(r[0] for r in sp.recvs)}, "
            f"sending to ranks {sorted(r[0] for r in sp.sends)})")


_PLANS: OrderedDict = OrderedDict()
_PLANS_MAX = 32


def _plan_for(prepared: list[_Prepared], me: int) -> Plan:
    """The cached plan of these jobs on this rank (keyed by schedule identity and placement)."""
    key = (me, tuple((id(pj.sched), tuple(pj.devices), tuple(pj.ranks)) for pj in prepared))
    hit = _PLANS.get(key)
    if hit is not None:
        _PLANS.move_to_end(key)
        return hit[1]
    plan = Plan([(pj.sched, np.asarray(pj.ranks, np.int64), pj.hosted) for pj in prepared], me)
    _PLANS[key] = (tuple(pj.sched for pj in prepared), plan)  # the schedules stay alive with their ids
    while len(_PLANS) > _PLANS_MAX:
        _PLANS.popitem(last=False)
    return plan


# ------------------------------------------------------------------ native
class SubcommCache:
    """Sub-communicators of ``comm`` per set of ranks, created once (``Create_group``,
    collective over those ranks only) and ordered by ascending rank."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self._subs: dict[tuple[int, ...], MPI.Intracomm] = {}

    def get(self, ranks: Iterable[int]) -> MPI.Intracomm:
        key = tuple(sorted(set(ranks)))
        if self.comm.Get_rank() not in key:
            raise CollectiveError(f"rank {self.comm.Get_rank()} asked for a sub-communicator of ranks {key} "
                                  "that does not include it")
        sub = self._subs.get(key)
        if sub is None:
            group = self.comm.Get_group().Incl(list(key))
            sub = self.comm.Create_group(group, tag=zlib.crc32(repr(key).encode()) % 32768)
            group.Free()
            self._subs[key] = sub
        return sub

    def free(self) -> None:
        for sub in self._subs.values():
            sub.Free()
        self._subs.clear()


_MPI_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def run_native_mpi(kind: str, subcomms: SubcommCache, group_devices: Sequence[int],
                   rank_of_device: Callable[[int], int], local: Mapping[int, np.ndarray], op: str = "sum", *,
                   permutation: Sequence[tuple[int, int]] | None = None, tag_base: int = 0, check: bool = True,
                   timeout_s: float | None = DEFAULT_TIMEOUT_S) -> dict[int, np.ndarray]:
    """``kind`` over a group with the MPI library's own collective; return this rank's outputs.

    One member per rank maps straight onto ``Iallreduce`` / ``Ireduce_scatter``
    / ``Iallgatherv`` / ``Ialltoallv`` over the sub-communicator of the ranks
    hosting the group. With several members on a rank, the rank first combines
    its members locally (sums their inputs, or packs their blocks) and the
    counts/displacements route each block to its member, so any placement
    works. collective_permute has no native collective: it runs a direct
    schedule with :func:`run_schedule_mpi`. Sums are in a different order than
    the schedule executor's: compare with ``allclose``.
    """
    if kind not in KINDS:
        raise CollectiveError(f"unknown collective kind {kind!r}; use one of {KINDS}")
    reduce_fn(op)
    comm = subcomms.comm
    me, p = comm.Get_rank(), len(group_devices)
    pos_rank = tuple(map(rank_of_device, group_devices))
    layout = _native_layout(pos_rank, me)  # (positions here, ranks, positions per rank, regular?)
    mine = sorted(local)
    if mine != layout[0]:
        raise CollectiveError(f"rank {me}: local buffers for positions {mine} but it hosts positions "
                              f"{layout[0]} of group {list(group_devices)}")
    if not mine:
        return {}
    bufs = [np.ascontiguousarray(local[pos]) for pos in mine]
    dtype, size = bufs[0].dtype, bufs[0].size
    for pos, b in zip(mine, bufs):
        if b.ndim != 1 or b.dtype != dtype or b.size != size:
            raise CollectiveError(f"{kind}: member {pos} input {b.dtype}{list(b.shape)} differs from member "
                                  f"{mine[0]}'s {dtype}[{size}]; give every member a flat array of one dtype and size")
    if kind == "collective_permute":
        sched = build_schedule(kind, (p,), bufs[0].nbytes, itemsize=dtype.itemsize,
                               permutation=tuple(permutation) if permutation is not None else None)
        return run_schedule_mpi(sched, comm, group_devices, rank_of_device, dict(zip(mine, bufs)), op,
                                tag_base, check=check, timeout_s=timeout_s)
    if kind in ("reduce_scatter", "all_to_all") and size % p:
        raise CollectiveError(f"{kind} of {size} elements over {p} members: size must divide by the group size")
    _, ranks, hosted, regular = layout
    if len(ranks) == 1:
        from partir_emu.collectives.local import reference
        return dict(zip(mine, reference(kind, bufs, op)))
    sub = subcomms._subs.get(ranks) or subcomms.get(ranks)
    mdt = _mpi_dtype(dtype)
    if check:
        code = [_MAGIC, KINDS.index(kind), size, dtype.num, dtype.itemsize, list(REDUCE_OPS).index(op), p,
                zlib.crc32(np.asarray(group_devices, np.int64).tobytes())]
        hdr = np.array(code + [-x for x in code], np.int64)
        got = np.empty_like(hdr)
        _wait([sub.Iallreduce(hdr, got, MPI.MAX)], None, timeout_s, lambda: f"native {kind} header")
        if not (np.array_equal(got[:len(code)], code) and np.array_equal(-got[len(code):], code)):
            raise CollectiveError(f"native {kind} over devices {list(group_devices)}: ranks {ranks} disagree on the "
                                  f"collective (kind, size, dtype, op or group; this rank: {kind} of {size} x "
                                  f"{dtype}, op {op!r}); make every rank issue the same collective")
    try:
        return _native(kind, sub, op, bufs, mine, hosted, p, mdt, timeout_s, regular)
    except MPI.Exception as e:
        raise CollectiveError(f"native {kind} of {dtype} over ranks {ranks} failed in MPI: {e}; the MPI library may "
                              "not support this dtype/op, use run_schedule_mpi instead") from e


_LAYOUTS: OrderedDict = OrderedDict()


def _native_layout(pos_rank: tuple[int, ...], me: int) -> tuple[list[int], tuple[int, ...], list[list[int]], bool]:
    """For a group placed on ranks ``pos_rank``: the positions on rank ``me``, the ranks (ascending),
    the positions on each, and whether they are one run of equally many per rank in rank order."""
    key = (pos_rank, me)
    hit = _LAYOUTS.get(key)
    if hit is None:
        by_rank: dict[int, list[int]] = {}
        for pos, r in enumerate(pos_rank):
            by_rank.setdefault(r, []).append(pos)
        ranks = tuple(sorted(by_rank))
        hosted = [by_rank[r] for r in ranks]
        mine = by_rank.get(me, [])
        regular = all(len(h) == len(mine) for h in hosted) and \
            [pos for h in hosted for pos in h] == list(range(len(pos_rank)))
        hit = _LAYOUTS[key] = (mine, ranks, hosted, regular)
        while len(_LAYOUTS) > 256:
            _LAYOUTS.popitem(last=False)
    return hit


def _native(kind: str, sub: MPI.Intracomm, op: str, bufs: list[np.ndarray], mine: list[int],
            hosted: list[list[int]], p: int, mdt: MPI.Datatype, timeout_s: float | None,
            regular: bool | None = None) -> dict[int, np.ndarray]:
    """The MPI calls of :func:`run_native_mpi`, members of each rank combined locally.

    With one member per rank in rank order (the common case) the inputs go to MPI as they are and
    the received buffer is the output (all_reduce receives into a buffer kept between calls and
    copies out: measured faster with MPICH than receiving into a fresh buffer)."""
    fn, mpi_op, dtype, size = REDUCE_OPS[op], _MPI_OPS[op], bufs[0].dtype, bufs[0].size
    wait_what = lambda: f"native {kind} over {sub.Get_size()} ranks"
    single = len(mine) == 1
    if regular is None:
        regular = all(len(h) == len(mine) for h in hosted) and [pos for h in hosted for pos in h] == list(range(p))
    if kind == "all_reduce":
        partial = bufs[0] if single else np.ascontiguousarray(functools.reduce(fn, bufs))
        out = _scratch("native-out", partial.nbytes).view(dtype)  # measured: a kept buffer, then a copy, is faster
        _wait([sub.Iallreduce([partial, mdt], [out, mdt], mpi_op)], None, timeout_s, wait_what)
        return {pos: out.copy() for pos in mine}
    if kind == "reduce_scatter":
        b = size // p
        partial = bufs[0] if single else functools.reduce(fn, bufs)
        out = np.empty(len(mine) * b, dtype)
        if regular:  # rank r's blocks are already together, in order
            _wait([sub.Ireduce_scatter_block([partial, mdt], [out, mdt], mpi_op)], None, timeout_s, wait_what)
        else:
            partial = partial.reshape(p, b)
            send = np.ascontiguousarray(np.concatenate([partial[h] for h in hosted]).ravel())
            counts = [len(h) * b for h in hosted]
            _wait([sub.Ireduce_scatter([send, mdt], [out, mdt], counts, mpi_op)], None, timeout_s, wait_what)
        return {mine[0]: out} if single else {pos: out[i * b:(i + 1) * b].copy() for i, pos in enumerate(mine)}
    if kind == "all_gather":
        b = size
        send = bufs[0] if single else np.concatenate(bufs)
        recv = np.empty(p * b, dtype)
        if regular:  # gathered in rank order = position order
            _wait([sub.Iallgather([send, mdt], [recv, mdt])], None, timeout_s, wait_what)
            return {pos: recv.copy() if i else recv for i, pos in enumerate(mine)}
        counts = [len(h) * b for h in hosted]
        _wait([sub.Iallgatherv([send, mdt], [recv, (counts, _displs(counts)), mdt])], None, timeout_s, wait_what)
        full = np.empty((p, b), dtype)
        full[[pos for h in hosted for pos in h]] = recv.reshape(p, b)
        out = full.ravel()
        return {pos: out.copy() if i else out for i, pos in enumerate(mine)}
    # all_to_all: block j of member i goes to member j
    b = size // p
    if single and regular:  # blocks are in destination-rank order both ways
        recv = np.empty(p * b, dtype)
        _wait([sub.Ialltoall([bufs[0], mdt], [recv, mdt])], None, timeout_s, wait_what)
        return {mine[0]: recv}
    blocks = np.stack(bufs).reshape(len(mine), p, b)
    send = np.ascontiguousarray(np.concatenate([blocks[:, h, :].ravel() for h in hosted]))
    scounts = [len(mine) * len(h) * b for h in hosted]
    rcounts = scounts  # |hosted[r]| * |mine| * b either way
    recv = np.empty(sum(rcounts), dtype)
    _wait([sub.Ialltoallv([send, (scounts, _displs(scounts)), mdt], [recv, (rcounts, _displs(rcounts)), mdt])],
          None, timeout_s, wait_what)
    full = np.empty((p, len(mine), b), dtype)
    off = 0
    for h, c in zip(hosted, rcounts):
        full[h] = recv[off:off + c].reshape(len(h), len(mine), b)
        off += c
    return {pos: full[:, i, :].ravel().copy() for i, pos in enumerate(mine)}


# ----------------------------------------------------------------- helpers
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
    return np.array([_MAGIC, KINDS.index(s.kind), s.nbytes, pj.dtype.num, s.itemsize, len(s.steps),
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
    _wait(reqs, statuses, timeout_s, lambda: f"header exchange of {_names(prepared)} with ranks {sorted(mine)}")
    for (r, buf), st in zip(recv_bufs.items(), statuses):
        expect = np.concatenate(mine[r])
        if st.Get_count(MPI.BYTE) != buf.nbytes or not np.array_equal(buf, expect):
            diff = [f"{name}: rank {comm.Get_rank()} has {a}, rank {r} has {b}"
                    for name, a, b in zip(_HEADER_FIELDS, expect[:8], buf[:8]) if a != b]
            raise CollectiveError(f"ranks {comm.Get_rank()} and {r} disagree on {_names(prepared)}: "
                                  f"{'; '.join(diff) or 'different collectives or groups'}; make every rank "
                                  "issue the same collective with the same size, dtype and group")


def _wait(reqs: list[MPI.Request], statuses: list[MPI.Status] | None, timeout_s: float | None,
          what: Callable[[], str]) -> None:
    """Test ``reqs`` until all complete, never in a blocking MPI wait (MPICH busy-polls there).

    For the first ``_SPIN_S`` seconds it tests and yields the CPU in between (short waits stay
    short: MPICH progresses a request only inside a test), then tests every ``_POLL_S`` seconds
    asleep, so ranks that wait long leave the cores to those that work."""
    if not reqs:
        return
    try:
        if MPI.Request.Testall(reqs, statuses) if statuses is not None else MPI.Request.Testall(reqs):
            return
        test = (lambda: MPI.Request.Testall(reqs, statuses)) if statuses is not None else \
            (lambda: MPI.Request.Testall(reqs))
        start = time.monotonic()
        spin_end = start + _SPIN_S
        deadline = None if timeout_s is None else start + timeout_s
        while not test():
            now = time.monotonic()
            if now < spin_end:
                os.sched_yield()
                continue
            if deadline is not None and now > deadline:
                _cancel(reqs)
                raise CollectiveError(f"timed out after {timeout_s} s in {what()}: a participant is missing or "
                                      "runs a different collective; check that all ranks run the same program")
            time.sleep(_POLL_S)
    except MPI.Exception as e:
        raise CollectiveError(f"MPI failed in {what()}: {e}; the ranks probably disagree on the collective") from e


def _cancel(reqs: list[MPI.Request]) -> None:
    """Cancel what is pending and give it a moment to complete, so no request leaks into MPI_Finalize."""
    for r in reqs:
        if r != MPI.REQUEST_NULL:
            r.Cancel()
    end = time.monotonic() + 1.0
    while not MPI.Request.Testall(reqs) and time.monotonic() < end:
        time.sleep(_POLL_S)


def _as_bytes(parts: list[np.ndarray]) -> np.ndarray:
    if len(parts) == 1:
        return np.ascontiguousarray(parts[0]).view(np.uint8)
    return np.concatenate([np.ascontiguousarray(a).view(np.uint8) for a in parts])


def _displs(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


@functools.lru_cache(maxsize=64)
def _mpi_dtype(dtype: np.dtype) -> MPI.Datatype:
    """The predefined MPI datatype of ``dtype`` (reductions need a predefined one)."""
    mdt = MPI._typedict.get(dtype.char)  # mpi4py's own char -> predefined datatype table
    if mdt is None or dtype.byteorder == ">" or mdt == MPI.DATATYPE_NULL:
        raise CollectiveError(f"dtype {dtype} has no predefined MPI datatype for a native collective; use the "
                              "schedule executor (run_schedule_mpi) instead")
    return mdt


def _names(prepared: list[_Prepared]) -> str:
    s = prepared[0].sched if prepared else None
    extra = f" (+{len(prepared) - 1} groups)" if len(prepared) > 1 else ""
    return f"{s.kind}[{s.algorithm}] over devices {prepared[0].devices}{extra}" if s else "no collective"
