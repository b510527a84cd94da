"""Every command stops cleanly on SIGINT, SIGTERM and SIGHUP, in every phase (issue 22, item 2).

The console script runs as a user starts it; once its own start-up handlers are in place (read
from ``/proc/PID/status``: the process catches the three signals) the signal is sent at a delay
that lands in import, tracing and lowering, or the command's own work. Each must exit 128 + N
with exactly one line on stderr and no traceback, within a couple of seconds of the signal (the
stop time is measured, not the command's wall time), and leave no file behind in its directory.
Before the fix a Ctrl-C during import ended in a traceback, one during jax's start-up was
swallowed by a gc callback (exit 0, the command went on), and a stop during a jax call waited for
the call (1.5-2 s under load)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import default_signals, wall

pytestmark = [pytest.mark.wallclock, pytest.mark.xdist_group("stop_signals")]

EXE = Path(sys.executable).with_name("partir-emu")
CAUGHT = {int(signal.SIGINT), int(signal.SIGTERM), int(signal.SIGHUP)}

# each takes 3-8 s on a quiet 2-core machine: the latest moment below is well inside it
COMMANDS = {
    "simulate": "simulate transformer --size t32 --strategy z3 --mesh batch=256 --hardware tpu-v4 --report r.json",
    "simulate-des": "simulate-des transformer --size t32 --strategy bp+mp --mesh batch=8,model=4 --report r.json",
    "validate": "validate --suite closed-form --report r.json",
    "run": "run transformer --size tiny --strategy bp+mp --mesh batch=2,model=2 --report r.json",
    "show": "show transformer --size t48 --strategy bp+mp --mesh batch=2,model=2 --output p.json",
    "replay": "replay {trace} --hardware tpu-v4 --report r.json",
    "fidelity": "fidelity --group all --report r.json",
}
# (signal, seconds after the start-up handlers are in): import, then tracing/lowering, then work
MOMENTS = [(signal.SIGINT, 0.0), (signal.SIGTERM, 0.3), (signal.SIGHUP, 0.7), (signal.SIGINT, 1.2)]


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    """A message trace for `replay` to work on for a few seconds: sixteen ring all-reduces over 64
    devices, the transfers the schedules predict (129,024 rows), outside the tests' own directories."""
    from partir_emu.core.mesh import Mesh
    from partir_emu.core.msgtrace import write_message_trace
    from partir_emu.hwmodels.validation.replay import expected_rows
    mesh = Mesh(batch=64)
    head = {"format": "partir-emu-message-trace", "version": 2, "mesh": mesh.to_json(), "devices": 64,
            "ranks": 64, "devices_per_rank": 1, "algorithm": "ring",
            "collectives": {str(i): {"prim": "all_reduce", "axes": ["batch"], "bytes": (1 << 20) + 4 * i,
                                     "itemsize": 4} for i in range(16)}}
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    write_message_trace(path, head, np.concatenate([expected_rows(head, c, 4) for c in range(16)]))
    return path


def _caught(pid: int) -> set[int]:
    """The signals process ``pid`` has handlers for (``SigCgt`` of /proc/PID/status)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return set()
    mask = int(next(ln.split()[1] for ln in text.splitlines() if ln.startswith("SigCgt:")), 16)
    return {s for s in range(1, 65) if mask >> (s - 1) & 1}


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/PID/status (Linux)")
@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("sig, delay", MOMENTS, ids=[f"{s.name}+{d}s" for s, d in MOMENTS])
def test_a_stop_signal_stops_the_command(command, sig, delay, tmp_path, trace):
    argv = [part.format(trace=trace) for part in COMMANDS[command].split()]
    proc = subprocess.Popen(default_signals([str(EXE), *argv]), cwd=tmp_path, env=dict(os.environ),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + wall(20)
        while not CAUGHT <= _caught(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, "the console script never took the signals"
            time.sleep(0.005)
        time.sleep(delay)
        assert proc.poll() is None, f"{command} ended before the signal: give it more work"
        sent = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=wall(10))
        stop_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = err.strip().splitlines()
    assert proc.returncode == 128 + sig, (proc.returncode, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("partir-emu") and f"stopped by {sig.name}" in lines[0], err
    assert "Traceback" not in err
    assert stop_s <= wall(1.0), f"stopped {stop_s:.2f} s after {sig.name}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a stopped command left a file behind"


def test_a_signal_ignored_by_the_parent_stays_ignored(tmp_path):
    """Under ``nohup`` (SIGHUP ignored, inherited across exec) the command neither catches SIGHUP
    nor stops on it; SIGINT and SIGTERM it still takes. (Python does the same for an ignored SIGINT.)"""
    shim = ("import os, signal, sys\n"
            "signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
            "os.execv(sys.argv[1], sys.argv[1:])")
    argv = COMMANDS["simulate"].split()
    proc = subprocess.Popen(default_signals([sys.executable, "-c", shim, str(EXE), *argv]), cwd=tmp_path,
                            env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + wall(20)
        while not {int(signal.SIGINT), int(signal.SIGTERM)} <= _caught(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, "the console script never took the signals"
            time.sleep(0.005)
        time.sleep(0.5)                        # past the imports: the CLI's own handlers are in
        assert int(signal.SIGHUP) not in _caught(proc.pid)
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        assert proc.poll() is None, "an ignored SIGHUP stopped the command"
        assert int(signal.SIGHUP) not in _caught(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=wall(10))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err[-2000:])
