"""A collective schedule's messages as arrays: its transfers merged by step and ``(src, dst)``.

What every contention model reads of a schedule (:mod:`.contention` prices steps from them,
:mod:`.concurrency` shares links between collectives in flight, :mod:`.async_steps` follows members
that do not wait for each other). Merging is done once per schedule and kept for the last schedules
seen; a schedule too large for whole-table temporaries is merged step by step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partir_emu.collectives.schedule import CollectiveSchedule


@dataclass(frozen=True)
class Messages:
    """A schedule's messages (its transfers merged by step and ``(src, dst)``), flat and by step:
    step ``s`` is ``ptr[s]:ptr[s+1]``; ``pair = src * p + dst`` ascending inside a step."""

    p: int
    ptr: np.ndarray            # int64 [steps + 1]
    pair: np.ndarray           # int64
    nbytes: np.ndarray         # float64
    shape: np.ndarray | None = None   # int64 [steps]: steps with one id have the same pairs (if known)

    @property
    def num_steps(self) -> int:
        return len(self.ptr) - 1


_MESSAGES: dict[int, tuple[CollectiveSchedule, Messages]] = {}
_MAX_MESSAGES = 256               # schedules whose messages are kept ...
_MAX_MESSAGE_ROWS = 1 << 24       # ... holding at most this many messages in all (256 MiB)
_held = [0]


def schedule_messages(sched: CollectiveSchedule) -> Messages:
    """The messages of every step of ``sched`` (``CollectiveSchedule.messages`` as arrays). Kept for the
    last schedules seen (by identity: ``build_schedule`` returns the same object for the same request,
    and a placement search prices one schedule on many placements)."""
    hit = _MESSAGES.get(id(sched))
    if hit is not None and hit[0] is sched:
        return hit[1]
    msgs = _messages(sched)
    if len(_MESSAGES) >= _MAX_MESSAGES or _held[0] + len(msgs.pair) > _MAX_MESSAGE_ROWS:
        _MESSAGES.clear()
        _held[0] = 0
    _MESSAGES[id(sched)] = (sched, msgs)      # the schedule is kept alive with it: its id stays its own
    _held[0] += len(msgs.pair)
    return msgs


_WHOLE_TABLE = 1 << 22       # transfers up to which the table is merged in one pass (else step by step)


def _messages(sched: CollectiveSchedule) -> Messages:
    p = sched.p
    tab = sched.table()
    S = tab.num_steps
    if len(tab) > _WHOLE_TABLE:
        return _messages_by_step(sched)
    if not len(tab):
        return Messages(p, np.zeros(S + 1, np.int64), np.zeros(0, np.int64), np.zeros(0))
    key = (tab.step_of() * p + tab.src.astype(np.int64)) * p + tab.dst
    nbytes = tab.nbytes.astype(np.float64)
    if len(key) < 2 or bool((key[1:] > key[:-1]).all()):
        uniq, nb = key, nbytes                # one transfer per message, in order (most schedules): no sort
    else:
        uniq, inv = np.unique(key, return_inverse=True)
        nb = np.bincount(inv.ravel(), weights=nbytes, minlength=len(uniq)).astype(np.float64)
    step = uniq // (p * p)
    ptr = np.searchsorted(step, np.arange(S + 1), side="left").astype(np.int64)
    return Messages(p, ptr, uniq % (p * p), nb)


def _messages_by_step(sched: CollectiveSchedule) -> Messages:
    """:func:`_messages` one step at a time, as ``des.plans.step_plans`` reads a large table: the merge of
    each distinct step shape (its ``(src, dst)`` columns) is done once, bytes come from the chunk
    sizes, and the output is filled in place (a 4096-member ring has 33 M transfers: whole-table
    temporaries would be about 1 GB)."""
    p = sched.p
    tab = sched.table()
    tptr = tab.ptr.tolist()
    prefix = np.concatenate(([0], np.cumsum(np.asarray(sched.chunk_bytes, dtype=np.int64))))
    shapes: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
    per_step = []
    for s in range(tab.num_steps):
        src, dst = tab.src[tptr[s]:tptr[s + 1]], tab.dst[tptr[s]:tptr[s + 1]]
        key = src.tobytes() + dst.tobytes()
        hit = shapes.get(key)
        if hit is None:
            uniq, inv = np.unique(src.astype(np.int64) * p + dst, return_inverse=True)
            hit = shapes[key] = (uniq, inv.ravel())
        per_step.append(hit)
    ids = {id(u): i for i, (u, _) in enumerate(shapes.values())}
    shape = np.array([ids[id(u)] for u, _ in per_step], dtype=np.int64)
    ptr = np.concatenate(([0], np.cumsum([len(u) for u, _ in per_step]))).astype(np.int64)
    pair = np.empty(int(ptr[-1]), np.int64)
    nbytes = np.empty(int(ptr[-1]))
    for s, (uniq, inv) in enumerate(per_step):
        lo, hi = tptr[s], tptr[s + 1]
        c = tab.chunk[lo:hi].astype(np.int64)
        b = (prefix[c + tab.count[lo:hi]] - prefix[c]).astype(np.float64)
        pair[ptr[s]:ptr[s + 1]] = uniq
        nbytes[ptr[s]:ptr[s + 1]] = np.bincount(inv, weights=b, minlength=len(uniq))
    return Messages(p, ptr, pair, nbytes, shape)


__all__ = ["Messages", "schedule_messages"]
