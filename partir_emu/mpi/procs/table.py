"""The process table, read from ``/proc``: parents, descendants and identities (pid plus start
time, which survives pid reuse) of the processes an MPI launch starts, and what files they hold.

Linux only, standard library only: the launcher, the sentinel and the ranks use it without
importing mpi4py or jax.
"""
from __future__ import annotations

import os


def proc_table() -> dict[int, int]:
    """pid → ppid of every process (from /proc)."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            pp = parent_of(int(d))
            if pp is not None:
                out[int(d)] = pp
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, ...)."""
    kids: dict[int, list[int]] = {}
    for p, pp in proc_table().items():
        kids.setdefault(pp, []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            st = f.read()
        return int(st[st.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): with its pid, an identity that
    survives pid reuse. None for a process that is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def is_alive(pid: int) -> bool:
    """``pid`` runs (a zombie has exited: it only waits for its parent to reap it)."""
    return start_time(pid) is not None


def holds_file(pid: int, path: str | os.PathLike) -> bool:
    """Does process ``pid`` have ``path`` open?"""
    want = os.path.realpath(path)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == want:
                return True
        except OSError:
            continue
    return False


def cmdline_has(pid: int, marker: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return marker.encode() in f.read()
    except OSError:
        return False
