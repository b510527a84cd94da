"""Ranks watched on their own host: a progress directory and a sentinel per host, one speaker.

Used under a user's ``mpirun`` (no launcher of ours watches it) and by a self-launched job on
several hosts (the launcher cannot see another host's files): :func:`guard_under_mpirun` gives each
rank a :class:`~partir_emu.mpi.ranks.guard.RankGuard` whose progress record is in a directory
that the host's first rank made, and that rank starts the host's
:mod:`~partir_emu.mpi.procs.sentinel`. With ranks on more than one host, rank 0 opens the
speaker's socket (:mod:`partir_emu.mpi.procs.hostreports`), writes every host's ranks beside its
records and hands the socket to its sentinel; every host learns the speaker's addresses over MPI
and its sentinel reports there, so one line speaks for every host.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from mpi4py import MPI

from partir_emu.mpi.procs import hostreports
from partir_emu.mpi.procs.sentinel import HOSTS_FILE
from partir_emu.mpi.procs.supervise import ProxyLineage
from partir_emu.mpi.ranks.guard import RankGuard
from partir_emu.mpi.ranks.wait import bcast_bytes, wait_all

_STRIP_ENV = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID")
NAME_BYTES = 256


def guard_under_mpirun(comm: MPI.Intracomm, timeout_s: float | None, report_to: str | None = None) -> RankGuard:
    """This rank's :class:`RankGuard`, watched by its host's sentinel (module docstring). With
    ``report_to`` (``ADDR,...:PORT``: our own launcher, which collects the hosts' reports itself)
    every host's sentinel reports there and none speaks."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        first = node.Get_rank() == 0
        buf = np.zeros(4096, np.uint8)
        if first:
            path = tempfile.mkdtemp(prefix="partir-emu-ranks-").encode()
            buf[:len(path)] = np.frombuffer(path, np.uint8)
        wait_all([node.Ibcast([buf, MPI.BYTE], root=0)], timeout_s, "the progress directory from the host's first rank")
        progress_dir = buf.tobytes().rstrip(b"\0").decode()
        guard = RankGuard(comm, timeout_s, progress_dir)
        wait_all([node.Ibarrier()], timeout_s, "the host's ranks (progress records)")
        host_ranks = _host_ranks(comm, timeout_s)
        hosts = np.array([int(first)], np.int64)
        wait_all([comm.Iallreduce(MPI.IN_PLACE, [hosts, MPI.INT64_T], op=MPI.SUM)], timeout_s, "the number of hosts")
        guard.hosts = int(hosts[0])
        speaker, report = None, report_to
        if guard.hosts > 1 and report_to is None:         # one speaker for every host: rank 0's sentinel, over TCP
            if comm.Get_rank() == 0:
                speaker = hostreports.listen()
                where = json.dumps({"addrs": hostreports.local_addresses(), "port": speaker.getsockname()[1]})
                (Path(progress_dir) / HOSTS_FILE).write_text(json.dumps(host_ranks))
            got = json.loads(bcast_bytes(comm, where.encode() if speaker else None, timeout_s, "the speaker's address"))
            report = f"{','.join(got['addrs'])}:{got['port']}"
        if first:
            _start_sentinel(progress_dir, node.Get_size(), timeout_s, speak=comm.Get_rank() == 0 and not report_to,
                            speaker=speaker, report=None if speaker is not None else report)
        if speaker is not None:
            speaker.close()          # the sentinel holds its own copy
        guard.sentinel_watches = True
    finally:
        node.Free()
    return guard


def _host_ranks(comm: MPI.Intracomm, timeout_s: float | None) -> dict[str, list[int]]:
    """On rank 0: each host's ranks (by host name); elsewhere empty."""
    name = np.zeros(NAME_BYTES, np.uint8)
    raw = socket.gethostname().encode()[:NAME_BYTES]
    name[:len(raw)] = np.frombuffer(raw, np.uint8)
    root = comm.Get_rank() == 0
    every = np.empty(NAME_BYTES * comm.Get_size(), np.uint8) if root else None
    wait_all([comm.Igather([name, MPI.BYTE], [every, MPI.BYTE] if root else None, root=0)], timeout_s,
             "the ranks' host names")
    if every is None:
        return {}
    out: dict[str, list[int]] = {}
    for r, row in enumerate(every.reshape(-1, NAME_BYTES)):
        out.setdefault(row.tobytes().rstrip(b"\0").decode(errors="replace"), []).append(r)
    return out


def _start_sentinel(progress_dir: str, ranks: int, timeout_s: float | None, speak: bool,
                    speaker: socket.socket | None = None, report: str | None = None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIP_ENV)}
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "partir_emu.mpi.procs.sentinel", "--dir", progress_dir, "--ranks", str(ranks),
           *ProxyLineage.of_parent().argv()]    # noted now: mpiexec may be gone by the time it runs
    if timeout_s:
        cmd += ["--deadline", str(timeout_s + 60.0)]     # the ranks' watchdogs end them by timeout_s
    if speak:
        cmd.append("--speak")
    if speaker is not None:
        cmd += ["--listen-fd", str(speaker.fileno())]
    if report is not None:
        cmd += ["--report", report]
    try:    # own session: mpiexec's clean-up kills the ranks' sessions, the sentinel must outlive them
        subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                         pass_fds=(speaker.fileno(),) if speaker is not None else ())
    except OSError as exc:
        print(f"partir-emu: warning: cannot start the rank watcher ({exc}); a rank that dies "
              f"without a word will not be named", file=sys.stderr)
