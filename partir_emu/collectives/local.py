"""Run a :class:`CollectiveSchedule` in one process, moving data exactly as it says.

This is the executor of the in-process mesh. ``reference`` gives the direct
numpy meaning of each collective, for tests. The helpers below (input checks,
initial state, applying a received chunk, assembling the output) are shared
with the MPI executor, so both perform the same arithmetic in the same order.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

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

    Returns fresh output arrays; the inputs are not modified.
    """
    fn = reduce_fn(op)
    if len(buffers) != schedule.p:
        raise CollectiveError(f"{schedule.describe()}: got {len(buffers)} buffers for {schedule.p} members")
    dtype = buffers[0].dtype if buffers and isinstance(buffers[0], np.ndarray) else None
    bufs = [check_buffer(schedule, i, b, dtype) for i, b in enumerate(buffers)]
    state = [initial_state(schedule, i, b) for i, b in enumerate(bufs)]
    for si, step in enumerate(schedule.steps):
        runs = [run_chunks(schedule, t) for t in step.transfers]
        try:
            payloads = [[state[t.src][c] for c in cs] for t, cs in zip(step.transfers, runs)]
        except (KeyError, IndexError):
            raise CollectiveError(f"{schedule.describe()}: step {si} sends a chunk its source does not hold; "
                                  "check the schedule with validate_schedule") from None
        for t, cs, v in zip(step.transfers, runs, payloads):
            apply_transfer(state[t.dst], cs, v, t.reduce, fn)
    return [assemble_output(schedule, i, s, dtype) for i, s in enumerate(state)]


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
