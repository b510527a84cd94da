"""Emulated hosts for the multi-host MPI tier: Linux network namespaces on a private veth bridge.

:class:`NamespaceHosts` builds ``n`` hosts, each a *network* namespace (its own stack, one veth into
a bridge of its own, address ``10.77.0.(i+1)/24``, no route anywhere else), a *mount* namespace with
a private ``/tmp`` and ``/dev/shm`` (a tmpfs each: no file is shared between the hosts but the
installed software, so a run that needs a shared work dir fails here as on real machines, and MPICH's
shm segments and hydra's hwloc files are each host's own) and a *UTS* namespace with its host name
(``pe-h0``, ``pe-h1``, ..., in every host's ``/etc/hosts``). The namespaces are kept by bind mounts
under ``/run``, so a host outlives its processes and the test can look into it afterwards.

Hydra launches onto them with ``-launcher ssh -launcher-exec SCRIPT``: the generated SCRIPT is
called as ``SCRIPT -x HOST "COMMAND ..."`` (as ssh would be) and runs ``sh -c COMMAND`` inside
HOST's namespaces (``nsenter``; ``ip netns exec`` would bring a fresh mount namespace with the
shared /tmp). :meth:`NamespaceHosts.close` stops every process left in the namespaces and removes
the links, the bridge, the namespaces and the mounts, also after a failure. Root and ``ip netns``
are needed (:func:`unavailable` says why not).
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SUBNET = "10.77.0"


# hydra's ssh launcher runs ``SCRIPT -x HOST "COMMAND ..."``. Like ssh, this reaches HOST over the
# network first (a TCP connect to its port 22 from the caller's namespace: refused means the host
# answers; no route or no answer is ssh's "connect to host ... port 22: ..." and exit 255), runs the
# command there, and hangs up the remote side (SIGHUP, then SIGKILL) when the caller goes away, as
# sshd does when the connection drops.
LAUNCHER_EXEC = """#!{python}
import os, signal, socket, subprocess, sys, time
args = sys.argv[1:]
if args and args[0] == "-x":
    args = args[1:]
host, command = args[0], " ".join(args[1:])
table, addrs = {table!r}, {addrs!r}
if host not in table:
    sys.exit(print("ssh: Could not resolve hostname %s: Name or service not known" % host, file=sys.stderr) or 255)
try:
    socket.create_connection((addrs[table[host]], 22), timeout=3).close()
except ConnectionRefusedError:
    pass
except OSError as exc:
    sys.exit(print("ssh: connect to host %s port 22: %s" % (host, exc.strerror or "Connection timed out"),
                   file=sys.stderr) or 255)
child = subprocess.Popen(["{enter}", str(table[host]), command], start_new_session=True)
parent = os.getppid()

def hang_up(*_):
    for sig in (signal.SIGHUP, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
        except OSError:
            pass
        if sig == signal.SIGHUP:
            time.sleep(2)
    sys.exit(255)

for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, hang_up)
while child.poll() is None:
    if os.getppid() != parent:
        hang_up()
    time.sleep(0.1)
sys.exit(child.returncode)
"""


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why namespace hosts cannot be built here (None: they can)."""
    if os.geteuid() != 0:
        return "namespace hosts need root (ip netns add, veth, mounts)"
    for tool in ("ip", "nsenter", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH (iproute2 / util-linux)"
    probe = f"pe-probe{os.getpid()}"
    out = _sh("ip", "netns", "add", probe, check=False)
    if out.returncode != 0:
        return f"ip netns add fails here: {out.stderr.strip()[:200]}"
    _sh("ip", "netns", "del", probe, check=False)
    return None



def _under_tmp(*paths: Path) -> list[Path]:
    """Those of ``paths`` under /tmp, none inside another (each host binds them back into its own /tmp)."""
    tmp = Path("/tmp").resolve()
    under = sorted({Path("/tmp") / p.relative_to(tmp) for p in paths if p.is_relative_to(tmp)})
    return [p for p in under if not any(q != p and p.is_relative_to(q) for q in under)]

class NamespaceHosts:
    """``n`` emulated hosts (module docstring). Use as a context manager, or call :meth:`close`."""

    def __init__(self, n: int = 3) -> None:
        self.n = n
        self.tag = f"pe{os.getpid() % 100000}"
        self.names = [f"pe-h{i}" for i in range(n)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.netns = [f"{self.tag}h{i}" for i in range(n)]
        self.bridge = f"{self.tag}br"
        self.veths = [f"{self.tag}v{i}" for i in range(n)]      # the root ends; the host end is "eth1"
        self.run_dir = Path(f"/run/partir-emu-hosts-{self.tag}")
        self.shared = _under_tmp(Path(__file__).resolve().parents[3], Path(sys.prefix).resolve())
        self.launcher_exec = self.run_dir / "launcher-exec.sh"
        self.enter_script = self.run_dir / "enter.sh"
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- build -----------------------------------------------------------------------------------
    def _build(self) -> None:
        self.close()                            # what an earlier run of this pid left
        self.run_dir.mkdir(parents=True)
        (self.run_dir / "etc-hosts").write_text(
            "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(self.addrs, self.names)))
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "link", "set", self.bridge, "up")
        for i in range(self.n):
            ns, veth = self.netns[i], self.veths[i]
            for d in ("tmp", "shm"):
                (self.run_dir / f"h{i}" / d).mkdir(parents=True)
                (self.run_dir / f"h{i}" / d).chmod(0o1777)
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            _sh("ip", "link", "set", f"{veth}p", "netns", ns)
            _sh("ip", "-n", ns, "link", "set", f"{veth}p", "name", "eth1")
            _sh("ip", "link", "set", veth, "master", self.bridge, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addrs[i]}/24", "dev", "eth1")
            _sh("ip", "-n", ns, "link", "set", "eth1", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        # every process of host i: its network namespace, and a mount and UTS namespace of its own in
        # which the host's directories are /tmp and /dev/shm and its name is the host name (a mount
        # namespace per entry, not one per host: one host could not enter another's, made earlier)
        d = self.run_dir
        # the installed software is at the same path on every host (as on a cluster); a checkout or venv
        # under /tmp (a fresh clone in mktemp's dir) would be hidden by the host's own /tmp, so it is
        # bound back at its path inside it (the outer /tmp is kept at {d}/outer for that: recursively, as a
        # host entered from another host, hydra's proxy launch, finds the software bound in that host's /tmp)
        (d / "outer").mkdir()
        back = "".join(f"mkdir -p {shlex.quote(str(p))} && mount --bind {d}/outer/{shlex.quote(str(p.relative_to('/tmp')))} "
                       f"{shlex.quote(str(p))} && " for p in self.shared)
        keep = f"mount --rbind /tmp {d}/outer && " if self.shared else ""
        self.enter_script.write_text(
            "#!/bin/sh\n# enter.sh I COMMAND: run the shell command on host I\ni=$1; shift\n"
            f"exec nsenter --net=/run/netns/{self.tag}h$i -- unshare --mount --uts --propagation private "
            f"sh -c \"{keep}mount --bind {d}/h$i/tmp /tmp && {back}mount --bind {d}/h$i/shm /dev/shm && "
            f"mount --bind {d}/etc-hosts /etc/hosts && hostname pe-h$i && exec sh -c \\\"\\$0\\\"\" \"$*\"\n")
        self.enter_script.chmod(0o755)
        table = {**{h: i for i, h in enumerate(self.names)}, **{a: i for i, a in enumerate(self.addrs)}}
        self.launcher_exec.write_text(LAUNCHER_EXEC.format(python=sys.executable, table=table, addrs=self.addrs,
                                                           enter=self.enter_script))
        self.launcher_exec.chmod(0o755)

    # -- use -------------------------------------------------------------------------------------
    def enter(self, i: int, argv: list[str]) -> list[str]:
        """The command that runs ``argv`` on host ``i``."""
        return [str(self.enter_script), str(i), shlex.join(argv)]

    def shell(self, i: int, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.enter_script), str(i), command], capture_output=True, text=True, timeout=timeout)

    def listing(self, i: int, folder: str) -> list[str]:
        """The names in host ``i``'s own ``/tmp`` or ``/dev/shm`` (``folder``)."""
        return sorted(os.listdir(self.run_dir / f"h{i}" / folder.strip("/").removeprefix("dev/")))

    def link(self, i: int, up: bool) -> None:
        """Take host ``i``'s link (its ``eth1``, inside its namespace) down or up again."""
        _sh("ip", "-n", self.netns[i], "link", "set", "eth1", "up" if up else "down")

    def tx_bytes(self) -> list[int]:
        """Bytes each host sent on its link (the ``eth1`` counter inside its namespace)."""
        out = []
        for ns in self.netns:
            text = _sh("ip", "netns", "exec", ns, "cat", "/sys/class/net/eth1/statistics/tx_bytes").stdout
            out.append(int(text.strip()))
        return out

    def pids(self) -> dict[int, list[int]]:
        """The processes in each host's network namespace, by host."""
        inodes = {}
        for i, ns in enumerate(self.netns):
            try:
                inodes[os.stat(f"/run/netns/{ns}").st_ino] = i
            except OSError:
                pass
        found: dict[int, list[int]] = {i: [] for i in range(self.n)}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    ino = os.stat(f"/proc/{d}/ns/net").st_ino
                except OSError:
                    continue
                if ino in inodes:
                    found[inodes[ino]].append(int(d))
        return found

    def leftovers(self) -> dict[str, list[str]]:
        """What is left on each host: processes, MPICH shm segments, files in /tmp (empty: nothing)."""
        left: dict[str, list[str]] = {}
        procs = self.pids()
        for i, h in enumerate(self.names):
            items = [f"pid {p}: {_cmdline(p)}" for p in procs[i]]
            items += [f"/dev/shm/{f}" for f in self.listing(i, "/dev/shm")]
            skeleton = {p.relative_to("/tmp").parts[0] for p in self.shared}     # the software's bound path
            items += [f"/tmp/{f}" for f in self.listing(i, "/tmp") if f not in skeleton]
            if items:
                left[h] = items
        return left

    def settle(self, timeout: float = 10.0) -> dict[str, list[str]]:
        """:meth:`leftovers`, asked until empty or ``timeout`` (watchers finish their clean-up)."""
        end = time.monotonic() + timeout
        while True:
            left = self.leftovers()
            if not left or time.monotonic() > end:
                return left
            time.sleep(0.2)

    def clear(self) -> None:
        """Kill every process in the hosts and empty their /tmp and /dev/shm (between tests)."""
        for pids in self.pids().values():
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
        for i in range(self.n):
            self.link(i, True)
            for d in ("tmp", "shm"):
                for p in (self.run_dir / f"h{i}" / d).iterdir():
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)

    # -- tear down -------------------------------------------------------------------------------
    def close(self) -> None:
        for pids in (self.pids().values() if Path("/run/netns").exists() else []):
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
        for veth in self.veths:
            _sh("ip", "link", "del", veth, check=False)
        _sh("ip", "link", "del", self.bridge, check=False)
        for ns in self.netns:
            _sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> NamespaceHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"
