"""Who died first in a failed MPI job: the moment each rank exited, and hydra's exit codes.

- :class:`DeathWatch` learns the moment each rank exits (its ``flock`` on its progress
  record is released) and which ranks exited without a word, so that the failure report
  names the rank that died first rather than the ones MPI tore down after it.
- :func:`exit_statuses` reads hydra's per-rank exit codes.

Only the standard library: the launcher process imports neither mpi4py nor jax for this.
"""
from __future__ import annotations

import fcntl
import os
import re
import threading
import time
from pathlib import Path

from partir_emu.runtime.progress import read_record

TIE_S = 0.002           # exits closer than this are ties even on an idle machine
SCAN_S = 0.02           # how often the watch looks for new ranks' progress files


class DeathWatch:
    """Learns the moment each rank exits: a rank holds an ``flock`` on its progress file while
    it lives (see :class:`partir_emu.mpi.ranks.guard.RankGuard`); one thread per rank blocks on
    that lock and stamps the time it is released, with the rank's last progress record.

    A rank that had already exited when its thread first took the lock (a job that fails within
    the first scan) has no known exit time: it is stamped 0.0, earlier than every observed exit,
    so that it is never ranked after a rank whose death was seen as it happened.

    The stamps are as exact as this process is prompt to wake: :attr:`resolution_s` is the
    latest the scanner thread ever woke after its timer (at least :data:`TIE_S`), so a loaded
    machine widens what counts as a tie instead of claiming an order it could not see."""

    def __init__(self, progress_dir: Path) -> None:
        self.dir = progress_dir
        self.exits: dict[int, tuple[float, dict]] = {}
        self._seen: set[str] = set()
        self.resolution_s = TIE_S
        self._stop = threading.Event()
        self._scanner = threading.Thread(target=self._scan, name="partir-emu-deathwatch", daemon=True)
        self._scanner.start()

    def _scan(self) -> None:
        while not self._stop.is_set():
            try:
                names = os.listdir(self.dir)
            except OSError:
                names = []
            for n in names:
                path = self.dir / n
                if n.startswith("rank-") and n not in self._seen and _size(path) > 0:
                    self._seen.add(n)
                    threading.Thread(target=self._wait_one, args=(path,), daemon=True).start()
            t0 = time.monotonic()
            if self._stop.wait(SCAN_S):
                break
            self.resolution_s = max(self.resolution_s, time.monotonic() - t0 - SCAN_S)

    def _wait_one(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                t = 0.0                             # free already: exited before we watched, time unknown
            except BlockingIOError:
                fcntl.flock(fd, fcntl.LOCK_EX)      # granted once the rank has exited (or finished)
                t = time.time()
            rec = read_record(path)
            if rec is not None:
                self.exits[int(rec["rank"])] = (t, rec)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        finally:
            os.close(fd)

    def stop(self) -> None:
        self._stop.set()

    def silent_deaths(self, settle_s: float = 0.5) -> list[tuple[float, dict]]:
        """Ranks that exited neither done, nor having reported a failure, nor stopped by a
        signal, earliest first, as ``(exit wall time, last progress record)``."""
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and len(self.exits) < len(self._seen):
            time.sleep(0.01)
        out = [(t, r) for t, r in self.exits.values() if r.get("phase") not in ("done", "failed")
               and not r.get("stopped_by")]
        return sorted(out, key=lambda x: x[0])

    def wait_exits(self, count: int, deadline_s: float) -> bool:
        """Block until ``count`` ranks have exited (True) or ``deadline_s`` seconds passed."""
        end = time.monotonic() + deadline_s
        while len(self.exits) < count:
            if time.monotonic() > end:
                return False
            time.sleep(0.05)
        return True


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def exit_statuses(text: str) -> dict[int, str]:
    """Per-rank exit status from hydra's ``-print-all-exitcodes`` line (single host only)."""
    m = re.findall(r"Exit codes: \[[^\]]*\] ([0-9,]+)\s*$", text, re.M)
    if len(m) != 1:
        return {}
    out = {}
    for r, v in enumerate(int(x) for x in m[0].split(",")):
        out[r] = f"killed by signal {v & 0x7F}" if v & 0x7F else f"exit code {v >> 8}"
    return out
