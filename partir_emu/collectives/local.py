"""Run a :class:`CollectiveSchedule` in one process, moving data exactly as it says.

This is the executor of the in-process mesh. ``reference`` gives the direct
numpy meaning of each collective, for tests. The helpers below (input checks,
initial state, applying a received chunk, assembling the output) are shared
with the MPI executor, so both perform the same arithmetic in the same order.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided, sliding_window_view

from partir_emu.collectives.schedule import KINDS, REDUCE_KINDS, CollectiveSchedule, Transfer, check_permutation
from partir_emu.errors import CollectiveError

REDUCE_OPS: dict[str, np.ufunc] = {"sum": np.add, "max": np.maximum, "min": np.minimum}

State = dict[int, np.ndarray]


def reduce_fn(op: str) -> np.ufunc:
    """The ufunc of a reduction op name ('sum', 'max', 'min')."""
    try:
        return REDUCE_OPS[op]
    except (KeyError, TypeError):
        raise CollectiveError(f"unknown reduction op {op!r}; use one of {tuple(REDUCE_OPS)}") from None


def check_buffer(sched: CollectiveSchedule, pos: int, buf: np.ndarray, dtype: np.dtype | None = None) -> np.ndarray:
    """``buf`` as the flat input of member ``pos``, or a CollectiveError saying what is wrong."""
    if isinstance(buf, np.ndarray) and buf.ndim == 1 and (dtype is None or buf.dtype == dtype) \
            and buf.dtype.itemsize == sched.itemsize and buf.nbytes == sched.input_nbytes:
        return buf
    what = f"{sched.kind}[{sched.algorithm}] over group {sched.group_shape}, member {pos}"
    if not isinstance(buf, np.ndarray) or buf.ndim != 1:
        raise CollectiveError(f"{what}: expected a flat 1-D numpy array, got "
                              f"{type(buf).__name__} of shape {getattr(buf, 'shape', None)}; ravel it first")
    if dtype is not None and buf.dtype != dtype:
        raise CollectiveError(f"{what}: dtype {buf.dtype} differs from the other members' {dtype}; cast them alike")
    if buf.dtype.itemsize != sched.itemsize:
        raise CollectiveError(f"{what}: buffer dtype {buf.dtype} has itemsize {buf.dtype.itemsize} but the schedule "
                              f"was built for itemsize {sched.itemsize}; rebuild it with "
                              f"build_schedule(..., itemsize={buf.dtype.itemsize})")
    if buf.nbytes != sched.input_nbytes:
        raise CollectiveError(f"{what}: input has {buf.nbytes} bytes ({buf.size} x {buf.dtype}) but the schedule "
                              f"expects {sched.input_nbytes}; rebuild the schedule for this size")
    return buf


def initial_state(sched: CollectiveSchedule, pos: int, buf: np.ndarray) -> State:
    """Member ``pos``'s chunks before step 0 (views of ``buf``, never written in place)."""
    state: State = {}
    off = 0
    for c in sched.input_chunks(pos):
        k = sched.chunk_bytes[c] // sched.itemsize
        state[c] = buf[off:off + k]
        off += k
    return state


def run_chunks(sched: CollectiveSchedule, t: Transfer) -> list[int]:
    """The non-empty chunks a transfer carries, in order."""
    cb = sched.chunk_bytes
    return [c for c in t.chunks if cb[c]]


def apply_transfer(state: State, chunks: Sequence[int], payload: Sequence[np.ndarray], reduce: bool,
                   fn: np.ufunc) -> None:
    """Apply the received values of ``chunks`` to the destination's state (out of place)."""
    if reduce:
        for c, v in zip(chunks, payload):
            state[c] = fn(state[c], v)
    else:
        for c, v in zip(chunks, payload):
            state[c] = v


def assemble_output(sched: CollectiveSchedule, pos: int, state: State, dtype: np.dtype) -> np.ndarray:
    """Member ``pos``'s output buffer (a fresh array) from its final state."""
    chunks = sched.output_chunks(pos)
    if chunks is None:
        return np.zeros(sched.output_nbytes // sched.itemsize, dtype)
    parts = []
    for c in chunks:
        if sched.chunk_bytes[c] == 0:
            continue
        if c not in state:
            raise CollectiveError(f"{sched.describe()}: member {pos} never received chunk {c}; the schedule is "
                                  "incomplete (check it with validate_schedule)")
        parts.append(state[c])
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def run_schedule(schedule: CollectiveSchedule, buffers: Sequence[np.ndarray], op: str = "sum") -> list[np.ndarray]:
    """Execute ``schedule`` on ``buffers`` (one flat array per member, in group order).

    Returns fresh output arrays; the inputs are not modified. Runs the plan of
    :func:`plan_for` (cached on the schedule): per step, the values every transfer sends are
    copied out first, then applied in schedule order, whole runs of chunks per numpy call.
    """
    fn = reduce_fn(op)
    if len(buffers) != schedule.p:
        raise CollectiveError(f"{schedule.describe()}: got {len(buffers)} buffers for {schedule.p} members")
    dtype = buffers[0].dtype if buffers and isinstance(buffers[0], np.ndarray) else None
    bufs = [check_buffer(schedule, i, b, dtype) for i, b in enumerate(buffers)]
    plan = schedule._plans.get("local")
    if plan is None:
        plan = schedule._plans["local"] = Plan([(schedule, np.zeros(schedule.p, np.int64), range(schedule.p))], 0)
    space = plan.spaces[0]
    work = [space.start(dict(enumerate(bufs)), bufs[0].dtype)]
    rbuf = np.empty(plan.rbytes, np.uint8)
    for sp in plan.steps:
        sp.gather_local(work, rbuf)
        sp.apply(work, rbuf, fn)
    return [space.output(work[0], pos, dtype) for pos in range(schedule.p)]


# ---------------------------------------------------------------------------------------------
# Execution plans, shared with the MPI executor (partir_emu.collectives.mpi).
#
# Every member hosted here keeps all chunks it ever holds in one flat "work" buffer per job, the
# chunks in id order (a run of chunks is one contiguous range). A step is planned once per
# schedule and placement: which ranges go out to which rank (one message per peer, straight from
# the work buffer when it is one range), which come in (into a scratch buffer ``R``, or straight
# into the work buffer when nothing else reads or writes that range in the step), which are copied
# between members of this process (snapshotted into ``R`` before anything is applied), and how the
# received ranges are applied: ``acc = op(acc, received)`` or a store, grouped into one numpy call
# per run length when the destination ranges of the step do not overlap, one call per transfer in
# schedule order otherwise. The arithmetic per element is the schedule's, in its order, so every
# executor gives the same bits.

def _align(n: int, itemsize: int = 1) -> int:
    """``n`` rounded up to a multiple of 16 bytes and of ``itemsize`` (where a job's part of a
    message or of a scratch buffer starts)."""
    a = math.lcm(16, itemsize)
    return -(-n // a) * a


_BIG = 1 << 14  # bytes: ranges at least this long are moved one slice at a time (in place, no temporaries)


class Rows:
    """``n`` ranges of ``L`` elements at element offsets ``offs`` of a flat buffer, reached by a
    view when they are equally spaced (a slice, a reshape or a strided view), else by indexing a
    sliding-window view, or one slice at a time (see :func:`move`)."""

    __slots__ = ("L", "n", "o0", "stride", "offs", "_starts")

    def __init__(self, offs: np.ndarray, L: int):
        offs = np.asarray(offs, np.int64)
        self.L, self.n, self.o0 = int(L), len(offs), int(offs[0])
        self.stride, self.offs, self._starts = self.L, None, None
        if self.n > 1:
            d = np.diff(offs)
            if d[0] >= self.L and (d == d[0]).all():
                self.stride = int(d[0])
            else:
                self.offs = offs

    def starts(self) -> list[int]:
        if self._starts is None:
            self._starts = self.offs.tolist() if self.offs is not None else \
                list(range(self.o0, self.o0 + self.n * self.stride, self.stride))
        return self._starts

    def view(self, buf: np.ndarray) -> np.ndarray | None:
        if self.offs is not None:
            return None
        if self.stride == self.L:
            return buf[self.o0:self.o0 + self.n * self.L].reshape(self.n, self.L)
        return as_strided(buf[self.o0:], shape=(self.n, self.L), strides=(self.stride * buf.itemsize, buf.itemsize))

    def read(self, buf: np.ndarray) -> np.ndarray:
        v = self.view(buf)
        return v if v is not None else sliding_window_view(buf, self.L)[self.offs]


def move(dst_buf: np.ndarray, dst: Rows, src_buf: np.ndarray, src: Rows, fn: np.ufunc | None = None) -> None:
    """Row ``i`` of ``dst`` := row ``i`` of ``src`` (``fn`` None), or ``fn(dst row, src row)``, in place.

    Elementwise either way, so the result does not depend on how the rows are reached."""
    L = dst.L
    if dst.n == 1 or (L * dst_buf.itemsize >= _BIG and (dst.offs is not None or src.offs is not None)):
        for d, s in zip(dst.starts(), src.starts()):
            dv = dst_buf[d:d + L]
            if fn is None:
                dv[...] = src_buf[s:s + L]
            else:
                fn(dv, src_buf[s:s + L], out=dv)
        return
    vals = src.read(src_buf)
    dv = dst.view(dst_buf)
    if dv is not None:
        if fn is None:
            dv[...] = vals
        else:
            fn(dv, vals, out=dv)
    else:
        win = sliding_window_view(dst_buf, L, writeable=True)
        win[dst.offs] = vals if fn is None else fn(win[dst.offs], vals)


def _groups(keys: np.ndarray) -> list[np.ndarray]:
    """Indices of equal ``keys``, each group in original order, groups by ascending key."""
    if not len(keys):
        return []
    order = np.argsort(keys, kind="stable")
    ks = keys[order]
    cuts = np.flatnonzero(ks[1:] != ks[:-1]) + 1
    return np.split(order, cuts)


def _overlap(starts: np.ndarray, lens: np.ndarray) -> bool:
    """Whether any two of the ranges ``[start, start + len)`` overlap."""
    if len(starts) < 2:
        return False
    o = np.argsort(starts, kind="stable")
    s, e = starts[o], starts[o] + lens[o]
    return bool((s[1:] < np.maximum.accumulate(e)[:-1]).any())


def _hits(lo: int, hi: int, starts: np.ndarray, lens: np.ndarray) -> bool:
    """Whether ``[lo, hi)`` overlaps any of the ranges."""
    return bool(((starts < hi) & (starts + lens > lo)).any()) if len(starts) else False


def _runs(src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> list[tuple[Rows, Rows]]:
    """Copy runs ``src -> dst`` (element offsets and lengths): adjacent runs joined, then grouped
    by length into (source rows, destination rows)."""
    keep = lens > 0
    src, dst, lens = src[keep], dst[keep], lens[keep]
    if not len(lens):
        return []
    new = np.ones(len(lens), bool)
    new[1:] = (src[1:] != src[:-1] + lens[:-1]) | (dst[1:] != dst[:-1] + lens[:-1])
    first = np.flatnonzero(new)
    lens = np.add.reduceat(lens, first)
    src, dst = src[first], dst[first]
    return [(Rows(src[g], int(lens[g[0]])), Rows(dst[g], int(lens[g[0]]))) for g in _groups(lens)]


class Space:
    """Where the members hosted here keep their chunks for one schedule: ``size`` elements, member
    ``slots[pos]`` in ``base[slot] .. base[slot+1]``, chunk ``c`` of a member at ``offset(slot, c)``.

    A member keeps the chunks it ends with first, in output order (so that its output is one
    range), then the other chunks it holds at some point, by id; if that would cut a run of chunks
    that one transfer moves, all its chunks go by id instead (a run is then always one range).
    all_gather, reduce_scatter and all_reduce members hold every chunk (reduce_scatter: by id);
    the other kinds only the chunks they start with, send, receive or end with."""

    def __init__(self, sched: CollectiveSchedule, hosted: Sequence[int], touched: tuple[np.ndarray, ...]):
        self.sched, self.hosted = sched, list(hosted)
        self.slots = {pos: i for i, pos in enumerate(self.hosted)}
        isz, nc = sched.itemsize, sched.num_chunks
        elems = np.asarray(sched.chunk_bytes, np.int64) // isz
        self.ce = np.zeros(nc + 1, np.int64)
        np.cumsum(elems, out=self.ce[1:])
        h = len(self.hosted)
        slot, a, k = (np.asarray(x, np.int64) for x in touched)
        # every chunk of the runs of several chunks, with the first chunk of its run
        multi = k > 1
        ka = k[multi]
        run_a = np.repeat(a[multi], ka)
        run_s = np.repeat(slot[multi], ka)
        run_c = run_a + (np.arange(ka.sum()) - np.repeat(np.cumsum(ka) - ka, ka))
        nonempty = elems[run_c] > 0
        run_a, run_s, run_c = run_a[nonempty], run_s[nonempty], run_c[nonempty]
        self.full = sched.kind in ("all_gather", "reduce_scatter", "all_reduce")
        if self.full:
            self.T = int(self.ce[-1])
            self.size = h * self.T
            self.base = np.arange(h + 1, dtype=np.int64) * self.T
            self.rel = self.ce[:-1]
            if sched.kind != "reduce_scatter" and sched.layout:  # every member ends with all chunks, in layout order
                order = np.asarray([c for c in sched.output_chunks(0) if elems[c]], np.int64)
                rel = np.zeros(nc, np.int64)
                rel[order] = np.cumsum(elems[order]) - elems[order]
                ids = np.flatnonzero(elems)  # an empty chunk sits where the next non-empty one does
                nxt = np.searchsorted(ids, np.arange(nc))
                rel = np.where(elems > 0, rel, np.append(rel[ids], self.T)[nxt])
                if np.array_equal(rel[run_c], rel[run_a] + self.ce[run_c] - self.ce[run_a]):
                    self.rel = rel
        else:
            lists = [slot * nc + a, run_s * nc + run_c]
            outs = []
            for i, pos in enumerate(self.hosted):
                out = np.asarray(sched.output_chunks(pos) or (), np.int64)
                out = out[elems[out] > 0]
                outs.append(out)
                lists.append(i * nc + np.concatenate([np.asarray(sched.input_chunks(pos), np.int64), out]))
            keys = np.unique(np.concatenate(lists))
            keys = keys[elems[keys % nc] > 0]
            self.keys = keys
            kslot, kc = keys // nc, keys % nc
            for by_output in (True, False):
                rank = np.arange(len(keys), dtype=np.int64)  # by id
                if by_output:
                    out_keys = np.concatenate([i * nc + o for i, o in enumerate(outs)] + [np.zeros(0, np.int64)])
                    out_rank = np.concatenate([np.arange(len(o)) for o in outs] + [np.zeros(0, np.int64)])
                    n_out = np.array([len(o) for o in outs] + [0], np.int64)
                    o = np.argsort(out_keys)
                    is_out = np.isin(keys, out_keys)
                    rank[is_out] = out_rank[o][np.searchsorted(out_keys[o], keys[is_out])]
                    rest = np.flatnonzero(~is_out)
                    first = np.searchsorted(kslot[rest], np.arange(h + 1))
                    rank[rest] = n_out[kslot[rest]] + np.arange(len(rest)) - first[kslot[rest]]
                seq = np.lexsort((rank, kslot))
                sizes = elems[kc[seq]]
                off = np.empty(len(keys) + 1, np.int64)
                off[seq] = np.cumsum(sizes) - sizes
                off[-1] = int(sizes.sum())
                self.off = off
                if not by_output or np.array_equal(self.offset(run_s, run_c),
                                                   self.offset(run_s, run_a) + self.ce[run_c] - self.ce[run_a]):
                    break
            self.size = int(off[-1])
            sizes_by_slot = np.bincount(kslot, weights=elems[kc], minlength=h).astype(np.int64)
            self.base = np.concatenate(([0], np.cumsum(sizes_by_slot)))
        self._in: dict[int, list] = {}
        self._out: dict[int, list | None] = {}
        self._views: bool | None = None

    def offset(self, slot: np.ndarray, chunk: np.ndarray) -> np.ndarray:
        slot, chunk = np.asarray(slot, np.int64), np.asarray(chunk, np.int64)
        if self.full:
            return slot * self.T + self.rel[chunk]
        return self.off[np.searchsorted(self.keys, slot * self.sched.num_chunks + chunk)]

    def _piece_runs(self, slot: int, chunks: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c = np.asarray(chunks, np.int64)
        lens = self.ce[c + 1] - self.ce[c]
        pos = np.cumsum(lens) - lens
        return pos, self.offset(np.full(len(c), slot), c), lens

    def start(self, local: Mapping[int, np.ndarray], dtype: np.dtype, work: np.ndarray | None = None) -> np.ndarray:
        """A work buffer (fresh, or ``work``) holding every hosted member's input."""
        work = np.empty(self.size, dtype) if work is None else work
        for pos, i in self.slots.items():
            runs = self._in.get(pos)
            if runs is None:
                src, dst, lens = self._piece_runs(i, self.sched.input_chunks(pos))
                runs = self._in[pos] = _runs(src, dst, lens)
            buf = local[pos]
            for a, b in runs:
                move(work, b, buf, a)
        return work

    def _out_runs(self, pos: int) -> list | None:
        if pos not in self._out:
            chunks = self.sched.output_chunks(pos)
            if chunks is None:
                self._out[pos] = None
            else:
                src, dst, lens = self._piece_runs(self.slots[pos], chunks)
                self._out[pos] = _runs(dst, src, lens)
        return self._out[pos]

    def _whole(self, pos: int) -> bool:
        """Whether member ``pos``'s output is one range of the work buffer, at least half its part."""
        runs = self._out_runs(pos)
        n = self.sched.output_nbytes // self.sched.itemsize
        slot = self.slots[pos]
        if runs is None or len(runs) != 1:
            return n == 0 and runs is not None
        o = runs[0][1]
        return o.n == 1 and o.o0 == 0 and o.L == n and 2 * n >= self.base[slot + 1] - self.base[slot]

    def outputs_are_views(self) -> bool:
        """Whether every hosted member's output can be a view of the work buffer (no copy)."""
        if self._views is None:
            self._views = all(self._whole(pos) for pos in self.hosted)
        return self._views

    def output(self, work: np.ndarray, pos: int, dtype: np.dtype, view_ok: bool = True) -> np.ndarray:
        """Member ``pos``'s output: a fresh array (or, if ``view_ok``, a view of ``work`` when it is
        one range of it)."""
        sched = self.sched
        runs = self._out_runs(pos)
        n = sched.output_nbytes // sched.itemsize
        if runs is None:
            return np.zeros(n, dtype)
        if self._whole(pos) and n:
            o = runs[0][0].o0
            out = work[o:o + n]  # the member's output is one range of work
            return out if view_ok else out.copy()
        out = np.empty(n, dtype)
        for w, o in runs:
            move(out, o, work, w)
        return out


class StepPlan:
    """What this process does in one step (see the comment above :class:`Rows`)."""

    __slots__ = ("step", "recvs", "sends", "packs", "gathers", "applies", "trace_rows", "statuses")

    def __init__(self, step: int):
        self.step = step
        self.recvs: list[tuple[int, int, int, int]] = []        # (peer, nbytes, job or -1 for R, byte offset)
        self.sends: list[tuple[int, int, int, int]] = []        # (peer, nbytes, job or -1 for S, byte offset)
        self.packs: list[tuple[int, Rows, Rows]] = []           # (job, rows of work, rows of S)
        self.gathers: list[tuple[int, Rows, Rows]] = []         # (job, rows of work, rows of R)
        self.applies: list[tuple[int, bool, Rows, bool, Rows]] = []  # (job, reduce, source rows, in work?, rows of work)
        self.trace_rows: list[tuple[int, int, int, int]] | None = None
        self.statuses: list | None = None  # MPI.Status objects, made once by the MPI executor

    def gather_local(self, work: list[np.ndarray], rbuf: np.ndarray) -> None:
        for j, a, b in self.gathers:
            move(rbuf.view(work[j].dtype), b, work[j], a)

    def pack(self, work: list[np.ndarray], sbuf: np.ndarray) -> None:
        for j, a, b in self.packs:
            move(sbuf.view(work[j].dtype), b, work[j], a)

    def apply(self, work: list[np.ndarray], rbuf: np.ndarray, fn: np.ufunc) -> None:
        for j, red, a, in_work, b in self.applies:
            w = work[j]
            move(w, b, w if in_work else rbuf.view(w.dtype), a, fn if red else None)


class _Transfers:
    """Transfers of one job that touch this rank, as arrays: index in their step, positions,
    ranks, work-buffer offsets (``-1`` where the member is elsewhere), lengths, reduce flags."""

    FIELDS = ("ti", "src", "dst", "sr", "dr", "s_off", "d_off", "L", "red")
    __slots__ = FIELDS + ("itemsize",)

    def __init__(self, itemsize: int, *arrays: np.ndarray):
        self.itemsize = itemsize
        for f, a in zip(self.FIELDS, arrays):
            setattr(self, f, a)

    def __getitem__(self, idx) -> _Transfers:
        return _Transfers(self.itemsize, *(getattr(self, f)[idx] for f in self.FIELDS))

    def __len__(self) -> int:
        return len(self.ti)


class Plan:
    """The steps of one or more jobs ``(schedule, rank of each position, positions hosted here)``
    as run by rank ``me`` (see the comment above :class:`Rows`). ``spaces[j]`` is job ``j``'s
    work-buffer layout; ``steps`` the steps in which this rank does anything."""

    def __init__(self, jobs: Sequence[tuple[CollectiveSchedule, np.ndarray, Sequence[int]]], me: int):
        self.me = me
        self.spaces: list[Space] = []
        self.jobs: list[tuple[_Transfers, np.ndarray]] = []  # (transfers, first row of each step)
        for sched, ranks, hosted in jobs:
            tab = sched.table()
            ranks = np.asarray(ranks, np.int64)
            here = ranks == me
            hit = np.flatnonzero(here[tab.src] | here[tab.dst])
            step = np.searchsorted(tab.ptr, hit, side="right") - 1
            src, dst = tab.src[hit].astype(np.int64), tab.dst[hit].astype(np.int64)
            a, k = tab.chunk[hit].astype(np.int64), tab.count[hit].astype(np.int64)
            slot_of = np.full(sched.p, -1, np.int64)
            slot_of[list(hosted)] = np.arange(len(hosted))
            s_slot, d_slot = slot_of[src], slot_of[dst]
            s_in, d_in = s_slot >= 0, d_slot >= 0
            space = Space(sched, hosted, (np.concatenate([s_slot[s_in], d_slot[d_in]]),
                                          np.concatenate([a[s_in], a[d_in]]), np.concatenate([k[s_in], k[d_in]])))
            self.spaces.append(space)
            t = _Transfers(sched.itemsize, hit - tab.ptr[step], src, dst, ranks[src], ranks[dst],
                           np.where(s_in, space.offset(np.maximum(s_slot, 0), a), -1),
                           np.where(d_in, space.offset(np.maximum(d_slot, 0), a), -1),
                           space.ce[a + k] - space.ce[a], tab.reduce[hit])
            self.jobs.append((t, np.searchsorted(step, np.arange(tab.num_steps + 1))))
        self.steps: list[StepPlan] = []
        self.rbytes = self.sbytes = 0
        for s in range(max((len(cuts) - 1 for _, cuts in self.jobs), default=0)):
            sp = self._step(s)
            if sp is not None:
                self.steps.append(sp)
        align = math.lcm(16, *(sched.itemsize for sched, _, _ in jobs))
        self.rbytes, self.sbytes = _align(self.rbytes, align), _align(self.sbytes, align)
        # peers per job, for the header exchange
        self.peers_out = [sorted(set(t.dr[(t.sr == me) & (t.dr != me)].tolist())) for t, _ in self.jobs]
        self.peers_in = [sorted(set(t.sr[(t.dr == me) & (t.sr != me)].tolist())) for t, _ in self.jobs]

    def _rows_of_step(self, s: int) -> list[_Transfers | None]:
        return [t[int(cuts[s]):int(cuts[s + 1])] if s + 1 < len(cuts) else None for t, cuts in self.jobs]

    def _messages(self, rows: list[_Transfers | None], incoming: bool) -> dict[int, list[tuple[int, _Transfers, int]]]:
        """Per peer rank, the parts ``(job, transfers, byte offset in the message)`` of its message
        (jobs in order, each part aligned), and the message size under key ``-1 - peer``."""
        me = self.me
        parts: dict[int, list[tuple[int, _Transfers, int]]] = {}
        for j, r in enumerate(rows):
            if r is None or not len(r):
                continue
            idx = np.flatnonzero((r.dr == me) & (r.sr != me)) if incoming else np.flatnonzero((r.sr == me) & (r.dr != me))
            peer_of = (r.sr if incoming else r.dr)[idx]
            for g in _groups(peer_of):
                parts.setdefault(int(peer_of[g[0]]), []).append((j, r[idx[g]], 0))
        out = {}
        for peer, ps in sorted(parts.items()):
            nb, laid = 0, []
            for j, t, _ in ps:
                start = _align(nb, t.itemsize) if nb else 0
                laid.append((j, t, start))
                nb = start + int(t.L.sum()) * t.itemsize
            out[peer] = laid
            out[-1 - peer] = nb
        return out

    def _step(self, s: int) -> StepPlan | None:
        me = self.me
        rows = self._rows_of_step(s)
        if not any(r is not None and len(r) for r in rows):
            return None
        sp = StepPlan(s)
        # per job: must the step apply one transfer at a time (destination ranges overlap)? what it reads
        seq, reads = [], []
        for r in rows:
            if r is None:
                seq.append(False)
                reads.append((np.zeros(0, np.int64),) * 2)
                continue
            inc, out = r.dr == me, r.sr == me
            seq.append(_overlap(r.d_off[inc], r.L[inc]))
            reads.append((r.s_off[out], r.L[out]))
        applies: dict[int, list[tuple[np.ndarray, ...]]] = {}
        # incoming messages: into R, or straight into the work buffer when nothing else in the step
        # reads or writes that range (one job, stores only, one contiguous range)
        rb = 0
        msgs = self._messages(rows, incoming=True)
        for peer in (k for k in msgs if k >= 0):
            parts, nb = msgs[peer], msgs[-1 - peer]
            if len(parts) == 1:
                j, t, _ = parts[0]
                d, L = t.d_off, t.L
                lo, hi = int(d[0]), int(d[-1] + L[-1])
                if not seq[j] and not t.red.any() and (d[1:] == d[:-1] + L[:-1]).all() \
                        and not _hits(lo, hi, *reads[j]):
                    sp.recvs.append((peer, nb, j, lo * t.itemsize))
                    continue
            base = _align(rb, max(t.itemsize for _, t, _ in parts))
            sp.recvs.append((peer, nb, -1, base))
            for j, t, start in parts:
                roff = (base + start) // t.itemsize + np.cumsum(t.L) - t.L
                applies.setdefault(j, []).append((t.ti, t.d_off, t.L, t.red, roff, np.zeros(len(t), bool)))
            rb = base + nb
        # copies between members hosted here: straight from the source member's range when nothing in
        # the step writes there, else snapshotted into R first
        for j, r in enumerate(rows):
            if r is None:
                continue
            t = r[np.flatnonzero((r.sr == me) & (r.dr == me))]
            if not len(t):
                continue
            if seq[j]:
                clash = np.ones(len(t), bool)
            else:  # the step's writes are disjoint: sorted by start, their ends are sorted too
                inc = r.dr == me
                o = np.argsort(r.d_off[inc])
                ws = r.d_off[inc][o]
                we = ws + r.L[inc][o]
                i = np.searchsorted(ws, t.s_off + t.L) - 1
                clash = (i >= 0) & (we[np.maximum(i, 0)] > t.s_off)
            d = t[np.flatnonzero(~clash)]
            if len(d):
                applies.setdefault(j, []).append((d.ti, d.d_off, d.L, d.red, d.s_off, np.ones(len(d), bool)))
            t = t[np.flatnonzero(clash)]
            if not len(t):
                continue
            o = _align(rb, t.itemsize) // t.itemsize
            roff = np.zeros(len(t), np.int64)
            for g in _groups(t.L * 2 + t.red):
                n, Lg = len(g), int(t.L[g[0]])
                roff[g] = o + np.arange(n) * Lg
                sp.gathers.append((j, Rows(t.s_off[g], Lg), Rows(roff[g], Lg)))
                o += n * Lg
            rb = o * t.itemsize
            applies.setdefault(j, []).append((t.ti, t.d_off, t.L, t.red, roff, np.zeros(len(t), bool)))
        # applying what came in: one numpy call per (length, reduce, source), or per transfer in order
        for j in sorted(applies):
            ti, d_off, L, red, soff, in_work = (np.concatenate(x) for x in zip(*applies[j]))
            if seq[j]:
                for i in np.argsort(ti, kind="stable"):
                    Li = int(L[i])
                    sp.applies.append((j, bool(red[i]), Rows(soff[i:i + 1], Li), bool(in_work[i]), Rows(d_off[i:i + 1], Li)))
            else:
                for g in _groups((L * 2 + red) * 2 + in_work):
                    Lg = int(L[g[0]])
                    sp.applies.append((j, bool(red[g[0]]), Rows(soff[g], Lg), bool(in_work[g[0]]), Rows(d_off[g], Lg)))
        # outgoing messages, laid out as the receiver expects: straight from the work buffer when one range
        sb = 0
        msgs = self._messages(rows, incoming=False)
        for peer in (k for k in msgs if k >= 0):
            parts, nb = msgs[peer], msgs[-1 - peer]
            if len(parts) == 1:
                j, t, _ = parts[0]
                if (t.s_off[1:] == t.s_off[:-1] + t.L[:-1]).all():
                    sp.sends.append((peer, nb, j, int(t.s_off[0]) * t.itemsize))
                    continue
            base = _align(sb, max(t.itemsize for _, t, _ in parts))
            sp.sends.append((peer, nb, -1, base))
            for j, t, start in parts:
                soff = (base + start) // t.itemsize + np.cumsum(t.L) - t.L
                for g in _groups(t.L):
                    Lg = int(t.L[g[0]])
                    sp.packs.append((j, Rows(t.s_off[g], Lg), Rows(soff[g], Lg)))
            sb = base + nb
        self.rbytes, self.sbytes = max(self.rbytes, rb), max(self.sbytes, sb)
        return sp

    def trace_rows(self, sp: StepPlan, devices: Sequence[Sequence[int]]) -> list[tuple[int, int, int, int]]:
        """``(step, src device, dst device, nbytes)`` of every transfer this rank sends in step ``sp``
        (copies included), jobs in order, transfers in schedule order."""
        if sp.trace_rows is None:
            out: list[tuple[int, int, int, int]] = []
            for r, devs in zip(self._rows_of_step(sp.step), devices):
                if r is None:
                    continue
                t = r[np.flatnonzero(r.sr == self.me)]
                dv = np.asarray(devs, np.int64)
                out += zip([sp.step] * len(t), dv[t.src].tolist(), dv[t.dst].tolist(), (t.L * t.itemsize).tolist())
            sp.trace_rows = out
        return sp.trace_rows


def reference(kind: str, buffers: Sequence[np.ndarray], op: str = "sum",
              permutation: Sequence[tuple[int, int]] | None = None) -> list[np.ndarray]:
    """The direct numpy meaning of collective ``kind`` over ``buffers`` (members in group order)."""
    if kind not in KINDS:
        raise CollectiveError(f"unknown collective kind {kind!r}; use one of {KINDS}")
    p = len(buffers)
    bufs = [np.asarray(b).ravel() for b in buffers]
    if kind == "all_gather":
        return [np.concatenate(bufs) for _ in range(p)]
    if kind in REDUCE_KINDS:
        total = functools.reduce(reduce_fn(op), bufs)
        if kind == "all_reduce":
            return [total.copy() for _ in range(p)]
        if total.size % p:
            raise CollectiveError(f"reduce_scatter of {total.size} elements over {p} members: size must divide by p")
        return [b.copy() for b in np.split(total, p)]
    if kind == "all_to_all":
        blocks = [np.split(b, p) for b in bufs]
        return [np.concatenate([blocks[i][j] for i in range(p)]) for j in range(p)]
    out = [np.zeros_like(b) for b in bufs]
    for s, d in check_permutation(permutation, p):
        out[d] = bufs[s].copy()
    return out
