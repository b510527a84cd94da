"""The work buffer of the schedule executors: where hosted members keep their chunks, and how
ranges of it move.

An executor (in-process or MPI) keeps every chunk the members it hosts ever hold in one flat *work*
buffer per schedule, laid out by :class:`Space`; a run of chunks that one transfer moves is one
contiguous range. :class:`Rows` names equally long ranges of a flat buffer and :func:`move` copies
or reduces them, one numpy call for all rows where it can. The step planner
(:mod:`partir_emu.collectives.planner`) says which ranges move in each step.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided, sliding_window_view

from partir_emu.collectives.schedule import CollectiveSchedule


def align(n: int, itemsize: int = 1) -> int:
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
        self.stride, self.offs = self.L, None
        self._starts: list[int] | None = None
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
        raw = _raw(buf)
        v = as_strided(raw[self.o0:], shape=(self.n, self.L), strides=(self.stride * buf.itemsize, buf.itemsize))
        return v if raw is buf else v.view(buf.dtype)

    def read(self, buf: np.ndarray) -> np.ndarray:
        v = self.view(buf)
        return v if v is not None else _windows(buf, self.L)[self.offs]


def _raw(buf: np.ndarray) -> np.ndarray:
    """``buf``, or its bytes as unsigned ints of its width when numpy's stride tricks cannot carry its
    dtype (they go through the array interface, which reads ml_dtypes' float8_e5m2, typestr
    ``'<f1'``, as no dtype at all)."""
    return buf if _interface_keeps(buf.dtype) else buf.view(f"u{buf.itemsize}")


@functools.cache
def _interface_keeps(dt: np.dtype) -> bool:
    try:
        np.dtype(dt.str)
    except TypeError:
        return False
    return True


def _windows(buf: np.ndarray, L: int, writeable: bool = False) -> np.ndarray:
    """``sliding_window_view(buf, L)``, for any dtype (:func:`_raw`)."""
    raw = _raw(buf)
    win = sliding_window_view(raw, L, writeable=writeable)
    return win if raw is buf else win.view(buf.dtype)


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
    dview = dst.view(dst_buf)
    if dview is not None:
        if fn is None:
            dview[...] = vals
        else:
            fn(dview, vals, out=dview)
    else:
        win = _windows(dst_buf, L, writeable=True)
        win[dst.offs] = vals if fn is None else fn(win[dst.offs], vals)


def group_indices(keys: np.ndarray) -> list[np.ndarray]:
    """Indices of equal ``keys``, each group in original order, groups by ascending key."""
    if not len(keys):
        return []
    order = np.argsort(keys, kind="stable")
    ks = keys[order]
    cuts = np.flatnonzero(ks[1:] != ks[:-1]) + 1
    return np.split(order, cuts)


def any_overlap(starts: np.ndarray, lens: np.ndarray) -> bool:
    """Whether any two of the ranges ``[start, start + len)`` overlap."""
    if len(starts) < 2:
        return False
    o = np.argsort(starts, kind="stable")
    s, e = starts[o], starts[o] + lens[o]
    return bool((s[1:] < np.maximum.accumulate(e)[:-1]).any())


def hits(lo: int, hi: int, starts: np.ndarray, lens: np.ndarray) -> bool:
    """Whether ``[lo, hi)`` overlaps any of the ranges."""
    return bool(((starts < hi) & (starts + lens > lo)).any()) if len(starts) else False


def copy_runs(src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> list[tuple[Rows, Rows]]:
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
    return [(Rows(src[g], int(lens[g[0]])), Rows(dst[g], int(lens[g[0]]))) for g in group_indices(lens)]


class Space:
    """Where the members hosted here keep their chunks for one schedule: ``size`` elements, member
    ``slots[pos]`` in ``base[slot] .. base[slot+1]``, chunk ``c`` of a member at ``offset(slot, c)``.

    A member keeps the chunks it ends with first, in output order (so that its output is one
    range), then the other chunks it holds at some point, by id; if that would cut a run of chunks
    that one transfer moves, all its chunks go by id instead (a run is then always one range).
    all_gather, reduce_scatter and all_reduce members hold every chunk (reduce_scatter: by id);
    the other kinds only the chunks they start with, send, receive or end with.

    ``touched`` lists the chunk runs that transfers move from or to hosted members, as arrays
    ``(slot, first chunk, count)``."""

    def __init__(self, sched: CollectiveSchedule, hosted: Sequence[int], touched: tuple[np.ndarray, ...]):
        self.sched, self.hosted = sched, list(hosted)
        self.slots = {pos: i for i, pos in enumerate(self.hosted)}
        elems = np.asarray(sched.chunk_bytes, np.int64) // sched.itemsize
        self.ce = np.zeros(sched.num_chunks + 1, np.int64)
        np.cumsum(elems, out=self.ce[1:])
        touched = tuple(np.asarray(x, np.int64) for x in touched)
        runs = _chunks_of_long_runs(elems, touched)
        self.full = sched.kind in ("all_gather", "reduce_scatter", "all_reduce")
        if self.full:
            self._lay_out_every_chunk(elems, runs)
        else:
            self._lay_out_held_chunks(elems, touched, runs)
        self._in = {pos: copy_runs(*self._piece_runs(i, sched.input_chunks(pos))) for pos, i in self.slots.items()}
        self._out = {pos: self._output_runs(pos) for pos in self.hosted}
        self.views = all(self._whole(pos) for pos in self.hosted)  # every output can be a view of work

    def _lay_out_every_chunk(self, elems: np.ndarray, runs: tuple[np.ndarray, ...]) -> None:
        """Every member holds every chunk: by id, or in output (layout) order when no run is cut."""
        sched, nc = self.sched, self.sched.num_chunks
        _, run_a, run_c = runs
        self.T = int(self.ce[-1])
        self.size = len(self.hosted) * self.T
        self.base = np.arange(len(self.hosted) + 1, dtype=np.int64) * self.T
        self.rel = self.ce[:-1]
        if sched.kind != "reduce_scatter" and sched.layout:  # every member ends with all chunks, in layout order
            chunks = sched.output_chunks(0)
            assert chunks is not None   # why: not a reduce-scatter, so member 0 ends with every chunk
            order = np.asarray([c for c in chunks if elems[c]], np.int64)
            rel = np.zeros(nc, np.int64)
            rel[order] = np.cumsum(elems[order]) - elems[order]
            ids = np.flatnonzero(elems)  # an empty chunk sits where the next non-empty one does
            nxt = np.searchsorted(ids, np.arange(nc))
            rel = np.where(elems > 0, rel, np.append(rel[ids], self.T)[nxt])
            if np.array_equal(rel[run_c], rel[run_a] + self.ce[run_c] - self.ce[run_a]):
                self.rel = rel

    def _lay_out_held_chunks(self, elems: np.ndarray, touched: tuple[np.ndarray, ...],
                             runs: tuple[np.ndarray, ...]) -> None:
        """Each member holds the chunks it starts with, moves or ends with: output first, else by id."""
        sched, nc, h = self.sched, self.sched.num_chunks, len(self.hosted)
        slot, a, _ = touched
        run_s, run_a, run_c = runs
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
        self.off = _offsets(elems[kc], kslot, _rank_outputs_first(keys, kslot, outs, nc, h))
        if not np.array_equal(self.offset(run_s, run_c), self.offset(run_s, run_a) + self.ce[run_c] - self.ce[run_a]):
            self.off = _offsets(elems[kc], kslot, np.arange(len(keys), dtype=np.int64))  # by id
        self.size = int(self.off[-1])
        sizes_by_slot = np.bincount(kslot, weights=elems[kc], minlength=h).astype(np.int64)
        self.base = np.concatenate(([0], np.cumsum(sizes_by_slot)))

    def offset(self, slot: np.ndarray, chunk: np.ndarray) -> np.ndarray:
        slot, chunk = np.asarray(slot, np.int64), np.asarray(chunk, np.int64)
        if self.full:
            return slot * self.T + self.rel[chunk]
        return self.off[np.searchsorted(self.keys, slot * self.sched.num_chunks + chunk)]

    def _piece_runs(self, slot: int, chunks: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where ``chunks`` sit in a member's own buffer (in order) and in the work buffer, and their lengths."""
        c = np.asarray(chunks, np.int64)
        lens = self.ce[c + 1] - self.ce[c]
        pos = np.cumsum(lens) - lens
        return pos, self.offset(np.full(len(c), slot), c), lens

    def _output_runs(self, pos: int) -> list[tuple[Rows, Rows]] | None:
        """Copy runs from the work buffer to member ``pos``'s output (``None``: its output is zeros)."""
        chunks = self.sched.output_chunks(pos)
        if chunks is None:
            return None
        src, dst, lens = self._piece_runs(self.slots[pos], chunks)
        return copy_runs(dst, src, lens)

    def start(self, local: Mapping[int, np.ndarray], dtype: np.dtype, work: np.ndarray | None = None) -> np.ndarray:
        """A work buffer (fresh, or ``work``) holding every hosted member's input."""
        work = np.empty(self.size, dtype) if work is None else work
        for pos, runs in self._in.items():
            buf = local[pos]
            for a, b in runs:
                move(work, b, buf, a)
        return work

    def _whole(self, pos: int) -> bool:
        """Whether member ``pos``'s output is one range of the work buffer, at least half its part."""
        runs = self._out[pos]
        n = self.sched.output_nbytes // self.sched.itemsize
        slot = self.slots[pos]
        if runs is None or len(runs) != 1:
            return n == 0 and runs is not None
        o = runs[0][1]
        return o.n == 1 and o.o0 == 0 and o.L == n and 2 * n >= self.base[slot + 1] - self.base[slot]

    def output(self, work: np.ndarray, pos: int, dtype: np.dtype, view_ok: bool = True) -> np.ndarray:
        """Member ``pos``'s output: a fresh array (or, if ``view_ok``, a view of ``work`` when it is
        one range of it)."""
        sched = self.sched
        runs = self._out[pos]
        n = sched.output_nbytes // sched.itemsize
        if runs is None:
            return np.zeros(n, dtype)
        if self._whole(pos) and n:
            o = runs[0][0].o0
            out = work[o:o + n]  # the member's output is one range of work
            return out if view_ok else out.copy()
        out = np.empty(n, dtype)
        for w, ow in runs:
            move(out, ow, work, w)
        return out


def _chunks_of_long_runs(elems: np.ndarray, touched: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """Every non-empty chunk of the touched runs of several chunks: ``(slot, first chunk of its run,
    chunk)`` arrays (a layout must keep each such run one range)."""
    slot, a, k = touched
    multi = k > 1
    ka = k[multi]
    run_a = np.repeat(a[multi], ka)
    run_s = np.repeat(slot[multi], ka)
    run_c = run_a + (np.arange(ka.sum()) - np.repeat(np.cumsum(ka) - ka, ka))
    nonempty = elems[run_c] > 0
    return run_s[nonempty], run_a[nonempty], run_c[nonempty]


def _rank_outputs_first(keys: np.ndarray, kslot: np.ndarray, outs: list[np.ndarray], nc: int,
                        h: int) -> np.ndarray:
    """Per key ``slot * nc + chunk``, its place in its member's part: output chunks first, in output
    order, then the others by id."""
    rank = np.arange(len(keys), dtype=np.int64)
    out_keys = np.concatenate([i * nc + o for i, o in enumerate(outs)] + [np.zeros(0, np.int64)])
    out_rank = np.concatenate([np.arange(len(o)) for o in outs] + [np.zeros(0, np.int64)])
    n_out = np.array([len(o) for o in outs] + [0], np.int64)
    o = np.argsort(out_keys)
    is_out = np.isin(keys, out_keys)
    rank[is_out] = out_rank[o][np.searchsorted(out_keys[o], keys[is_out])]
    rest = np.flatnonzero(~is_out)
    first = np.searchsorted(kslot[rest], np.arange(h + 1))
    rank[rest] = n_out[kslot[rest]] + np.arange(len(rest)) - first[kslot[rest]]
    return rank


def _offsets(sizes: np.ndarray, kslot: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Element offset of each key when the keys are laid out by slot, then by ``rank``; the total last."""
    seq = np.lexsort((rank, kslot))
    s = sizes[seq]
    off = np.empty(len(sizes) + 1, np.int64)
    off[seq] = np.cumsum(s) - s
    off[-1] = int(s.sum())
    return off
