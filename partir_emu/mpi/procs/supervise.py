"""Process supervision of one mpiexec launch: start, deadline, stop, clean up.

- :class:`Supervised` starts the command in a new session (so mpiexec and every rank it
  starts share one process group), captures its stdout/stderr to files in the work dir, and
  waits with a deadline. :meth:`Supervised.stop` sends SIGTERM to the group and to every
  process of the tree at once (hydra starts each rank in a session of its own, so the group
  alone misses them; ranks known only from their progress records are recognised by a marker
  in their command line, e.g. the run's work dir), then SIGKILL to what is left ``grace_s``
  later.
- :func:`cleanup_shm` removes MPICH's ``/dev/shm/mpich_shm_*`` segments a failed run left:
  those its ranks reported, and new ones that no live process maps.

Who died first (:class:`~partir_emu.mpi.deaths.DeathWatch`, hydra's exit codes) is
:mod:`partir_emu.mpi.deaths`.

Only the standard library: the launcher process imports neither mpi4py nor jax for this.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partir_emu.errors import EmulationError
from partir_emu.mpi.procs.table import cmdline_has, descendants, parent_of, proc_table, start_time

SHM_PREFIX = "/dev/shm/mpich_shm"
HWLOC_PREFIX = "/tmp/hydra_hwloc_xmlfile_"
HWLOC_SCAN_S = 0.25         # how often a waiting launcher looks for its proxies' hwloc files


def mpiexec_path() -> Path:
    """The venv's mpiexec (installed by ``pip install mpich``), else the one on PATH."""
    p = Path(sys.executable).parent / "mpiexec"
    if p.exists():
        return p
    found = shutil.which("mpiexec")
    if not found:
        raise EmulationError("no mpiexec next to the Python interpreter or on PATH; install MPI with "
                             "`pip install mpich mpi4py` in this environment")
    return Path(found)


def is_hydra(mpiexec: Path) -> bool:
    """MPICH's hydra launcher (it can print every rank's exit code)."""
    try:
        real = Path(os.path.realpath(mpiexec))
    except OSError:
        return False
    return "hydra" in real.name or (real.parent / "mpiexec.hydra").exists()


def _signal(pids: Sequence[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except OSError:
            pass


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except OSError:
        pass


def _wait(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def _terminate(ident: dict[int, int], pgid: int, grace_s: float, done: Callable[[], bool] = lambda: True) -> None:
    """SIGTERM the group ``pgid`` and the processes ``ident`` (pid -> start time: a pid reused by
    another process is never signalled), then SIGKILL whatever is left ``grace_s`` later (``done``:
    whether the group's leader has ended too)."""
    held = hwloc_files(ident)
    _killpg(pgid, signal.SIGTERM)
    _signal(list(ident), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    left = list(ident)
    while (left or not done()) and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if start_time(p) == ident[p]]
    _signal(left, signal.SIGKILL)
    if not done():
        _killpg(pgid, signal.SIGKILL)
    remove_hwloc(held)              # a proxy killed before its own clean-up leaves its file in /tmp


def remove_hwloc(paths: Iterable[str], holder: int | None = None, started: int | None = None,
                 wait_s: float = 0.0) -> list[str]:
    """Unlink the hydra hwloc files among ``paths`` (nothing else is touched); with a ``holder``
    (the proxy's pid and ``started``, its start time) only once it has ended, waiting up to
    ``wait_s`` for that: a live proxy removes its own file when it ends. The removed ones."""
    if holder is not None:
        deadline = time.monotonic() + wait_s
        while start_time(holder) == started and time.monotonic() < deadline:
            time.sleep(0.05)
        if start_time(holder) == started:
            return []
    removed = []
    for path in sorted(paths):
        if path.startswith(HWLOC_PREFIX):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


@dataclass(frozen=True)
class ProxyLineage:
    """Who launched a rank, noted by the rank itself as it starts (while mpiexec surely lives):
    its parent (hydra's proxy, by pid and start time), the proxy's parent (mpiexec, or the
    ssh daemon on another host) and the hwloc files the proxy holds. A watcher that started
    later cannot learn these any more once mpiexec or the proxy is gone, and under load it
    starts seconds later."""
    proxy: int
    proxy_start: int | None
    launcher: int | None
    hwloc: tuple[str, ...] = ()

    @classmethod
    def of_parent(cls) -> ProxyLineage:
        proxy = os.getppid()
        launcher = parent_of(proxy)
        return cls(proxy, start_time(proxy), launcher if launcher and launcher > 1 else None,
                   tuple(sorted(hwloc_files([proxy]))))

    def lost(self) -> bool:
        """The job's launcher is gone: the proxy has ended (or is another process now), or it has
        lost its parent. Nothing will finish the job then. (No launcher noted: never.)"""
        if self.launcher is None:
            return False
        return start_time(self.proxy) != self.proxy_start or parent_of(self.proxy) != self.launcher

    def argv(self) -> list[str]:
        out = ["--proxy", str(self.proxy), "--proxy-start", str(self.proxy_start or 0)]
        if self.launcher is not None:
            out += ["--launcher", str(self.launcher)]
        for path in self.hwloc:
            out += ["--hwloc", path]
        return out


def hwloc_files(pids: Iterable[int]) -> set[str]:
    """The hwloc topology files that hydra's proxies among ``pids`` hold open. A proxy writes one
    per job to ``/tmp/hydra_hwloc_xmlfile_XXXXXX`` (the path is compiled in: TMPDIR does not move
    it) and removes it when it ends normally; stopped by a signal, it leaves it behind for good."""
    out = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(HWLOC_PREFIX):
                out.add(target)
    return out


def stop_process_tree(proc: subprocess.Popen, marker: str, extra_pids: Sequence[int] = (), grace_s: float = 3.0) -> None:
    """SIGTERM ``proc``'s process group and every process of its tree at once (hydra starts
    each rank in a session of its own, so the group alone misses them; ``extra_pids`` whose
    command line holds ``marker`` are ranks known from their progress records), then SIGKILL
    whatever is left ``grace_s`` later."""
    ident = {p: t for p in descendants(proc.pid) if (t := start_time(p)) is not None}
    ident.update({p: t for p in extra_pids if p not in ident and cmdline_has(p, marker)
                  and (t := start_time(p)) is not None})
    _terminate(ident, proc.pid, grace_s, lambda: proc.poll() is not None)
    _wait(proc, grace_s)


def stop_left_over(pgid: int, marker: str, grace_s: float = 3.0) -> None:
    """Stop what is left of a launch whose launcher is gone (:mod:`.reaper`): the processes of
    mpiexec's group ``pgid`` and every process whose command line holds ``marker`` (the ranks, in
    sessions of their own), SIGTERM then SIGKILL ``grace_s`` later."""
    ident = {}
    for p in proc_table():
        if p == os.getpid():
            continue
        try:
            in_group = os.getpgid(p) == pgid
        except OSError:
            continue
        if (in_group or cmdline_has(p, marker)) and (t := start_time(p)) is not None:
            ident[p] = t
    _terminate(ident, pgid, grace_s, lambda: not any(start_time(p) == t for p, t in ident.items()))


class Supervised:
    """``cmd`` running in its own session with its output in ``workdir/mpiexec.{out,err}``."""

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], workdir: Path, marker: str) -> None:
        self.cmd, self.env, self.workdir, self.marker = list(cmd), dict(env), workdir, marker
        self.proc: subprocess.Popen | None = None
        self.start_wall = 0.0
        self.shm_before: set[str] = set()
        self.hwloc: set[str] = set()
        self._t0 = 0.0
        self._logs: list[Any] = []

    def start(self) -> Supervised:
        self.shm_before = shm_files()
        self._logs = [open(self.workdir / "mpiexec.out", "w+b"), open(self.workdir / "mpiexec.err", "w+b")]
        self.start_wall = time.time()
        self._t0 = time.monotonic()
        try:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=self._logs[0],
                                         stderr=self._logs[1], env=self.env, start_new_session=True)
        except OSError as exc:
            self.close_logs()
            raise EmulationError(f"cannot start {self.cmd[0]}: {exc}") from None
        threading.Thread(target=self._scan_hwloc, name="partir-emu-hwloc-scan", daemon=True).start()
        return self

    def wait(self, budget_s: float) -> tuple[int | None, bool]:
        """``(exit code, timed out)`` once the process ends or ``budget_s`` after the start."""
        assert self.proc is not None, "start() first"
        try:
            self.proc.wait(timeout=max(budget_s - (time.monotonic() - self._t0), 0.1))
            return self.proc.returncode, False
        except subprocess.TimeoutExpired:
            return None, True

    def _scan_hwloc(self) -> None:
        """Until it finds them or mpiexec ends, look for the hwloc files the job's proxies hold
        (:attr:`hwloc`): a proxy that hydra kills after a rank failure leaves its file in /tmp, and
        the launcher may be busy elsewhere (the references) while that happens."""
        assert self.proc is not None
        while not self.hwloc and self.proc.poll() is None:
            self.hwloc = hwloc_files(descendants(self.proc.pid))
            time.sleep(HWLOC_SCAN_S)

    def remove_hwloc(self) -> None:
        """Once mpiexec has ended (its proxies with it), unlink the hwloc files they left."""
        if self.proc is not None and self.proc.poll() is not None:
            remove_hwloc(self.hwloc)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, extra_pids: Sequence[int] = (), grace_s: float = 3.0) -> None:
        if self.proc is not None:
            stop_process_tree(self.proc, self.marker, extra_pids, grace_s)

    def output(self) -> str:
        """stdout then stderr so far."""
        text = ""
        for f in self._logs:
            try:
                f.flush()
                f.seek(0)
                text += f.read().decode(errors="replace")
            except (OSError, ValueError):
                pass
        return text

    def close_logs(self) -> None:
        for f in self._logs:
            try:
                f.close()
            except OSError:
                pass


# -- MPICH shared-memory segments ----------------------------------------------------------------
def shm_files() -> set[str]:
    try:
        return {f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith("mpich_shm")}
    except OSError:
        return set()


def _shm_in_use() -> set[str]:
    used = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/maps") as f:
                    for line in f:
                        if SHM_PREFIX in line:
                            used.add(line.rsplit(None, 1)[-1])
            except OSError:
                pass
    return used


def _mtime(p: str) -> float:
    try:
        return os.stat(p).st_mtime
    except OSError:
        return 0.0


def cleanup_shm(named: Sequence[str], before: set[str], since: float) -> list[str]:
    """Remove the run's MPICH segments: those its ranks reported, and new unmapped ones."""
    new = {p for p in shm_files() - before if _mtime(p) >= since - 1}
    return remove_segments(set(named) | (new - _shm_in_use() if new else set()))


def remove_segments(paths: Iterable[str]) -> list[str]:
    """Unlink the MPICH shm segments among ``paths`` (others are never touched); the removed ones."""
    removed = []
    for p in sorted(paths):
        if p.startswith(SHM_PREFIX):
            try:
                os.unlink(p)
                removed.append(p)
            except OSError:
                pass
    return removed
