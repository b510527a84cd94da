"""Running a :class:`~partir_emu.collectives.planner.Plan`'s steps over MPI.

Per step: post the receives, pack and post the sends, copy between local members, wait, check
the sizes received, apply (the planner says what each of these is). Two things keep the ranks
from waiting on each other more than the schedule needs:

- **Receives a step early.** While step ``i`` is in flight, the receives of step ``i + 1`` are
  already posted, so a peer that is ahead can deliver (and a large message can stream) while this
  rank still applies step ``i``. Step ``i``'s scratch buffer ``R`` is one of two, by step parity,
  so an early receive never lands where step ``i`` reads; a receive straight into the work buffer
  is posted early only when its range is disjoint from every range step ``i`` reads or writes
  (:meth:`StepRunner._early`), else at the start of its own step as before.
- **Persistent requests.** When a plan runs again with the same buffers and tags (the same
  collective re-run, as in a benchmark or a training loop with a fixed tag), its messages are
  MPI persistent requests (``Recv_init``/``Send_init``, started each step) instead of new
  ``Irecv``/``Isend`` calls: MPI and mpi4py check the arguments once. A work buffer that is fresh
  on every call (its outputs are handed out as views) keeps per-call requests.

Tags: step ``s`` of a call with ``tag_base`` uses ``tag_base + 1 + s`` (modulo the tag bound), so
an early receive can only match its own step's message.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
from mpi4py import MPI

from partir_emu.collectives.planner import Plan, StepPlan
from partir_emu.collectives.workspace import Rows
from partir_emu.errors import CollectiveError
from partir_emu.mpi.ranks.wait import cancel, wait

_BYTE = MPI.BYTE
Spans = dict[int, list[tuple[int, int]]]   # per job: byte ranges [lo, hi) of its work buffer


class StepRunner:
    """Runs one plan's steps on ``comm`` (see the module docstring); kept with the plan."""

    def __init__(self, plan: Plan, itemsizes: Sequence[int]):
        self.plan = plan
        steps = plan.steps
        self.statuses = [[MPI.Status() for _ in range(len(sp.recvs) + len(sp.sends))] for sp in steps]
        early = [[False] * len(steps[0].recvs)] if steps else []
        for prev, sp in zip(steps, steps[1:]):
            early.append(_early(prev, sp, itemsizes))
        self.early_idx = [[k for k, e in enumerate(m) if e] for m in early]
        self.late_idx = [[k for k, e in enumerate(m) if not e] for m in early]
        self._last_key: tuple | None = None
        self._persist_key: tuple | None = None
        self._persist: list[tuple[list, list]] | None = None   # per step: (recv, send) persistent requests or None

    def free(self) -> None:
        """Free the persistent requests (all inactive between calls)."""
        if self._persist is not None:
            for rp, spr in self._persist:
                for r in rp + spr:
                    if r is not None:
                        r.Free()
        self._persist = self._persist_key = self._last_key = None

    def run(self, comm: MPI.Comm, works: list[np.ndarray], fresh: Sequence[bool], rbufs: tuple[np.ndarray, np.ndarray],
            sbuf: np.ndarray, fn: np.ufunc, tag_base: int, tag_mod: int, timeout_s: float | None,
            what: Callable[[StepPlan], str], on_step: Callable[[StepPlan], None] | None) -> None:
        """Run every step. ``fresh[j]``: job ``j``'s work buffer is new on this call (no persistent
        requests into it); ``on_step(sp)`` is called before step ``sp`` (the message trace)."""
        steps = self.plan.steps
        wbytes = [w.view(np.uint8) for w in works]
        pers = self._persistent(comm, wbytes, fresh, rbufs, sbuf, tag_base, tag_mod)
        reqs: list = []
        nxt: list = [None] * len(steps[0].recvs) if steps else []
        try:
            for i, sp in enumerate(steps):
                if on_step is not None:
                    on_step(sp)
                tag = (tag_base + 1 + sp.step) % tag_mod
                rbuf = rbufs[i & 1]
                reqs = nxt
                p_recv, p_send = pers[i] if pers is not None else (None, None)
                for k in self.late_idx[i]:
                    reqs[k] = _post_recv(comm, sp.recvs[k], p_recv, k, rbuf, wbytes, tag)
                if sp.packs:
                    sp.pack(works, sbuf)
                for k, (peer, nb, j, off) in enumerate(sp.sends):
                    p = p_send[k] if p_send is not None else None
                    if p is not None:
                        p.Start()
                        reqs.append(p)
                    else:
                        reqs.append(comm.Isend([sbuf[off:off + nb] if j < 0 else wbytes[j][off:off + nb], _BYTE],
                                               dest=peer, tag=tag))
                if sp.gathers:
                    sp.gather_local(works, rbuf)
                nxt = []
                if i + 1 < len(steps):  # the next step's receives that may land now
                    sn = steps[i + 1]
                    nxt = [None] * len(sn.recvs)
                    if self.early_idx[i + 1]:
                        ntag, nrbuf = (tag_base + 1 + sn.step) % tag_mod, rbufs[(i + 1) & 1]
                        np_recv = pers[i + 1][0] if pers is not None else None
                        for k in self.early_idx[i + 1]:
                            nxt[k] = _post_recv(comm, sn.recvs[k], np_recv, k, nrbuf, wbytes, ntag)
                if reqs:
                    st = self.statuses[i]
                    wait(reqs, st, timeout_s, functools.partial(what, sp))
                    for (peer, nb, _, _), s in zip(sp.recvs, st):
                        if s.Get_count(_BYTE) != nb:
                            raise CollectiveError(f"{what(sp)}: rank {peer} sent {s.Get_count(_BYTE)} bytes, "
                                                  f"expected {nb}; the ranks disagree on the collective")
                if sp.applies:
                    sp.apply(works, rbuf, fn)
        except BaseException:
            pending = [r for r in list(reqs) + list(nxt) if r is not None]
            cancel(pending)   # nothing may stay posted into buffers this call is done with
            self.free()
            raise

    def _persistent(self, comm: MPI.Comm, wbytes: list[np.ndarray], fresh: Sequence[bool],
                    rbufs: tuple[np.ndarray, np.ndarray], sbuf: np.ndarray, tag_base: int,
                    tag_mod: int) -> list[tuple[list, list]] | None:
        """The persistent requests for these buffers and tags: made on the second call in a row
        with the same ones (a one-off call is not worth the set-up), reused after that."""
        key = (tag_base % tag_mod, rbufs[0].ctypes.data, rbufs[1].ctypes.data, sbuf.ctypes.data,
               tuple(None if f else w.ctypes.data for w, f in zip(wbytes, fresh)))
        if self._persist is not None and key == self._persist_key:
            return self._persist
        if key != self._last_key:
            self._last_key = key
            return None
        self.free()
        self._last_key = self._persist_key = key
        out = []
        for i, sp in enumerate(self.plan.steps):
            tag, rbuf = (tag_base + 1 + sp.step) % tag_mod, rbufs[i & 1]
            recv = [None if j >= 0 and fresh[j] else
                    comm.Recv_init([rbuf[off:off + nb] if j < 0 else wbytes[j][off:off + nb], _BYTE],
                                   source=peer, tag=tag) for peer, nb, j, off in sp.recvs]
            send = [None if j >= 0 and fresh[j] else
                    comm.Send_init([sbuf[off:off + nb] if j < 0 else wbytes[j][off:off + nb], _BYTE],
                                   dest=peer, tag=tag) for peer, nb, j, off in sp.sends]
            out.append((recv, send))
        self._persist = out
        return out


def _post_recv(comm: MPI.Comm, recv: tuple[int, int, int, int], persistent: list | None, k: int,
               rbuf: np.ndarray, wbytes: list[np.ndarray], tag: int) -> MPI.Request:
    p = persistent[k] if persistent is not None else None
    if p is not None:
        p.Start()
        return p
    peer, nb, j, off = recv
    return comm.Irecv([rbuf[off:off + nb] if j < 0 else wbytes[j][off:off + nb], _BYTE], source=peer, tag=tag)


def _early(prev: StepPlan, sp: StepPlan, itemsizes: Sequence[int]) -> list[bool]:
    """Which receives of ``sp`` may be posted while ``prev`` (the step before) is in flight: those
    into ``R`` (the other one of the pair), and those into a work buffer range ``prev`` leaves alone."""
    spans = _touched(prev, itemsizes)
    out = []
    for _, nb, j, off in sp.recvs:
        out.append(j < 0 or not any(lo < off + nb and off < hi for lo, hi in spans.get(j, ())))
    return out


def _touched(sp: StepPlan, itemsizes: Sequence[int]) -> Spans:
    """The byte ranges of each job's work buffer that step ``sp`` reads or writes (a span per
    group of rows: a superset, which only makes fewer receives early)."""
    spans: Spans = {}
    for _, nb, j, off in sp.recvs + sp.sends:
        if j >= 0:
            spans.setdefault(j, []).append((off, off + nb))
    for j, a, _ in sp.packs + sp.gathers:
        spans.setdefault(j, []).append(_span(a, itemsizes[j]))
    for j, _, a, in_work, b in sp.applies:
        spans.setdefault(j, []).append(_span(b, itemsizes[j]))
        if in_work:
            spans[j].append(_span(a, itemsizes[j]))
    return spans


def _span(rows: Rows, itemsize: int) -> tuple[int, int]:
    starts = rows.starts()
    return min(starts) * itemsize, (max(starts) + rows.L) * itemsize
