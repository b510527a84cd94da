"""Pricing a study over worker processes (``--jobs N``): the configurations are grouped by program
(:attr:`~partir_emu.app.study.space.Config.lowering_key`), so each program is lowered in one worker
and priced there on every spec, what-if and placement; a free worker takes the next group, largest
first. What crosses processes is JSON lines (no pickle): the parent writes a worker its options
and then one group per line; the worker answers one row per configuration and ``{"done": true}``
after each group (:mod:`partir_emu.app.study.worker`).

No hang: a worker that says nothing for :data:`IDLE_TIMEOUT_S` (one group of a large program lowers
in well under a minute here) is stopped and the study fails naming it; a worker that dies fails
the study with the tail of its stderr.
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

from partir_emu.app.study.evaluate import Row
from partir_emu.app.study.space import Config
from partir_emu.errors import PartirError

IDLE_TIMEOUT_S = 600.0


class StudyWorkerError(PartirError):
    """A study worker process died or went silent."""


def groups(configs: Sequence[Config]) -> list[list[int]]:
    """Indices of ``configs`` by program, the largest group first (grid order within a group)."""
    by: dict[tuple, list[int]] = {}
    for i, c in enumerate(configs):
        by.setdefault(c.lowering_key, []).append(i)
    return sorted(by.values(), key=len, reverse=True)


class _Worker:
    def __init__(self, options: dict) -> None:
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "partir_emu.app.study.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, env=dict(os.environ))
        self.group: list[int] | None = None
        self.got = 0
        self.lower_s = self.price_s = 0.0
        self.buf = b""
        self.send({"options": options})

    def send(self, msg: dict) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise StudyWorkerError(f"study worker {self.proc.pid} ended (exit {self.proc.wait()}) before its work; "
                                   f"its stderr ends:\n{self.stderr_tail()}") from None

    def read(self) -> list[dict]:
        """The whole lines the worker has written since the last read (blocks only for the first bytes)."""
        assert self.proc.stdout is not None
        chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        if not chunk:
            raise StudyWorkerError(f"study worker {self.proc.pid} ended (exit {self.proc.wait()}) during a group "
                                   f"of {len(self.group or ())}; its stderr ends:\n{self.stderr_tail()}")
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        return [json.loads(x) for x in lines if x.strip()]

    def stderr_tail(self, n: int = 2000) -> str:
        self.err.seek(0)
        return self.err.read().decode(errors="replace")[-n:]

    def close(self, graceful: bool) -> None:
        """End the worker: its stdin closed (it exits after its group), or at once (a failure, a stop)."""
        if self.proc.poll() is None:
            if self.proc.stdin:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10 if graceful else 0.01)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self.err.close()


def run_pool(configs: Sequence[Config], jobs: int, options: dict,
             on_row: Callable[[int, Row], None] | None = None) -> tuple[list[Row], float, float]:
    """Every configuration priced by ``jobs`` workers: (rows in grid order, seconds lowering and
    seconds pricing summed over the workers) (module docstring)."""
    todo = groups(configs)
    rows: list[Row | None] = [None] * len(configs)
    workers = [_Worker(options) for _ in range(max(1, min(jobs, len(todo))))]
    sel = selectors.DefaultSelector()
    done, finished = 0, False
    try:
        for w in workers:
            assert w.proc.stdout is not None
            # why raw reads: a buffered readline may leave a second line where select cannot see it
            sel.register(w.proc.stdout.fileno(), selectors.EVENT_READ, w)
            _hand_out(w, todo, configs)
        while any(w.group is not None for w in workers):
            events = sel.select(timeout=IDLE_TIMEOUT_S)
            if not events:
                raise StudyWorkerError(f"study workers said nothing for {IDLE_TIMEOUT_S:.0f} s; stopped them "
                                       f"(rerun with --jobs 1 to see where it stops)")
            for key, _ in events:
                w = key.data
                for msg in w.read():
                    if "row" in msg:
                        assert w.group is not None
                        i = w.group[w.got]
                        rows[i] = Row.from_json(msg["row"])
                        w.got += 1
                        done += 1
                        if on_row is not None:
                            on_row(done - 1, rows[i])
                    elif "error" in msg:
                        raise StudyWorkerError(f"study worker {w.proc.pid}: {msg['error']}")
                    elif msg.get("done"):
                        w.lower_s, w.price_s = msg["lower_s"], msg["price_s"]
                        _hand_out(w, todo, configs)
        finished = True
    finally:
        sel.close()
        for w in workers:
            w.close(graceful=finished)
    return ([r for r in rows if r is not None], sum(w.lower_s for w in workers),
            sum(w.price_s for w in workers))


def _hand_out(w: _Worker, todo: list[list[int]], configs: Sequence[Config]) -> None:
    w.group, w.got = (todo.pop(0) if todo else None), 0
    if w.group is not None:
        w.send({"configs": [configs[i].to_json() for i in w.group]})


__all__ = ["IDLE_TIMEOUT_S", "StudyWorkerError", "groups", "run_pool"]
