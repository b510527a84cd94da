"""A job's files carried to the ranks without a shared file system (the default across hosts).

A self-launched job on several hosts cannot count on its work dir being seen by every rank: the
ranks of another host have their own ``/tmp``. So the launcher packs the files the ranks need (the
jobs file, each program's JSON, each inputs .npz: :func:`pack`) and serves them on a TCP socket
of its own (:class:`BundleServer`, one connection at a time, a random token); rank 0, wherever it
runs, fetches them (:func:`fetch`: the address, port and token are on its command line) and
broadcasts the bytes to every rank over MPI (:func:`partir_emu.mpi.ranks.worker.receive_bundle`).
Rank 0's results (each job's ``outputs.npz`` and ``stats.json``, and its message trace) go back
the same way (:func:`deliver`). (mpiexec's standard input was tried first: hydra's proxy gives up
with "process reading stdin too slowly" while rank 0 is still starting.)

The format is a JSON header (name and size of each file) and the files' bytes: no pickle.
Only the standard library.
"""
from __future__ import annotations

import json
import secrets
import socket
import threading
from collections.abc import Mapping, Sequence

from partir_emu.errors import EmulationError

CONNECT_S = 5.0         # rank 0's connect timeout per address of the launcher


def pack(files: Mapping[str, bytes]) -> bytes:
    """``{name: bytes}`` → one byte string (an 8-byte header length, the JSON header, the bytes)."""
    head = json.dumps([[name, len(data)] for name, data in files.items()]).encode()
    return b"".join([len(head).to_bytes(8, "little"), head, *files.values()])


def unpack(data: bytes, what: str = "the job bundle") -> dict[str, bytes]:
    try:
        n = int.from_bytes(data[:8], "little")
        head = json.loads(data[8:8 + n])
        out, at = {}, 8 + n
        for name, size in head:
            out[str(name)] = data[at:at + int(size)]
            at += int(size)
    except (ValueError, TypeError) as exc:
        raise EmulationError(f"{what} is not a partir-emu bundle ({exc}); {len(data)} bytes arrived") from None
    if at != len(data):
        raise EmulationError(f"{what} has {len(data)} bytes, its header says {at}: it arrived cut short")
    return out


class BundleServer:
    """The launcher's side: serves ``bundle`` to whoever sends ``GET token``, keeps what is sent
    with ``PUT token`` (:attr:`results`). Listens on every address of this host."""

    def __init__(self, bundle: bytes) -> None:
        self.bundle = bundle
        self.token = secrets.token_hex(16)
        self.results: bytes | None = None
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, name="partir-emu-bundle-server", daemon=True).start()

    def argv(self, addresses: Sequence[str]) -> list[str]:
        """The worker's options that name this server."""
        return ["--bundle-from", f"{','.join(addresses)}:{self.port}", "--bundle-token", self.token]

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                conn.settimeout(60.0)
                head = _read_line(conn)
                verb, _, token = head.partition(" ")
                if token != self.token:
                    continue
                if verb == "GET":
                    conn.sendall(len(self.bundle).to_bytes(8, "little") + self.bundle)
                elif verb == "PUT":
                    self.results = _read_sized(conn)
                    conn.sendall(b"OK")
            except (OSError, ValueError):
                pass
            finally:
                conn.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n") and len(data) < 256:
        chunk = conn.recv(1)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def _read_sized(conn: socket.socket) -> bytes:
    n = int.from_bytes(_recv_exact(conn, 8), "little")
    return _recv_exact(conn, n)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = conn.recv(min(1 << 20, n - got))
        if not chunk:
            raise EmulationError(f"the connection closed after {got} of {n} bytes")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _connect(where: str) -> socket.socket:
    addrs, _, port = where.rpartition(":")
    errors = []
    for addr in addrs.split(","):
        try:
            return socket.create_connection((addr, int(port)), timeout=CONNECT_S)
        except OSError as exc:
            errors.append(f"{addr}: {exc.strerror or exc}")
    raise EmulationError(f"rank 0 cannot reach the launcher at port {port} ({'; '.join(errors)}); give --workdir "
                         f"a directory every host shares, or let the hosts reach the launching host over TCP")


def fetch(where: str, token: str, timeout_s: float | None) -> bytes:
    """Rank 0: the bundle from the launcher at ``where`` (``ADDR,...:PORT``)."""
    with _connect(where) as conn:
        conn.settimeout(timeout_s)
        conn.sendall(f"GET {token}\n".encode())
        return _read_sized(conn)


def deliver(where: str, token: str, data: bytes, timeout_s: float | None) -> None:
    """Rank 0: the results to the launcher."""
    with _connect(where) as conn:
        conn.settimeout(timeout_s)
        conn.sendall(f"PUT {token}\n".encode() + len(data).to_bytes(8, "little") + data)
        if _recv_exact(conn, 2) != b"OK":
            raise EmulationError("the launcher did not take rank 0's results")
