"""Every host's ranks in one report: the sentinels of a multi-host job tell rank 0's sentinel.

Each host of a job has its own :mod:`~partir_emu.mpi.procs.sentinel`, and each sees only its own
ranks: on the host of a rank killed with ``kill -9`` the rank died first, on the others hydra
killed the ranks after it, and no single host knows which. So rank 0's sentinel (the *speaker*)
listens on a TCP socket that rank 0 opened (:func:`listen`, handed over by file descriptor) and
whose address every host learns over MPI; the other hosts' sentinels send it what they saw once
their ranks have exited (:func:`send`: a JSON line with the host's progress records, which ranks
exited without a word and when, what it removed), and the speaker, after its own ranks exited,
waits up to :data:`REPORT_WAIT_S` for them (:class:`Collector`) and prints one verdict over every
host: the first rank to die anywhere (wall-clock exit times; the hosts of a cluster keep their
clocks within milliseconds), the signal that stopped every host's ranks, or on a timeout the last
position of every rank. A host that never reports (its link is down, it is gone) is named with its
ranks. Only the standard library.
"""
from __future__ import annotations

import fcntl
import json
import socket
import struct
import threading
import time
from collections.abc import Sequence

REPORT_WAIT_S = 4.0          # the speaker's wait for the other hosts once its own ranks have exited
CONNECT_S = 1.5              # a sender's connect timeout per address of the speaker
SIOCGIFADDR = 0x8915


def local_addresses() -> list[str]:
    """This host's IPv4 addresses, loopback last (where the other hosts may reach the speaker)."""
    out: list[str] = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:                  # no IPv4 address, or down
                continue
            addr = socket.inet_ntoa(raw[20:24])
            if addr not in out:
                out.append(addr)
    finally:
        probe.close()
    return sorted(out, key=lambda a: a.startswith("127."))


def listen() -> socket.socket:
    """The speaker's socket, opened by rank 0 (its port is known at once, before the sentinel runs)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 0))
    s.listen(64)
    return s


def send(addresses: Sequence[str], port: int, report: dict) -> bool:
    """One JSON line to the speaker, trying each of its addresses; False if none answered."""
    line = (json.dumps(report) + "\n").encode()
    for addr in addresses:
        try:
            with socket.create_connection((addr, port), timeout=CONNECT_S) as s:
                s.settimeout(CONNECT_S)
                s.sendall(line)
                return True
        except OSError:
            continue
    return False


class Collector:
    """The speaker's side: accepts the other hosts' reports (a thread) until :meth:`wait` returns."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reports: list[dict] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="partir-emu-host-reports", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)
        data = b""
        try:
            while not data.endswith(b"\n"):
                chunk = conn.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
            report = json.loads(data)
        except (OSError, ValueError):
            return
        finally:
            conn.close()
        if isinstance(report, dict):
            with self._lock:
                self.reports.append(report)

    def wait(self, hosts: int, wait_s: float = REPORT_WAIT_S) -> list[dict]:
        """The reports of ``hosts`` other hosts, or those that came within ``wait_s``."""
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            with self._lock:
                if len(self.reports) >= hosts:
                    break
            time.sleep(0.02)
        self.close()
        with self._lock:
            return list(self.reports)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
