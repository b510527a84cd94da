"""The step planner shared by the schedule executors: what one process does in each step.

Every member hosted here keeps all chunks it ever holds in one flat *work* buffer per job (laid
out by :class:`~partir_emu.collectives.workspace.Space`; a run of chunks is one contiguous range).
A :class:`Plan` is made once per set of jobs ``(schedule, rank of each position, positions hosted
here)`` and says, per step, which ranges go out to which rank (one message per peer, straight from
the work buffer when it is one range), which come in (into a scratch buffer ``R``, or straight into
the work buffer when nothing else reads or writes that range in the step), which are copied
between members of this process (snapshotted into ``R`` before anything is applied), and how the
received ranges are applied: ``acc = op(acc, received)`` or a store, grouped into one numpy call
per run length when the destination ranges of the step do not overlap, one call per transfer in
schedule order otherwise. The arithmetic per element is the schedule's, in its order, so every
executor gives the same bits.

The in-process executor (:mod:`partir_emu.collectives.local`) runs a plan with every member hosted
here (rank 0, no messages); the MPI executor (:mod:`partir_emu.mpi.ranks.collectives`) posts its messages.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from partir_emu.collectives.schedule import CollectiveSchedule
from partir_emu.collectives.workspace import Rows, Space, align, any_overlap, group_indices, hits, move

PlacedJob = tuple[CollectiveSchedule, np.ndarray, Sequence[int]]   # (schedule, rank of each position, hosted positions)
Parts = list[tuple[int, "_Transfers", int]]                   # (job, transfers, byte offset in the message)
Applies = dict[int, list[tuple[np.ndarray, ...]]]             # per job: (ti, d_off, L, red, source offset, in work?)


class StepPlan:
    """What this process does in one step (see the module docstring)."""

    __slots__ = ("step", "recvs", "sends", "packs", "gathers", "applies")

    def __init__(self, step: int):
        self.step = step
        self.recvs: list[tuple[int, int, int, int]] = []        # (peer, nbytes, job or -1 for R, byte offset)
        self.sends: list[tuple[int, int, int, int]] = []        # (peer, nbytes, job or -1 for S, byte offset)
        self.packs: list[tuple[int, Rows, Rows]] = []           # (job, rows of work, rows of S)
        self.gathers: list[tuple[int, Rows, Rows]] = []         # (job, rows of work, rows of R)
        self.applies: list[tuple[int, bool, Rows, bool, Rows]] = []  # (job, reduce, source rows, in work?, rows of work)

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
    ti: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    sr: np.ndarray
    dr: np.ndarray
    s_off: np.ndarray
    d_off: np.ndarray
    L: np.ndarray
    red: np.ndarray

    def __init__(self, itemsize: int, *arrays: np.ndarray):
        self.itemsize = itemsize
        for f, a in zip(self.FIELDS, arrays):
            setattr(self, f, a)

    def __getitem__(self, idx) -> _Transfers:
        return _Transfers(self.itemsize, *(getattr(self, f)[idx] for f in self.FIELDS))

    def __len__(self) -> int:
        return len(self.ti)


def _job_transfers(sched: CollectiveSchedule, ranks: np.ndarray, hosted: Sequence[int],
                   me: int) -> tuple[Space, _Transfers, np.ndarray]:
    """The work-buffer layout of one job on rank ``me``, the transfers that touch it, and the first
    of those transfers in each step."""
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
    t = _Transfers(sched.itemsize, hit - tab.ptr[step], src, dst, ranks[src], ranks[dst],
                   np.where(s_in, space.offset(np.maximum(s_slot, 0), a), -1),
                   np.where(d_in, space.offset(np.maximum(d_slot, 0), a), -1),
                   space.ce[a + k] - space.ce[a], tab.reduce[hit])
    return space, t, np.searchsorted(step, np.arange(tab.num_steps + 1))


class Plan:
    """The steps of one or more jobs as run by rank ``me`` (see the module docstring).
    ``spaces[j]`` is job ``j``'s work-buffer layout; ``steps`` the steps in which this rank does
    anything; ``rbytes``/``sbytes`` the scratch bytes to receive into and send from."""

    def __init__(self, jobs: Sequence[PlacedJob], me: int):
        self.me = me
        self.spaces: list[Space] = []
        self.jobs: list[tuple[_Transfers, np.ndarray]] = []  # (transfers, first row of each step)
        for sched, ranks, hosted in jobs:
            space, t, cuts = _job_transfers(sched, ranks, hosted, me)
            self.spaces.append(space)
            self.jobs.append((t, cuts))
        self.steps: list[StepPlan] = []
        self.rbytes = self.sbytes = 0
        for s in range(max((len(cuts) - 1 for _, cuts in self.jobs), default=0)):
            sp = self._step(s)
            if sp is not None:
                self.steps.append(sp)
        a = math.lcm(16, *(sched.itemsize for sched, _, _ in jobs))
        self.rbytes, self.sbytes = align(self.rbytes, a), align(self.sbytes, a)
        # peers per job, for the header exchange
        self.peers_out = [sorted(set(t.dr[(t.sr == me) & (t.dr != me)].tolist())) for t, _ in self.jobs]
        self.peers_in = [sorted(set(t.sr[(t.dr == me) & (t.sr != me)].tolist())) for t, _ in self.jobs]
        self._trace: dict[int, list[tuple[int, int, int, int]]] = {}   # step -> rows, made on first use

    def _rows_of_step(self, s: int) -> list[_Transfers | None]:
        return [t[int(cuts[s]):int(cuts[s + 1])] if s + 1 < len(cuts) else None for t, cuts in self.jobs]

    def _messages(self, rows: list[_Transfers | None], incoming: bool) -> dict[int, tuple[Parts, int]]:
        """Per peer rank (ascending), the parts of its message (jobs in order, each part aligned)
        and the message size in bytes."""
        me = self.me
        parts: dict[int, Parts] = {}
        for j, r in enumerate(rows):
            if r is None or not len(r):
                continue
            idx = np.flatnonzero((r.dr == me) & (r.sr != me)) if incoming else np.flatnonzero((r.sr == me) & (r.dr != me))
            peer_of = (r.sr if incoming else r.dr)[idx]
            for g in group_indices(peer_of):
                parts.setdefault(int(peer_of[g[0]]), []).append((j, r[idx[g]], 0))
        out = {}
        for peer, ps in sorted(parts.items()):
            nb, laid = 0, []
            for j, t, _ in ps:
                start = align(nb, t.itemsize) if nb else 0
                laid.append((j, t, start))
                nb = start + int(t.L.sum()) * t.itemsize
            out[peer] = (laid, nb)
        return out

    def _step(self, s: int) -> StepPlan | None:
        """The plan of step ``s`` (``None`` if this rank has nothing to do in it)."""
        rows = self._rows_of_step(s)
        if not any(r is not None and len(r) for r in rows):
            return None
        sp = StepPlan(s)
        seq, reads = self._hazards(rows)
        applies: Applies = {}
        rb = self._plan_receives(sp, rows, seq, reads, applies)
        rb = self._plan_local_copies(sp, rows, seq, applies, rb)
        _plan_applies(sp, applies, seq)
        sb = self._plan_sends(sp, rows)
        self.rbytes, self.sbytes = max(self.rbytes, rb), max(self.sbytes, sb)
        return sp

    def _hazards(self, rows: list[_Transfers | None]) -> tuple[list[bool], list[tuple[np.ndarray, np.ndarray]]]:
        """Per job: must the step apply one transfer at a time (its destination ranges overlap)?
        And the ranges ``(offsets, lengths)`` it reads from the work buffer."""
        me = self.me
        seq, reads = [], []
        for r in rows:
            if r is None:
                seq.append(False)
                reads.append((np.zeros(0, np.int64),) * 2)
                continue
            inc, out = r.dr == me, r.sr == me
            seq.append(any_overlap(r.d_off[inc], r.L[inc]))
            reads.append((r.s_off[out], r.L[out]))
        return seq, reads

    def _plan_receives(self, sp: StepPlan, rows: list[_Transfers | None], seq: list[bool],
                       reads: list[tuple[np.ndarray, np.ndarray]], applies: Applies) -> int:
        """Incoming messages: into R, or straight into the work buffer when nothing else in the step
        reads or writes that range (one job, stores only, one contiguous range). Returns R's bytes."""
        rb = 0
        for peer, (parts, nb) in self._messages(rows, incoming=True).items():
            if len(parts) == 1:
                j, t, _ = parts[0]
                d, L = t.d_off, t.L
                lo, hi = int(d[0]), int(d[-1] + L[-1])
                if not seq[j] and not t.red.any() and (d[1:] == d[:-1] + L[:-1]).all() and not hits(lo, hi, *reads[j]):
                    sp.recvs.append((peer, nb, j, lo * t.itemsize))
                    continue
            base = align(rb, max(t.itemsize for _, t, _ in parts))
            sp.recvs.append((peer, nb, -1, base))
            for j, t, start in parts:
                roff = (base + start) // t.itemsize + np.cumsum(t.L) - t.L
                applies.setdefault(j, []).append((t.ti, t.d_off, t.L, t.red, roff, np.zeros(len(t), bool)))
            rb = base + nb
        return rb

    def _plan_local_copies(self, sp: StepPlan, rows: list[_Transfers | None], seq: list[bool],
                           applies: Applies, rb: int) -> int:
        """Copies between members hosted here: straight from the source member's range when nothing
        in the step writes there, else snapshotted into R first. Returns R's bytes."""
        me = self.me
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
            at = align(rb, t.itemsize) // t.itemsize   # where in R (elements) the snapshots go
            roff = np.zeros(len(t), np.int64)
            for g in group_indices(t.L * 2 + t.red):
                n, Lg = len(g), int(t.L[g[0]])
                roff[g] = at + np.arange(n) * Lg
                sp.gathers.append((j, Rows(t.s_off[g], Lg), Rows(roff[g], Lg)))
                at += n * Lg
            rb = at * t.itemsize
            applies.setdefault(j, []).append((t.ti, t.d_off, t.L, t.red, roff, np.zeros(len(t), bool)))
        return rb

    def _plan_sends(self, sp: StepPlan, rows: list[_Transfers | None]) -> int:
        """Outgoing messages, laid out as the receiver expects: straight from the work buffer when
        one range, else packed into S. Returns S's bytes."""
        sb = 0
        for peer, (parts, nb) in self._messages(rows, incoming=False).items():
            if len(parts) == 1:
                j, t, _ = parts[0]
                if (t.s_off[1:] == t.s_off[:-1] + t.L[:-1]).all():
                    sp.sends.append((peer, nb, j, int(t.s_off[0]) * t.itemsize))
                    continue
            base = align(sb, max(t.itemsize for _, t, _ in parts))
            sp.sends.append((peer, nb, -1, base))
            for j, t, start in parts:
                soff = (base + start) // t.itemsize + np.cumsum(t.L) - t.L
                for g in group_indices(t.L):
                    Lg = int(t.L[g[0]])
                    sp.packs.append((j, Rows(t.s_off[g], Lg), Rows(soff[g], Lg)))
            sb = base + nb
        return sb

    def trace_rows(self, sp: StepPlan, devices: Sequence[Sequence[int]]) -> list[tuple[int, int, int, int]]:
        """``(step, src device, dst device, nbytes)`` of every transfer this rank sends in step ``sp``
        (copies included), jobs in order, transfers in schedule order (``devices[j]``: job ``j``'s
        devices by position; the same for every call on this plan)."""
        out = self._trace.get(sp.step)
        if out is None:
            out = []
            for r, devs in zip(self._rows_of_step(sp.step), devices):
                if r is None:
                    continue
                t = r[np.flatnonzero(r.sr == self.me)]
                dv = np.asarray(devs, np.int64)
                out += zip([sp.step] * len(t), dv[t.src].tolist(), dv[t.dst].tolist(), (t.L * t.itemsize).tolist())
            self._trace[sp.step] = out
        return out


def _plan_applies(sp: StepPlan, applies: Applies, seq: list[bool]) -> None:
    """Applying what came in: one numpy call per (length, reduce, source), or per transfer in
    schedule order when the job's destination ranges overlap."""
    for j in sorted(applies):
        ti, d_off, L, red, soff, in_work = (np.concatenate(x) for x in zip(*applies[j]))
        if seq[j]:
            for i in np.argsort(ti, kind="stable"):
                Li = int(L[i])
                sp.applies.append((j, bool(red[i]), Rows(soff[i:i + 1], Li), bool(in_work[i]), Rows(d_off[i:i + 1], Li)))
        else:
            for g in group_indices((L * 2 + red) * 2 + in_work):
                Lg = int(L[g[0]])
                sp.applies.append((j, bool(red[g[0]]), Rows(soff[g], Lg), bool(in_work[g[0]]), Rows(d_off[g], Lg)))
