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
tested, with short sleeps in between, up to ``timeout_s``. Participants that
disagree on the collective (kind, size, dtype, algorithm, group) raise
:class:`CollectiveError` after a header exchange instead of hanging.
"""
from __future__ import annotations

import functools
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
from mpi4py import MPI

from partir_emu.collectives.algorithms import build_schedule
from partir_emu.collectives.local import (
    REDUCE_OPS,
    apply_transfer,
    assemble_output,
    check_buffer,
    initial_state,
    reduce_fn,
    run_chunks,
)
from partir_emu.collectives.schedule import KINDS, CollectiveSchedule
from partir_emu.errors import CollectiveError

_MAGIC = 0x50434F4C  # "PCOL"
_POLL_S = 0.0002
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
    """
    fn = reduce_fn(op)
    me = comm.Get_rank()
    order = sorted(range(len(jobs)), key=lambda j: tuple(jobs[j][1]))
    prepared = [_prepare(jobs[j], rank_of_device, me, comm.Get_size()) for j in order]
    tag_ub = int(comm.Get_attr(MPI.TAG_UB) or 32767)
    if check:
        _exchange_headers(comm, prepared, op, tag_base % (tag_ub + 1), timeout_s)
    for s in range(max((len(p.sched.steps) for p in prepared), default=0)):
        tag = (tag_base + 1 + s) % (tag_ub + 1)
        sends: dict[int, list[np.ndarray]] = {}
        recvs: dict[int, int] = {}
        local_payload: dict[tuple[int, int], list[np.ndarray]] = {}
        incoming: list[tuple[int, int, int, list[int]]] = []  # (job, transfer index, src rank, chunks)
        for ji, pj in enumerate(prepared):
            if s >= len(pj.sched.steps):
                continue
            transfers = pj.sched.steps[s].transfers
            for ti in pj.touch[s]:
                t = transfers[ti]
                src_r, dst_r = pj.ranks[t.src], pj.ranks[t.dst]
                chunks = run_chunks(pj.sched, t)
                if src_r == me:
                    payload = [pj.state[t.src][c] for c in chunks]
                    if trace is not None:
                        trace.append((s, pj.devices[t.src], pj.devices[t.dst], t.nbytes))
                    if dst_r == me:
                        local_payload[(ji, ti)] = payload
                    else:
                        sends.setdefault(dst_r, []).extend(payload)
                else:
                    incoming.append((ji, ti, src_r, chunks))
                    recvs[src_r] = recvs.get(src_r, 0) + t.nbytes
        recv_bufs = {r: np.empty(nb, np.uint8) for r, nb in recvs.items()}
        reqs = [comm.Irecv([buf, MPI.BYTE], source=r, tag=tag) for r, buf in recv_bufs.items()]
        send_bufs = [(r, _as_bytes(parts)) for r, parts in sends.items()]
        reqs += [comm.Isend([buf, MPI.BYTE], dest=r, tag=tag) for r, buf in send_bufs]
        statuses = [MPI.Status() for _ in reqs]
        _wait(reqs, statuses, timeout_s, functools.partial(
            "step {} of {} (receiving from ranks {}, sending to ranks {})".format, s, _names(prepared),
            sorted(recvs), sorted(sends)))
        for (r, buf), st in zip(recv_bufs.items(), statuses):
            if st.Get_count(MPI.BYTE) != buf.nbytes:
                raise CollectiveError(f"step {s} of {_names(prepared)}: rank {r} sent {st.Get_count(MPI.BYTE)} "
                                      f"bytes, expected {buf.nbytes}; the ranks disagree on the collective")
        offsets = dict.fromkeys(recv_bufs, 0)
        for ji, ti, r, chunks in incoming:
            pj = prepared[ji]
            vals = []
            for c in chunks:
                nb = pj.sched.chunk_bytes[c]
                vals.append(recv_bufs[r][offsets[r]:offsets[r] + nb].view(pj.dtype))
                offsets[r] += nb
            local_payload[(ji, ti)] = vals
        for ji, pj in enumerate(prepared):
            if s >= len(pj.sched.steps):
                continue
            transfers = pj.sched.steps[s].transfers
            for ti in pj.touch[s]:
                t = transfers[ti]
                payload = local_payload.get((ji, ti))
                if payload is not None:
                    apply_transfer(pj.state[t.dst], run_chunks(pj.sched, t), payload, t.reduce, fn)
    results: list[dict[int, np.ndarray]] = [{} for _ in jobs]
    for j, pj in zip(order, prepared):
        results[j] = {pos: assemble_output(pj.sched, pos, st, pj.dtype) for pos, st in pj.state.items()}
    return results


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
    pos_rank = [rank_of_device(d) for d in group_devices]
    mine = sorted(local)
    if mine != [pos for pos in range(p) if pos_rank[pos] == me]:
        raise CollectiveError(f"rank {me}: local buffers for positions {mine} but it hosts positions "
                              f"{[pos for pos in range(p) if pos_rank[pos] == me]} of group {list(group_devices)}")
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
    ranks = sorted(set(pos_rank))
    hosted = [[pos for pos in range(p) if pos_rank[pos] == r] for r in ranks]
    if len(ranks) == 1:
        from partir_emu.collectives.local import reference
        return dict(zip(mine, reference(kind, bufs, op)))
    sub = subcomms.get(ranks)
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
        return _native(kind, sub, op, bufs, mine, hosted, p, mdt, timeout_s)
    except MPI.Exception as e:
        raise CollectiveError(f"native {kind} of {dtype} over ranks {ranks} failed in MPI: {e}; the MPI library may "
                              "not support this dtype/op, use run_schedule_mpi instead") from e


def _native(kind: str, sub: MPI.Intracomm, op: str, bufs: list[np.ndarray], mine: list[int],
            hosted: list[list[int]], p: int, mdt: MPI.Datatype, timeout_s: float | None) -> dict[int, np.ndarray]:
    """The MPI calls of :func:`run_native_mpi`, members of each rank combined locally."""
    fn, mpi_op, dtype, size = REDUCE_OPS[op], _MPI_OPS[op], bufs[0].dtype, bufs[0].size
    wait_what = lambda: f"native {kind} over {sub.Get_size()} ranks"
    if kind == "all_reduce":
        partial = np.ascontiguousarray(functools.reduce(fn, bufs))
        out = np.empty_like(partial)
        _wait([sub.Iallreduce([partial, mdt], [out, mdt], mpi_op)], None, timeout_s, wait_what)
        return {pos: out.copy() for pos in mine}
    if kind == "reduce_scatter":
        b = size // p
        partial = functools.reduce(fn, bufs).reshape(p, b)
        send = np.ascontiguousarray(np.concatenate([partial[h] for h in hosted]).ravel())
        out = np.empty(len(mine) * b, dtype)
        counts = [len(h) * b for h in hosted]
        _wait([sub.Ireduce_scatter([send, mdt], [out, mdt], counts, mpi_op)], None, timeout_s, wait_what)
        return {pos: out[i * b:(i + 1) * b].copy() for i, pos in enumerate(mine)}
    if kind == "all_gather":
        b = size
        send = np.concatenate(bufs)
        counts = [len(h) * b for h in hosted]
        recv = np.empty(p * b, dtype)
        _wait([sub.Iallgatherv([send, mdt], [recv, (counts, _displs(counts)), mdt])], None, timeout_s, wait_what)
        full = np.empty((p, b), dtype)
        full[[pos for h in hosted for pos in h]] = recv.reshape(p, b)
        out = full.ravel()
        return {pos: out.copy() for pos in mine}
    # all_to_all: block j of member i goes to member j
    b = size // p
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
    """One job with its ranks, dtype and this rank's state."""

    def __init__(self, sched: CollectiveSchedule, devices: list[int], ranks: list[int], dtype: np.dtype,
                 state: dict[int, dict[int, np.ndarray]]):
        self.sched, self.devices, self.ranks, self.dtype, self.state = sched, devices, ranks, dtype, state
        self.touch = sched.touching(list(state))  # per step: transfers from or to a member of this rank
        me = ranks[next(iter(state))] if state else -1
        pairs = {(ranks[t.src], ranks[t.dst]) for step, idx in zip(sched.steps, self.touch)
                 for t in (step.transfers[i] for i in idx)}
        self.peers_out = sorted(d for s, d in pairs if s == me and d != me)
        self.peers_in = sorted(s for s, d in pairs if d == me and s != me)


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
    state = {}
    for pos in hosted:
        buf = check_buffer(sched, pos, local[pos], dtype)
        dtype = buf.dtype
        state[pos] = initial_state(sched, pos, np.ascontiguousarray(buf))
    if dtype is None:
        dtype = np.dtype(np.uint8) if sched.itemsize == 1 else np.dtype(f"V{sched.itemsize}")
    return _Prepared(sched, devices, ranks, dtype, state)


def _header(pj: _Prepared, op: str) -> np.ndarray:
    s = pj.sched
    fingerprint = zlib.crc32(repr((s.kind, s.algorithm, s.group_shape, s.nbytes, s.num_chunks, len(s.steps),
                                   pj.devices)).encode())
    return np.array([_MAGIC, KINDS.index(s.kind), s.nbytes, pj.dtype.num, s.itemsize, len(s.steps),
                     list(REDUCE_OPS).index(op), fingerprint], np.int64)


_HEADER_FIELDS = ("magic", "kind", "nbytes", "dtype", "itemsize", "num_steps", "op", "fingerprint")


def _exchange_headers(comm: MPI.Comm, prepared: list[_Prepared], op: str, tag: int, timeout_s: float | None) -> None:
    """Send each peer a header per shared job; compare what comes back."""
    outs: dict[int, list[np.ndarray]] = {}
    mine: dict[int, list[np.ndarray]] = {}
    for pj in prepared:
        h = _header(pj, op)
        for r in pj.peers_out:
            outs.setdefault(r, []).append(h)
        for r in pj.peers_in:
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
    """Test ``reqs`` with short sleeps until all complete (MPICH busy-polls in a blocking wait)."""
    if not reqs:
        return
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not (MPI.Request.Testall(reqs, statuses) if statuses is not None else MPI.Request.Testall(reqs)):
            if deadline is not None and time.monotonic() > deadline:
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
