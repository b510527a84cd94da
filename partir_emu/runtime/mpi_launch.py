"""``partir-emu run … --backend mpi``: launch (or join) an MPI run and verify it.

Two ways to run, chosen by :func:`under_mpirun` (``PMI_RANK``/``PMI_SIZE``/
``OMPI_COMM_WORLD_SIZE``/``PMIX_RANK`` in the environment):

**Self-launched** (no mpirun around us): ``partir-emu run mlp --mesh batch=64 --backend mpi
--devices 64 --devices-per-rank 4``. This process traces and lowers (it alone imports jax),
writes the SpmdProgram (JSON) and a jobs file to a temp dir, and starts
``<venv>/bin/mpiexec -n N/k python -m partir_emu.runtime.worker --jobs FILE`` in a new
session with ``MPIEXEC_TIMEOUT`` set. No rank imports jax. While the ranks run, this process
computes the ``jax.jit`` reference; rank 0 writes the unsharded outputs (.npz) and the stats
(JSON) to the temp dir, and this process verifies and reports.

**Under the user's mpirun**: ``mpirun -n R partir-emu run … --backend mpi --devices-per-rank k``.
Rank 0 lowers (only rank 0 imports jax) and broadcasts the program as JSON bytes (``Ibcast``
of its length, then of a uint8 buffer); every rank makes its inputs and runs its devices
(:func:`partir_emu.runtime.worker.run_job`); rank 0 gathers, verifies and reports; the
other ranks return ``None``. Works with a hostfile and the system's ``mpirun`` across hosts.

Either way the report is the local backend's plus ``ranks``, ``devices_per_rank``,
``launch_s`` (mpiexec start, or the first rank's start, to the last rank holding its
inputs), ``step_s`` (between two barriers), ``lower_s``, ``gather_s`` and ``rss_bytes_total``
(sum of the ranks' max RSS).

**Failures.** A non-zero exit of mpiexec raises :class:`EmulationError` with the ranks'
``partir-emu rank R device D op K …`` lines; for a rank that died without a word (killed,
OOM) the op comes from its progress file. Every run has a timeout: the ranks' watchdogs
(``--timeout``), ``MPIEXEC_TIMEOUT`` (+3 s) and this process's wait (+6 s), after which
mpiexec's process group gets SIGTERM, then every leftover rank SIGTERM and, 3 s later,
SIGKILL. MPICH's ``/dev/shm/mpich_shm_*`` segments left by a failed run are removed.
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from partir_emu.errors import ArgumentError, EmulationError, MeshError

_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
_STRIP_ENV = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID")
ROOT = Path(__file__).resolve().parents[2]


def under_mpirun() -> bool:
    """True inside a process started by mpirun/mpiexec (an MPI rank)."""
    return any(v in os.environ for v in _MPI_ENV)


def mpiexec_path() -> Path:
    """The venv's mpiexec (installed by ``pip install mpich``), else the one on PATH."""
    p = Path(sys.executable).parent / "mpiexec"
    if p.exists():
        return p
    import shutil
    found = shutil.which("mpiexec")
    if not found:
        raise EmulationError("no mpiexec next to the Python interpreter or on PATH; install MPI with "
                             "`pip install mpich mpi4py` in this environment")
    return Path(found)


# -- process housekeeping ------------------------------------------------------------------------
def _proc_table() -> dict[int, int]:
    """pid → ppid of every process (from /proc)."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    st = f.read()
                out[int(d)] = int(st[st.rindex(")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    return out


def descendants(pid: int) -> list[int]:
    table = _proc_table()
    kids: dict[int, list[int]] = {}
    for p, pp in table.items():
        kids.setdefault(pp, []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int, marker: str | None = None) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":
                return False
        if marker is not None:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return marker.encode() in f.read()
        return True
    except (OSError, IndexError):
        return False


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


def stop_process_tree(proc: subprocess.Popen, marker: str, extra_pids: Sequence[int] = (), grace_s: float = 3.0) -> None:
    """SIGTERM mpiexec's process group, then every leftover rank (SIGTERM, then SIGKILL)."""
    tree = set(descendants(proc.pid)) | set(extra_pids)
    _killpg(proc.pid, signal.SIGTERM)
    _wait(proc, grace_s)
    left = [p for p in tree if _alive(p, marker)]
    _signal(left, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if _alive(p, marker)]
    _signal(left, signal.SIGKILL)
    if proc.poll() is None:
        _killpg(proc.pid, signal.SIGKILL)
    _wait(proc, grace_s)


def _shm_files() -> set[str]:
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
                        if "/dev/shm/mpich_shm" in line:
                            used.add(line.rsplit(None, 1)[-1])
            except OSError:
                pass
    return used


def cleanup_shm(named: Sequence[str], before: set[str], since: float) -> list[str]:
    """Remove the run's MPICH segments: those its ranks reported, and new unmapped ones."""
    removed = []
    new = {p for p in _shm_files() - before if _mtime(p) >= since - 1}
    candidates = set(named) | (new - _shm_in_use() if new else set())
    for p in sorted(candidates):
        if p.startswith("/dev/shm/mpich_shm"):
            try:
                os.unlink(p)
                removed.append(p)
            except OSError:
                pass
    return removed


def _mtime(p: str) -> float:
    try:
        return os.stat(p).st_mtime
    except OSError:
        return 0.0


# -- who died first ------------------------------------------------------------------------------
class DeathWatch:
    """Learns the moment each rank exits: a rank holds an ``flock`` on its progress file while
    it lives (see :class:`partir_emu.runtime.worker.RankGuard`); one thread per rank blocks on
    that lock and stamps the time it is released, with the rank's last progress record."""

    def __init__(self, progress_dir: Path) -> None:
        self.dir = progress_dir
        self.exits: dict[int, tuple[float, dict]] = {}
        self._seen: set[str] = set()
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
            self._stop.wait(0.1)

    def _wait_one(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)      # granted once the rank has exited (or finished)
            t = time.time()
            rec = _read_record(path)
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
        """Ranks that exited neither done nor having reported a failure, earliest first,
        as ``(exit wall time, last progress record)``."""
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and len(self.exits) < len(self._seen):
            time.sleep(0.01)
        out = [(t, r) for t, r in self.exits.values() if r.get("phase") not in ("done", "failed")]
        return sorted(out, key=lambda x: x[0])


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_record(path: Path) -> dict | None:
    try:
        text = path.read_bytes().rstrip(b" \0\n")
        return json.loads(text) if text else None
    except (OSError, ValueError):
        return None


def _exit_statuses(text: str) -> dict[int, str]:
    """Per-rank exit status from hydra's ``-print-all-exitcodes`` line (single host only)."""
    m = re.findall(r"Exit codes: \[[^\]]*\] ([0-9,]+)\s*$", text, re.M)
    if len(m) != 1:
        return {}
    out = {}
    for r, v in enumerate(int(x) for x in m[0].split(",")):
        out[r] = f"killed by signal {v & 0x7F}" if v & 0x7F else f"exit code {v >> 8}"
    return out


# -- a launch -----------------------------------------------------------------------------------
class MpiRun:
    """``mpiexec -n ranks python -m partir_emu.runtime.worker --jobs FILE`` for a list of jobs.

    ``jobs``: dicts as documented in :mod:`partir_emu.runtime.worker` (``out`` defaults to a
    directory in ``workdir``). ``timeout_s`` bounds the whole launch; the ranks' own watchdog
    uses ``rank_timeout_s`` (default ``timeout_s``). ``env`` adds environment variables.
    """

    def __init__(self, jobs: Sequence[dict], ranks: int, *, timeout_s: float = 300.0, workdir: str | os.PathLike,
                 rank_timeout_s: float | None = None, env: dict[str, str] | None = None,
                 mpiexec: str | os.PathLike | None = None, mpiexec_args: Sequence[str] = ()) -> None:
        self.workdir = Path(workdir).resolve()
        self.jobs = []
        for j, job in enumerate(jobs):
            job = dict(job)
            job.setdefault("out", str(self.workdir / f"job-{j}"))
            self.jobs.append(job)
        self.ranks, self.timeout_s = int(ranks), float(timeout_s)
        self.rank_timeout_s = float(rank_timeout_s if rank_timeout_s is not None else timeout_s)
        self.env_extra = dict(env or {})
        self.mpiexec = Path(mpiexec) if mpiexec else mpiexec_path()
        self.mpiexec_args = list(mpiexec_args)
        self.progress_dir = self.workdir / "progress"
        self.proc: subprocess.Popen | None = None
        self.start_wall = 0.0

    def start(self) -> MpiRun:
        self.progress_dir.mkdir(parents=True, exist_ok=True)
        jobs_file = self.workdir / "jobs.json"
        jobs_file.write_text(json.dumps({"jobs": self.jobs, "timeout": self.rank_timeout_s,
                                         "progress_dir": str(self.progress_dir)}))
        env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIP_ENV)}
        env["MPIEXEC_TIMEOUT"] = str(int(math.ceil(self.timeout_s + 3)))
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, "1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.update(self.env_extra)
        hydra = [] if not _is_hydra(self.mpiexec) else ["-print-all-exitcodes"]
        cmd = [str(self.mpiexec), "-n", str(self.ranks), *hydra, *self.mpiexec_args,
               sys.executable, "-m", "partir_emu.runtime.worker", "--jobs", str(jobs_file)]
        self._shm_before = _shm_files()
        self._out = open(self.workdir / "mpiexec.out", "w+b")
        self._err = open(self.workdir / "mpiexec.err", "w+b")
        self.start_wall = time.time()
        self._t0 = time.monotonic()
        self.watch = DeathWatch(self.progress_dir)
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._out, stderr=self._err, env=env,
                                         start_new_session=True)
        except OSError as exc:
            self.watch.stop()
            raise EmulationError(f"cannot start {self.mpiexec}: {exc}") from None
        return self

    def wait(self) -> list[dict]:
        """Wait for the launch; the jobs' results (``outputs``, ``stats``) or EmulationError."""
        assert self.proc is not None, "start() first"
        timed_out = False
        budget = self.timeout_s + 6 - (time.monotonic() - self._t0)
        try:
            self.proc.wait(timeout=max(budget, 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:           # KeyboardInterrupt: leave nothing behind
            self.stop()
            raise
        progress = self.read_progress()
        if timed_out:
            self.stop(progress)
        rc = self.proc.returncode
        if rc != 0 and "APPLICATION TIMED OUT" in self.output():    # MPIEXEC_TIMEOUT fired
            timed_out = True
        if timed_out or rc != 0:
            silent = self.watch.silent_deaths()
            self.watch.stop()
            progress = self.read_progress()
            cleanup_shm([s for p in progress for s in p.get("shm", [])], self._shm_before, self.start_wall)
            raise EmulationError(self._failure_message(rc, timed_out, progress, silent))
        self.watch.stop()
        for w in dict.fromkeys(ln for ln in self.output().splitlines() if ln.startswith("partir-emu: warning")):
            print(w, file=sys.stderr)       # the ranks' warnings
        self._close_logs()
        try:
            return [_read_result(job) for job in self.jobs]
        except (OSError, KeyError, ValueError) as exc:
            raise EmulationError(f"the MPI run exited 0 but its results are unreadable ({exc}); "
                                 f"mpiexec output:\n{self.output()[-2000:]}") from None

    def stop(self, progress: list[dict] | None = None) -> None:
        if self.proc is not None and (self.proc.poll() is None or progress):
            pids = [p["pid"] for p in (progress or self.read_progress()) if "pid" in p]
            stop_process_tree(self.proc, str(self.workdir), pids)

    def read_progress(self) -> list[dict]:
        return [r for f in sorted(self.progress_dir.glob("rank-*.json")) if (r := _read_record(f)) is not None]

    def output(self) -> str:
        text = ""
        for f in (self._out, self._err):
            try:
                f.flush()
                f.seek(0)
                text += f.read().decode(errors="replace")
            except (OSError, ValueError):
                pass
        return text

    def _close_logs(self) -> None:
        for f in (self._out, self._err):
            try:
                f.close()
            except OSError:
                pass

    def _failure_message(self, rc: int | None, timed_out: bool, progress: list[dict],
                         silent: list[tuple[float, dict]]) -> str:
        text = self.output()
        self._close_logs()
        lines = []
        if timed_out:
            lines.append(f"the MPI run ({self.ranks} ranks) timed out after {self.timeout_s:g} s (--timeout) and "
                         "was stopped")
        else:
            lines.append(f"the MPI run ({self.ranks} ranks) failed: mpiexec exit code {rc}")
        # the ranks' messages: from mpiexec's output, and from their progress records (MPI_Abort
        # can stop mpiexec before it has forwarded a rank's last words)
        said = [ln for ln in text.splitlines() if ln.startswith("partir-emu rank")]
        said += [ln for p in progress if p.get("phase") == "failed"
                 for ln in str(p.get("error", "")).splitlines() if ln.startswith("partir-emu rank")]
        msgs = list(dict.fromkeys(said))
        first_failure = min((r.get("t", math.inf) for r in progress if r.get("phase") == "failed"),
                            default=math.inf)
        silent = [(t, r) for t, r in silent if t < first_failure]   # died before anyone reported
        if silent and not timed_out:
            # the first rank to exit without a word is the one that died; mpiexec stopped the others
            status = _exit_statuses(text)
            t_first, first = silent[0]
            same = [r for t, r in silent if t - t_first < 0.002]
            for r in same:
                how = status.get(int(r["rank"]), "no exit status")
                lines.append(f"partir-emu rank {r['rank']} {_where(r)}: died without a message ({how}); "
                             f"{'it was the first rank to exit' if len(same) == 1 else 'one of the first ranks to exit'}"
                             f", mpiexec stopped the others")
        lines += msgs[:8] + ([f"... and {len(msgs) - 8} more rank messages"] if len(msgs) > 8 else [])
        lines += list(dict.fromkeys(ln for ln in text.splitlines() if ln.startswith("partir-emu: warning")))[:4]
        if not msgs or timed_out or any("timed out" in m for m in msgs):
            lines += _laggards(progress)
            lines.append("last positions: " + _positions(progress, self.ranks))
        if not msgs and not silent:
            tail = "\n".join(ln for ln in text.splitlines() if ln.strip())[-1500:]
            if tail:
                lines.append("mpiexec output (tail):\n" + tail)
        return "\n".join(lines)


def _is_hydra(mpiexec: Path) -> bool:
    try:
        real = Path(os.path.realpath(mpiexec))
    except OSError:
        return False
    return "hydra" in real.name or (real.parent / "mpiexec.hydra").exists()


def _op(p: dict) -> str:
    if "op" in p and p.get("phase") in ("step", "failed"):
        return f"op {p['op']} ({p.get('prim')} at {p.get('source')}; {p.get('state')})"
    return f"op - ({p.get('phase')})"


def _where(p: dict) -> str:
    from partir_emu.runtime.mpi_mesh import device_str
    devs = device_str(p["devices"]) + " " if p.get("devices") else ""
    return devs + _op(p)


def _positions(progress: list[dict], ranks: int) -> str:
    if not progress:
        return f"no rank reported progress (of {ranks}); MPI start-up failed or was too slow"
    groups: dict[str, list[int]] = {}
    for p in progress:
        key = _op(p)
        groups.setdefault(key, []).append(p["rank"])
    missing = ranks - len(progress)
    parts = [f"rank{'s' if len(r) > 1 else ''} {_ranges(r)}: {k}" for k, r in sorted(groups.items(), key=lambda kv: kv[1])]
    if missing > 0:
        parts.append(f"{missing} rank(s) never started")
    return "; ".join(parts)


def _laggards(progress: list[dict]) -> list[str]:
    """On a timeout: the ranks still computing before a collective the others already wait in."""
    stepping = [p for p in progress if "op" in p and p.get("phase") in ("step", "failed")]
    waiting = [p for p in stepping if p.get("state") == "waiting for the other ranks"]
    if not waiting:
        return []
    front = max(p["op"] for p in waiting)
    behind = [p for p in stepping if p["op"] < front or (p["op"] == front and p.get("state") == "computing")]
    ahead = sorted(p["rank"] for p in waiting if p["op"] == front)
    return [f"partir-emu rank {p['rank']} {_where(p)}: behind the others (rank{'s' if len(ahead) > 1 else ''} "
            f"{_ranges(ahead)} wait in op {front}); it is stuck after this op" for p in behind[:8]]


def _ranges(xs: list[int]) -> str:
    xs = sorted(xs)
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def _read_result(job: dict) -> dict:
    from partir_emu.runtime.worker import read_job_result
    return read_job_result(job)


def launch(jobs: Sequence[dict], ranks: int, **kw: Any) -> list[dict]:
    """Run ``jobs`` in one mpiexec launch of ``ranks`` ranks; their results (see :class:`MpiRun`).
    Uses a temporary ``workdir`` unless one is given."""
    if kw.get("workdir") is not None:
        return MpiRun(jobs, ranks, **kw).start().wait()
    with tempfile.TemporaryDirectory(prefix="partir-emu-mpi-") as tmp:
        kw["workdir"] = tmp
        return MpiRun(jobs, ranks, **kw).start().wait()


# -- the CLI ------------------------------------------------------------------------------------
def reference_outputs(exp, inputs: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """``jax.jit(step)`` on the experiment's inputs, or on ``inputs`` (flat, program order)."""
    return exp.reference(inputs)


def _layout(exp, args) -> tuple[int, int]:
    n = exp.mesh.size
    if args.devices is not None and args.devices != n:
        raise MeshError(f"--devices {args.devices} but the mesh {exp.mesh} has {n} devices; give a --mesh "
                        f"with {args.devices} devices (e.g. batch={args.devices})")
    k = args.devices_per_rank
    if k < 1 or n % k:
        raise MeshError(f"--devices-per-rank {k} does not divide the {n} devices of {exp.mesh}")
    return n, k


def _algorithm(args) -> str:
    from partir_emu.runtime.mpi_mesh import MPI_ALGORITHMS
    if args.algorithm not in MPI_ALGORITHMS:
        raise ArgumentError(f"--algorithm {args.algorithm!r} is not available on the MPI backend; "
                            f"use one of {MPI_ALGORITHMS}")
    return args.algorithm


def run_mpi_cli(exp, args) -> dict | None:
    """``partir-emu run --backend mpi``: the report (on rank 0 / the launcher), None on other ranks."""
    if under_mpirun():
        return run_in_ranks(exp, args)
    return run_self_launched(exp, args)


def run_self_launched(exp, args) -> dict:
    from partir_emu.experiment import load_inputs_npz, report, verify
    n, k = _layout(exp, args)
    algorithm = _algorithm(args)
    t0 = time.perf_counter()
    low = exp.lower()
    lower_s = time.perf_counter() - t0
    spmd = low.spmd
    inputs = load_inputs_npz(args.inputs, spmd.input_names) if args.inputs else None
    with tempfile.TemporaryDirectory(prefix="partir-emu-mpi-") as tmp:
        prog = Path(tmp) / "program.json"
        spmd.save(prog)
        job = {"program": str(prog), "scenario": exp.scenario_name, "preset": exp.preset,
               "overrides": exp.overrides, "seed": exp.seed, "algorithm": algorithm, "devices_per_rank": k,
               "inputs": str(Path(args.inputs).resolve()) if args.inputs else None,
               "trace": str(Path(args.trace_messages).resolve()) if args.trace_messages else None}
        run = MpiRun([job], n // k, timeout_s=args.timeout, workdir=tmp).start()
        try:
            t_ref = time.perf_counter()
            ref = reference_outputs(exp, inputs)     # overlaps with the ranks' start-up
            ref_s = time.perf_counter() - t_ref
        except BaseException:
            run.stop()
            raise
        res = run.wait()[0]
        start_wall = run.start_wall
    st = res["stats"]
    ver = verify(res["outputs"], ref, spmd.output_names)
    wall = time.perf_counter() - t0
    return report(exp, spmd, "mpi", ver, st["peak_bytes_per_device"], wall, extra={
        "ranks": st["ranks"], "devices_per_rank": k, "algorithm": algorithm, "lower_s": lower_s,
        "launch_s": max(st["ready_wall"]) - start_wall, "step_s": st["step_s"], "gather_s": st["gather_s"],
        "reference_s": ref_s, "rss_bytes_total": int(sum(st["rss_bytes"])), "rss_bytes_max": int(max(st["rss_bytes"])),
        "launcher_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "trace_messages": job["trace"]})


def run_in_ranks(exp, args) -> dict | None:
    """One rank of a user's ``mpirun -n R partir-emu run … --backend mpi``."""
    from mpi4py import MPI

    from partir_emu.core.spmd import SpmdProgram
    from partir_emu.experiment import load_inputs_npz, report, verify
    from partir_emu.runtime.mpi_mesh import wait_all
    from partir_emu.runtime.worker import RankGuard, numpy_inputs, run_job
    comm = MPI.COMM_WORLD
    rank, nranks = comm.Get_rank(), comm.Get_size()
    n, k = _layout(exp, args)
    algorithm = _algorithm(args)
    if nranks * k != n:
        raise MeshError(f"{exp.mesh} has {n} devices but mpirun started {nranks} ranks × --devices-per-rank {k}; "
                        f"use -n {n // k}, or --devices-per-rank {n // nranks if n % nranks == 0 else '?'}")
    t0 = time.perf_counter()
    guard = RankGuard(comm, args.timeout)
    data, err = b"", None
    if rank == 0:
        try:
            data = exp.lower().spmd.dumps().encode()
        except Exception as exc:        # tell the others, then raise it here
            err = exc
    length = np.array([len(data)], np.int64)
    wait_all([comm.Ibcast([length, MPI.INT64_T], root=0)], args.timeout, "the program broadcast from rank 0")
    if err is not None:
        guard.close()
        raise err
    if length[0] == 0:
        guard.close()
        raise EmulationError(f"rank {rank}: rank 0 could not lower the program (see its message)")
    buf = np.frombuffer(data, np.uint8).copy() if rank == 0 else np.empty(int(length[0]), np.uint8)
    wait_all([comm.Ibcast([buf, MPI.BYTE], root=0)], args.timeout, "the program broadcast from rank 0", bulk=True)
    lower_s = time.perf_counter() - t0
    with guard:
        spmd = SpmdProgram.loads(buf.tobytes(), "<broadcast program>")
        inputs = (load_inputs_npz(args.inputs, spmd.input_names) if args.inputs else
                  numpy_inputs(exp.scenario_name, exp.preset, exp.overrides, exp.seed))
        job = {"algorithm": algorithm, "devices_per_rank": k, "trace": args.trace_messages}
        res = run_job(comm, spmd, job, guard, inputs=inputs, timeout_s=args.timeout)
    guard.close()
    if rank != 0:
        return None
    st = res["stats"]
    ref = reference_outputs(exp, inputs if args.inputs else None)
    ver = verify(res["outputs"], ref, spmd.output_names)
    return report(exp, spmd, "mpi", ver, st["peak_bytes_per_device"], time.perf_counter() - t0, extra={
        "ranks": nranks, "devices_per_rank": k, "algorithm": algorithm, "lower_s": lower_s,
        "launch_s": max(st["ready_wall"]) - min(st["start_wall"]), "step_s": st["step_s"], "gather_s": st["gather_s"],
        "rss_bytes_total": int(sum(st["rss_bytes"])), "rss_bytes_max": int(max(st["rss_bytes"])),
        "jax_imported_by_rank": st["jax_imported"], "trace_messages": args.trace_messages})
