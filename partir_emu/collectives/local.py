"""Run a :class:`CollectiveSchedule` in one process, moving data exactly as it says.

This is the executor of the in-process mesh: every member of the group lives in
this process, so each transfer is a copy (or a reduction into the destination)
inside one work buffer, planned once per schedule by
:class:`~partir_emu.collectives.planner.Plan` — the same plan the MPI executor
runs, so both perform the same arithmetic in the same order and give the same
bits. :func:`check_buffer` is the input check both executors share.

The numpy meaning of each collective, for comparison, is
:func:`partir_emu.collectives.semantics.reference`.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from partir_emu.collectives.planner import Plan
from partir_emu.collectives.schedule import CollectiveSchedule
from partir_emu.collectives.semantics import reduce_fn
from partir_emu.errors import CollectiveError


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


def local_plan(schedule: CollectiveSchedule) -> Plan:
    """The plan of ``schedule`` with every member in this process (rank 0)."""
    return Plan([(schedule, np.zeros(schedule.p, np.int64), range(schedule.p))], 0)


def run_schedule(schedule: CollectiveSchedule, buffers: Sequence[np.ndarray], op: str = "sum", *,
                 plan: Plan | None = None) -> list[np.ndarray]:
    """Execute ``schedule`` on ``buffers`` (one flat array per member, in group order).

    Returns fresh output arrays; the inputs are not modified. Runs ``plan`` (by default
    :func:`local_plan`, made for this call; :class:`LocalExecutor` keeps plans between calls):
    per step, the values every transfer sends are copied out first, then applied in schedule
    order, whole runs of chunks per numpy call.
    """
    fn = reduce_fn(op)
    if len(buffers) != schedule.p:
        raise CollectiveError(f"{schedule.describe()}: got {len(buffers)} buffers for {schedule.p} members")
    dtype = buffers[0].dtype if buffers and isinstance(buffers[0], np.ndarray) else None
    bufs = [check_buffer(schedule, i, b, dtype) for i, b in enumerate(buffers)]
    plan = local_plan(schedule) if plan is None else plan
    space, dt = plan.spaces[0], bufs[0].dtype
    work = [space.start(dict(enumerate(bufs)), dt)]
    rbuf = np.empty(plan.rbytes, np.uint8)
    for sp in plan.steps:
        sp.gather_local(work, rbuf)
        sp.apply(work, rbuf, fn)
    return [space.output(work[0], pos, dt) for pos in range(schedule.p)]


class LocalExecutor:
    """Runs schedules in this process and keeps the plan of the last ``max_plans`` schedules it ran
    (a program runs the same collective for every group and every step). Its owner (e.g. a
    :class:`~partir_emu.runtime.local_mesh.LocalMesh`) decides how long plans live."""

    def __init__(self, max_plans: int = 256) -> None:
        self.max_plans = max_plans
        self._plans: OrderedDict[CollectiveSchedule, Plan] = OrderedDict()

    def plan(self, schedule: CollectiveSchedule) -> Plan:
        """The kept plan of ``schedule`` (made on first use)."""
        plan = self._plans.get(schedule)
        if plan is None:
            plan = self._plans[schedule] = local_plan(schedule)
            while len(self._plans) > self.max_plans:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(schedule)
        return plan

    def run(self, schedule: CollectiveSchedule, buffers: Sequence[np.ndarray], op: str = "sum") -> list[np.ndarray]:
        """:func:`run_schedule` with the kept plan."""
        return run_schedule(schedule, buffers, op, plan=self.plan(schedule))

    def clear(self) -> None:
        """Drop every kept plan."""
        self._plans.clear()
