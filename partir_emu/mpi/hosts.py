"""Where a self-launched MPI job runs: ``--hosts``, ``--hostfile``, ``--launcher``, ``--launcher-exec``.

:class:`HostOptions` checks what the user gave (before anything is lowered or launched: a bad value
is a :class:`HostSpecError` naming it and what to do) and turns it into the arguments of the venv's
MPICH hydra ``mpiexec``: ``-hosts h1:4,h2:4``, ``-f FILE``, ``-launcher ssh`` and ``-launcher-exec
SCRIPT``. :meth:`HostOptions.multi_host` tells whether the job may leave this machine, also when the
user configured hydra through its own environment (``HYDRA_HOST_FILE``, ``HYDRA_LAUNCHER``, ...,
which the launcher passes on as they are): then the program and inputs go to the ranks over MPI
and every host's ranks are watched on their host (:mod:`partir_emu.mpi.launch`).

Only the standard library: the launching process imports neither mpi4py nor jax.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from partir_emu.errors import ArgumentError

# hydra's launchers (``mpiexec -info``: "Launchers available")
LAUNCHERS = ("ssh", "rsh", "fork", "slurm", "ll", "lsf", "sge", "manual", "persist")
HYDRA_HOST_ENV = ("HYDRA_HOST_FILE", "HYDRA_LAUNCHER", "HYDRA_LAUNCHER_EXEC", "HYDRA_RMK")
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.\-_]*[A-Za-z0-9])?$|^\[?[0-9A-Fa-f:]+\]?$")


class HostSpecError(ArgumentError):
    """A ``--hosts``, ``--hostfile``, ``--launcher`` or ``--launcher-exec`` that cannot be used."""


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """``'h1:4,h2:4'`` (a host without ``:N`` takes one rank) → ``[('h1', 4), ('h2', 4)]``."""
    out: list[tuple[str, int]] = []
    for item in spec.split(","):
        item = item.strip()
        host, _, slots = item.partition(":")
        if not item or not _HOST.match(host):
            raise HostSpecError(f"--hosts {spec!r}: {item!r} is not a host name; give HOST or HOST:RANKS "
                                f"separated by commas, e.g. --hosts node1:4,node2:4")
        if slots and (not slots.isdigit() or int(slots) < 1):
            raise HostSpecError(f"--hosts {spec!r}: {item!r} has {slots!r} ranks; give a whole number of "
                                f"ranks of at least 1 after the colon, e.g. {host}:4")
        if host in (h for h, _ in out):
            raise HostSpecError(f"--hosts {spec!r} names {host} twice; give each host once with its rank count")
        out.append((host, int(slots) if slots else 1))
    return out


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """Hydra's host file: one ``HOST[:RANKS]`` a line, ``#`` comments. Checked here, read by hydra."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as exc:
        raise HostSpecError(f"--hostfile {path}: cannot read it ({exc.strerror or exc}); give a file of "
                            f"HOST[:RANKS] lines") from None
    entries = [ln.split("#", 1)[0].strip() for ln in lines]
    entries = [e for e in entries if e]
    if not entries:
        raise HostSpecError(f"--hostfile {path} names no host; write one HOST[:RANKS] a line (node1:4)")
    out: list[tuple[str, int]] = []
    for n, e in enumerate(entries, 1):
        try:
            out += parse_hosts(e.split()[0])
        except HostSpecError as exc:
            raise HostSpecError(f"--hostfile {path}, entry {n} ({e!r}): {str(exc).split(': ', 1)[1]}") from None
    return out


@dataclass(frozen=True)
class HostOptions:
    """The user's host options (each None when not given), checked by :meth:`from_args`."""
    hosts: str | None = None
    hostfile: str | None = None
    launcher: str | None = None
    launcher_exec: str | None = None

    @classmethod
    def from_args(cls, hosts: str | None, hostfile: str | None, launcher: str | None,
                  launcher_exec: str | None) -> HostOptions:
        if hosts is not None and hostfile is not None:
            raise HostSpecError("--hosts and --hostfile both given; name the hosts one way")
        if hosts is not None:
            parse_hosts(hosts)
        if hostfile is not None:
            read_hostfile(hostfile)
            hostfile = str(Path(hostfile).resolve())
        if launcher is not None and launcher not in LAUNCHERS:
            raise HostSpecError(f"--launcher {launcher!r} is not one of hydra's launchers; use one of "
                                f"{', '.join(LAUNCHERS)}")
        if launcher_exec is not None:
            p = Path(launcher_exec)
            if not p.is_file() or not os.access(p, os.X_OK):
                raise HostSpecError(f"--launcher-exec {launcher_exec}: not an executable file; give the program "
                                    f"hydra's launcher should run instead of ssh (chmod +x it)")
            launcher_exec = str(p.resolve())
        return cls(hosts, hostfile, launcher, launcher_exec)

    def mpiexec_args(self) -> list[str]:
        out: list[str] = []
        if self.hosts is not None:
            out += ["-hosts", ",".join(f"{h}:{n}" for h, n in parse_hosts(self.hosts))]
        if self.hostfile is not None:
            out += ["-f", self.hostfile]
        if self.launcher is not None:
            out += ["-launcher", self.launcher]
        if self.launcher_exec is not None:
            out += ["-launcher-exec", self.launcher_exec]
        return out

    def rank_hosts(self, ranks: int) -> dict[str, list[int]]:
        """Each host's ranks as hydra places them (each host's ranks in turn, round again if the
        job has more ranks than slots); empty when the hosts are not ours to know (hydra's env)."""
        hosts = (parse_hosts(self.hosts) if self.hosts is not None else
                 read_hostfile(self.hostfile) if self.hostfile is not None else [])
        out: dict[str, list[int]] = {}
        r = 0
        while hosts and r < ranks:
            for h, n in hosts:
                take = list(range(r, min(r + n, ranks)))
                out.setdefault(h, []).extend(take)
                r += len(take)
        return out

    def multi_host(self, env: Mapping[str, str] | None = None) -> bool:
        """Whether the ranks may run on other machines (given here, or in hydra's environment)."""
        env = os.environ if env is None else env
        return (any(v is not None for v in (self.hosts, self.hostfile, self.launcher, self.launcher_exec))
                or any(env.get(v) for v in HYDRA_HOST_ENV))


HOST_FLAGS = (("--hosts", "hosts"), ("--hostfile", "hostfile"), ("--launcher", "launcher"),
              ("--launcher-exec", "launcher_exec"), ("--workdir", "workdir"))


def check_cli(args: object, mpi: bool, under_mpirun: bool) -> HostOptions | None:
    """``partir-emu run``'s host options (``args``: its namespace), checked before anything is lowered:
    they apply to a self-launched ``--backend mpi`` run only. None when none is given."""
    given = [(flag, getattr(args, attr, None)) for flag, attr in HOST_FLAGS]
    given = [(flag, v) for flag, v in given if v is not None]
    if not given:
        return None
    flag, value = given[0]
    if not mpi:
        raise HostSpecError(f"{flag} {value} applies only with --backend mpi (the local backend runs in this "
                            f"process); add --backend mpi or drop it")
    if under_mpirun:
        raise HostSpecError(f"{flag} {value}: this process is already a rank of your mpirun, which chose the hosts; "
                            f"give them to mpirun (-hosts/--hostfile) and drop {flag}, or run partir-emu without mpirun")
    workdir = getattr(args, "workdir", None)
    if workdir is not None and not (Path(workdir).is_dir() and os.access(workdir, os.W_OK | os.X_OK)):
        raise HostSpecError(f"--workdir {workdir}: not a writable directory; give a directory that every host "
                            f"sees at the same path (a shared file system), or drop --workdir to send the program "
                            f"and inputs over MPI")
    return HostOptions.from_args(getattr(args, "hosts", None), getattr(args, "hostfile", None),
                                 getattr(args, "launcher", None), getattr(args, "launcher_exec", None))
