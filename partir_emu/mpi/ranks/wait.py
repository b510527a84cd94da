"""Waiting for MPI requests without a blocking MPI call: :func:`wait` (the collective executors) and
:func:`wait_all` (everything else a rank waits for: agreement checks, stats, the session's calls).

MPICH busy-polls inside a blocking wait, which starves the other ranks on an
oversubscribed box, and it progresses a request only inside a test. So
:func:`wait` tests the requests back to back for a short while (a small message
from a peer that is running arrives within microseconds, with no system call in
its way), then sleeps ``POLL_S`` between tests (ranks that wait leave the cores
to those that work), up to a timeout that raises :class:`CollectiveError` naming
what was awaited. The back-to-back phase lasts ``TIGHT_S`` when the job has more
ranks than this machine has cores, ``FIT_SPIN_S`` when every rank can have a core
of its own (then polling starves nobody, and a sleep would only add latency).

Measured (8 and 16 ranks on 2 loaded cores, ring and recursive all_reduce, 16 KiB–2 MiB,
interleaved): yielding the CPU between tests (``sched_yield``) for the first 2 ms made calls
1.5–4x slower than sleeping at once: the yielding ranks keep taking turns on the cores that the
ranks with work need.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from mpi4py import MPI

from partir_emu.errors import CollectiveError, EmulationError

TIGHT_S = 0.00002     # test back to back this long first (more ranks than cores) ...
FIT_SPIN_S = 0.002    # ... or this long (every rank of the job fits on a core of this machine)
POLL_S = 0.0001    # then sleep this long between tests (wait_all: the first sleep; it grows ×1.5 per poll ...)
POLL_MAX_S = 0.001  # ... up to this: a long wait costs few wake-ups, a short one little latency
DEFAULT_TIMEOUT_S = 300.0

_testall = MPI.Request.Testall
_monotonic = time.monotonic
_spin_s: list[float] = []   # the back-to-back phase of this process, decided on the first wait


def spin_s() -> float:
    """How long :func:`wait` tests back to back before it sleeps (see the module docstring); the
    job's ranks are counted in ``COMM_WORLD`` (a local query), the cores in this process's affinity."""
    if not _spin_s:
        _spin_s.append(FIT_SPIN_S if MPI.COMM_WORLD.Get_size() <= len(os.sched_getaffinity(0)) else TIGHT_S)
    return _spin_s[0]


def wait(reqs: list[MPI.Request], statuses: list[MPI.Status] | None, timeout_s: float | None,
         what: Callable[[], str]) -> None:
    """Test ``reqs`` until all complete (filling ``statuses`` if given); CollectiveError on timeout
    or MPI failure, with ``what()`` in the message."""
    if not reqs:
        return
    try:
        if _testall(reqs, statuses):
            return
        start = now = _monotonic()
        tight_end = start + (_spin_s[0] if _spin_s else spin_s())
        while now < tight_end:
            if _testall(reqs, statuses):
                return
            now = _monotonic()
        deadline = None if timeout_s is None else start + timeout_s
        while not _testall(reqs, statuses):
            if deadline is not None and _monotonic() > deadline:
                cancel(reqs)
                raise CollectiveError(f"timed out after {timeout_s} s in {what()}: a participant is missing or "
                                      "runs a different collective; check that all ranks run the same program")
            time.sleep(POLL_S)
    except MPI.Exception as e:
        raise CollectiveError(f"MPI failed in {what()}: {e}; the ranks probably disagree on the collective") from e


def cancel(reqs: list[MPI.Request]) -> None:
    """Cancel what is pending and give it a moment to complete, so no request leaks into MPI_Finalize."""
    for r in reqs:
        if r != MPI.REQUEST_NULL:
            try:
                r.Cancel()
            except MPI.Exception:  # an inactive persistent request has nothing pending to cancel
                pass
    end = _monotonic() + 1.0
    while not _testall(reqs) and _monotonic() < end:
        time.sleep(POLL_S)


def wait_all(reqs: Sequence[MPI.Request], timeout_s: float | None, what: Callable[[], str] | str, *,
             bulk: bool = False) -> None:
    """Complete ``reqs`` by ``Test`` + short sleeps (never a blocking wait: MPICH busy-polls in
    one, which starves the other ranks on an oversubscribed box).

    The sleep grows from 0.1 ms to 1 ms, so hundreds of ranks waiting for a slow one do not
    flood the box with wake-ups. ``bulk=True`` keeps it at 0.1 ms: a large message between
    ranks advances one shared-memory chunk per Test on each side, so a longer sleep would
    throttle it (1 MB per rank into a gather over 16 ranks: 0.4 s at 0.1 ms, 9 s at 5 ms)."""
    reqs = list(reqs)
    if not reqs:
        return
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    nap = POLL_S
    grow = 1.0 if bulk else 1.5
    while not MPI.Request.Testall(reqs):
        if deadline is not None and time.monotonic() > deadline:
            w = what() if callable(what) else what
            raise EmulationError(f"timed out after {timeout_s:g} s waiting for {w}: a rank is missing or stuck")
        time.sleep(nap)
        nap = min(nap * grow, POLL_MAX_S)


def bcast_bytes(comm: MPI.Intracomm, data: bytes | None, timeout_s: float | None, what: str) -> bytes:
    """Rank 0's ``data`` on every rank (its length, then the bytes, over ``Ibcast``), every wait
    bounded by ``timeout_s``; the other ranks pass None."""
    import numpy as np  # why here: the module's waits need none of numpy
    n = np.array([len(data) if data is not None else 0], np.int64)
    wait_all([comm.Ibcast([n, MPI.INT64_T], root=0)], timeout_s, f"{what} (length) from rank 0")
    buf = np.frombuffer(data, np.uint8).copy() if data is not None else np.empty(int(n[0]), np.uint8)
    if n[0]:
        wait_all([comm.Ibcast([buf, MPI.BYTE], root=0)], timeout_s, f"{what} from rank 0", bulk=True)
    return buf.tobytes()
