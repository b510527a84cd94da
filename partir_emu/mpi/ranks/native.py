"""The MPI library's own collectives, for any placement of a group's members on ranks.

One member per rank maps straight onto ``Iallreduce`` / ``Ireduce_scatter``
/ ``Iallgatherv`` / ``Ialltoallv`` over the sub-communicator of the ranks
hosting the group. With several members on a rank, the rank first combines
its members locally (sums their inputs, or packs their blocks) and the
counts/displacements route each block to its member. Sums are in the MPI
library's order, not a schedule's: results equal the schedule executor's up to
rounding. A dtype without a predefined MPI datatype (bfloat16) takes :func:`_native_raw`: MPI
moves its bits and reductions run in numpy in group order, bit-identical to LocalMesh ``'direct'``
(MPI's built-in SUM cannot add bfloat16, and a user-defined ``MPI.Op`` would sum in the library's
bracketing, which differs between algorithms and rank counts). The entry point is :meth:`partir_emu.mpi.ranks.collectives.MpiCollectives.run_native`.
"""
from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Iterable

import numpy as np
from mpi4py import MPI

from partir_emu.collectives.schedule import KINDS
from partir_emu.collectives.semantics import REDUCE_OPS
from partir_emu.errors import CollectiveError
from partir_emu.mpi.ranks.wait import wait

MAGIC = 0x50434F4C  # "PCOL": first word of every header the executors exchange
_MPI_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

Scratch = Callable[[object, int], np.ndarray]   # (key, nbytes) -> a kept byte buffer


class SubcommCache:
    """Sub-communicators of ``comm`` per set of ranks, created once (``Create_group``,
    collective over those ranks only) and ordered by ascending rank; :meth:`free` frees them."""

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm
        self._subs: dict[tuple[int, ...], MPI.Intracomm] = {}

    def get(self, ranks: Iterable[int]) -> MPI.Intracomm:
        sub = self._subs.get(ranks) if isinstance(ranks, tuple) else None
        if sub is not None:  # the common case: the same ascending tuple as last time
            return sub
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


@functools.lru_cache(maxsize=256)  # a pure memo: the same group asks on every call
def native_layout(pos_rank: tuple[int, ...], me: int) -> tuple[tuple[int, ...], tuple[int, ...],
                                                               tuple[tuple[int, ...], ...], bool]:
    """For a group placed on ranks ``pos_rank``: the positions on rank ``me``, the ranks (ascending),
    the positions on each, and whether they are one run of equally many per rank in rank order."""
    by_rank: dict[int, list[int]] = {}
    for pos, r in enumerate(pos_rank):
        by_rank.setdefault(r, []).append(pos)
    ranks = tuple(sorted(by_rank))
    hosted = tuple(tuple(by_rank[r]) for r in ranks)
    mine = tuple(by_rank.get(me, ()))
    regular = all(len(h) == len(mine) for h in hosted) and \
        [pos for h in hosted for pos in h] == list(range(len(pos_rank)))
    return mine, ranks, hosted, regular


@functools.lru_cache(maxsize=64)  # a pure memo of mpi4py's table lookup
def mpi_dtype(dtype: np.dtype) -> MPI.Datatype:
    """The predefined MPI datatype of ``dtype`` (reductions need a predefined one)."""
    mdt = MPI._typedict.get(dtype.char)  # mpi4py's own char -> predefined datatype table
    if mdt is None or dtype.byteorder == ">" or mdt == MPI.DATATYPE_NULL:
        raise CollectiveError(f"dtype {dtype} has no predefined MPI datatype for a native collective; use the "
                              "schedule executor (MpiCollectives.run_schedule) instead")
    return mdt


def has_mpi_dtype(dtype: np.dtype) -> bool:
    """Whether ``dtype`` has a predefined MPI datatype (bfloat16 and the other ml_dtypes have none)."""
    try:
        mpi_dtype(dtype)
    except CollectiveError:
        return False
    return True


def _native_raw(kind: str, sub: MPI.Intracomm, op: str, bufs: list[np.ndarray], mine: tuple[int, ...],
                hosted: tuple[tuple[int, ...], ...], p: int, timeout_s: float | None,
                regular: bool) -> dict[int, np.ndarray]:
    """A native collective of a dtype MPI has no datatype for (bfloat16): the MPI library moves
    the bits as unsigned ints of the same width; a reduction gathers every member's input
    (``Iallgather``) and reduces them in numpy in group order, so the result is
    :func:`partir_emu.collectives.semantics.reference`'s (LocalMesh ``'direct'``) bit for bit,
    each addition rounded to the dtype (bfloat16 sums round at every step, as NCCL's do)."""
    dtype = bufs[0].dtype
    raw_t = np.dtype(f"u{dtype.itemsize}")
    raw = [b.view(raw_t) for b in bufs]
    mdt = mpi_dtype(raw_t)
    wait_what = lambda: f"native {kind} of {dtype} (as {raw_t}) over {sub.Get_size()} ranks"
    if kind == "all_to_all":
        out = _all_to_all(sub, raw, mine, hosted, p, mdt, timeout_s, regular, wait_what)
        return {pos: x.view(dtype) for pos, x in out.items()}
    gathered = _all_gather(sub, raw, mine, hosted, p, mdt, timeout_s, regular, wait_what)
    full = next(iter(gathered.values())).view(dtype)
    if kind == "all_gather":
        return {pos: x.view(dtype) for pos, x in gathered.items()}
    size = bufs[0].size
    total = functools.reduce(REDUCE_OPS[op], full.reshape(p, size))
    if kind == "all_reduce":
        return {pos: total.copy() for pos in mine}
    b = size // p
    return {pos: total[pos * b:(pos + 1) * b].copy() for pos in mine}


def check_header(sub: MPI.Intracomm, kind: str, op: str, size: int, dtype: np.dtype, group_devices: list[int],
                 ranks: tuple[int, ...], timeout_s: float | None) -> None:
    """Raise CollectiveError unless every rank of ``sub`` issues the same native collective."""
    p = len(group_devices)
    code = [MAGIC, KINDS.index(kind), size, dtype.num, dtype.itemsize, list(REDUCE_OPS).index(op), p,
            zlib.crc32(np.asarray(group_devices, np.int64).tobytes())]
    hdr = np.array(code + [-x for x in code], np.int64)
    got = np.empty_like(hdr)
    wait([sub.Iallreduce(hdr, got, MPI.MAX)], None, timeout_s, lambda: f"native {kind} header")
    if not (np.array_equal(got[:len(code)], code) and np.array_equal(-got[len(code):], code)):
        raise CollectiveError(f"native {kind} over devices {group_devices}: ranks {ranks} disagree on the "
                              f"collective (kind, size, dtype, op or group; this rank: {kind} of {size} x "
                              f"{dtype}, op {op!r}); make every rank issue the same collective")


def native(kind: str, sub: MPI.Intracomm, op: str, bufs: list[np.ndarray], mine: tuple[int, ...],
           hosted: tuple[tuple[int, ...], ...], p: int, timeout_s: float | None, regular: bool,
           scratch: Scratch) -> dict[int, np.ndarray]:
    """The MPI calls of a native collective, members of each rank combined locally.

    With one member per rank in rank order (the common case) the inputs go to MPI as they are and
    the received buffer is the output (all_reduce receives into a ``scratch`` buffer kept between
    calls and copies out: measured faster with MPICH than receiving into a fresh buffer)."""
    if not has_mpi_dtype(bufs[0].dtype):
        return _native_raw(kind, sub, op, bufs, mine, hosted, p, timeout_s, regular)
    mdt = mpi_dtype(bufs[0].dtype)
    wait_what = lambda: f"native {kind} over {sub.Get_size()} ranks"
    if kind == "all_reduce":
        fn, dtype = REDUCE_OPS[op], bufs[0].dtype
        partial = bufs[0] if len(mine) == 1 else np.ascontiguousarray(functools.reduce(fn, bufs))
        out = scratch("native-out", partial.nbytes).view(dtype)
        wait([sub.Iallreduce([partial, mdt], [out, mdt], _MPI_OPS[op])], None, timeout_s, wait_what)
        return {pos: out.copy() for pos in mine}
    if kind == "reduce_scatter":
        return _reduce_scatter(sub, op, bufs, mine, hosted, p, mdt, timeout_s, regular, wait_what)
    if kind == "all_gather":
        return _all_gather(sub, bufs, mine, hosted, p, mdt, timeout_s, regular, wait_what)
    return _all_to_all(sub, bufs, mine, hosted, p, mdt, timeout_s, regular, wait_what)


def _reduce_scatter(sub, op, bufs, mine, hosted, p, mdt, timeout_s, regular, wait_what) -> dict[int, np.ndarray]:
    fn, mpi_op, dtype, size = REDUCE_OPS[op], _MPI_OPS[op], bufs[0].dtype, bufs[0].size
    single = len(mine) == 1
    b = size // p
    partial = bufs[0] if single else functools.reduce(fn, bufs)
    out = np.empty(len(mine) * b, dtype)
    if regular:  # rank r's blocks are already together, in order
        wait([sub.Ireduce_scatter_block([partial, mdt], [out, mdt], mpi_op)], None, timeout_s, wait_what)
    else:
        partial = partial.reshape(p, b)
        send = np.ascontiguousarray(np.concatenate([partial[list(h)] for h in hosted]).ravel())
        counts = [len(h) * b for h in hosted]
        wait([sub.Ireduce_scatter([send, mdt], [out, mdt], counts, mpi_op)], None, timeout_s, wait_what)
    return {mine[0]: out} if single else {pos: out[i * b:(i + 1) * b].copy() for i, pos in enumerate(mine)}


def _all_gather(sub, bufs, mine, hosted, p, mdt, timeout_s, regular, wait_what) -> dict[int, np.ndarray]:
    dtype, b = bufs[0].dtype, bufs[0].size
    send = bufs[0] if len(mine) == 1 else np.concatenate(bufs)
    recv = np.empty(p * b, dtype)
    if regular:  # gathered in rank order = position order
        wait([sub.Iallgather([send, mdt], [recv, mdt])], None, timeout_s, wait_what)
        return {pos: recv.copy() if i else recv for i, pos in enumerate(mine)}
    counts = [len(h) * b for h in hosted]
    wait([sub.Iallgatherv([send, mdt], [recv, (counts, _displs(counts)), mdt])], None, timeout_s, wait_what)
    full = np.empty((p, b), dtype)
    full[[pos for h in hosted for pos in h]] = recv.reshape(p, b)
    out = full.ravel()
    return {pos: out.copy() if i else out for i, pos in enumerate(mine)}


def _all_to_all(sub, bufs, mine, hosted, p, mdt, timeout_s, regular, wait_what) -> dict[int, np.ndarray]:
    """Block ``j`` of member ``i`` goes to member ``j``."""
    dtype, b = bufs[0].dtype, bufs[0].size // p
    if len(mine) == 1 and regular:  # blocks are in destination-rank order both ways
        recv = np.empty(p * b, dtype)
        wait([sub.Ialltoall([bufs[0], mdt], [recv, mdt])], None, timeout_s, wait_what)
        return {mine[0]: recv}
    blocks = np.stack(bufs).reshape(len(mine), p, b)
    send = np.ascontiguousarray(np.concatenate([blocks[:, list(h), :].ravel() for h in hosted]))
    scounts = [len(mine) * len(h) * b for h in hosted]
    rcounts = scounts  # |hosted[r]| * |mine| * b either way
    recv = np.empty(sum(rcounts), dtype)
    wait([sub.Ialltoallv([send, (scounts, _displs(scounts)), mdt], [recv, (rcounts, _displs(rcounts)), mdt])],
         None, timeout_s, wait_what)
    full = np.empty((p, len(mine), b), dtype)
    off = 0
    for h, c in zip(hosted, rcounts):
        full[list(h)] = recv[off:off + c].reshape(len(h), len(mine), b)
        off += c
    return {pos: full[:, i, :].ravel().copy() for i, pos in enumerate(mine)}


def _displs(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out
