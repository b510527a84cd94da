"""``partir-emu run … --backend mpi``: launch (or join) an MPI run of a scenario and verify it.

Two ways to run, chosen by :func:`~partir_emu.mpi.environ.under_mpirun`:

**Self-launched** (no mpirun around us): ``partir-emu run mlp --mesh batch=64 --backend mpi
--devices 64 --devices-per-rank 4``. This process traces and lowers (it alone imports jax),
writes the SpmdProgram (JSON), the scenario's inputs (.npz, keyed by input name) and a jobs
file to a temp dir, and starts the ranks with :class:`~partir_emu.mpi.launch.MpiRun`.
No rank imports jax or the scenario. While the ranks run, this process computes the
``jax.jit`` reference; rank 0 writes the unsharded outputs and the stats, and this process
verifies and reports.

**Under the user's mpirun**: ``mpirun -n R partir-emu run … --backend mpi --devices-per-rank k``.
Rank 0 lowers (only rank 0 imports jax) and broadcasts the program as JSON bytes (``Ibcast``
of its length, then of a uint8 buffer); every rank makes its inputs (numpy only) and runs its
devices (:func:`partir_emu.mpi.ranks.worker.run_job`); rank 0 gathers, verifies and reports; the
other ranks return ``None``. Works with a hostfile and the system's ``mpirun`` across hosts.

Stopping (Ctrl-C, SIGTERM, SIGHUP): self-launched, the launcher stops mpiexec and the ranks,
removes the shm segments and the temp dir, and the CLI prints one line; under the user's
mpirun the ranks drop their segment and exit, and the host's sentinel
(:mod:`partir_emu.mpi.procs.sentinel`) prints the one line — or names the rank that died.

Either way the report is the local backend's plus ``ranks``, ``devices_per_rank``,
``launch_s`` (mpiexec start, or the first rank's start, to the last rank holding its
inputs), ``step_s`` (between two barriers), ``lower_s``, ``gather_s`` and ``rss_bytes_total``
(sum of the ranks' max RSS).

:func:`launch` and :class:`ScenarioMpiRun` are the runtime's launcher for jobs that name a
scenario (``"scenario"``, ``"preset"``, ``"overrides"``, ``"seed"``) instead of an inputs
file: the inputs are generated here and written next to the jobs.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from partir_emu.app import checks
from partir_emu.app.cli.phases import announce
from partir_emu.app.common import print_warnings
from partir_emu.app.experiment import Experiment, flatten, load_inputs_npz, report
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import ArgumentError, MeshError
from partir_emu.mpi.environ import under_mpirun
from partir_emu.mpi.hosts import check_cli
from partir_emu.mpi.interrupts import note
from partir_emu.mpi.jobs import MPI_ALGORITHMS, save_inputs
from partir_emu.mpi.launch import MpiRun
from scenarios import get_scenario


# -- inputs for the ranks (numpy only) --------------------------------------------------------------
def numpy_inputs(scenario: str, preset: str | None, overrides: Any, seed: int) -> list[np.ndarray]:
    """The scenario's global inputs, flat in jax's order, without importing jax
    (the same values as ``Experiment.inputs()``: ``Scenario.make_inputs`` is numpy-only)."""
    sc = get_scenario(scenario)
    return flatten(sc.make_inputs(sc.config(preset, overrides), seed))


def with_inputs(jobs: Sequence[dict], workdir: str | os.PathLike) -> list[dict]:
    """``jobs`` with every scenario job turned into an inputs-file job (files in ``workdir``,
    one per distinct scenario/preset/overrides/seed); jobs that name ``inputs`` are kept."""
    out: list[dict] = []
    files: dict[str, str] = {}
    for job in jobs:
        job = dict(job)
        made_from = {key: job.pop(key, None) for key in ("scenario", "preset", "overrides", "seed")}
        if not job.get("inputs"):
            if made_from["scenario"] is None:
                raise ArgumentError(f"job {job.get('program')}: give \"inputs\" (.npz) or a \"scenario\"")
            key = json.dumps(made_from, sort_keys=True)
            if key not in files:
                files[key] = str(Path(workdir) / f"inputs-{len(files)}.npz")
                names = SpmdProgram.load(job["program"]).input_names
                save_inputs(files[key], names, numpy_inputs(made_from["scenario"], made_from["preset"],
                                                            made_from["overrides"], int(made_from["seed"] or 0)))
            job["inputs"] = files[key]
        out.append(job)
    return out


class ScenarioMpiRun(MpiRun):
    """An :class:`MpiRun` whose jobs may name a scenario instead of an inputs file."""

    def __init__(self, jobs: Sequence[dict], ranks: int, *, workdir: str | os.PathLike, **kw: Any) -> None:
        super().__init__(with_inputs(jobs, workdir), ranks, workdir=workdir, **kw)


def launch(jobs: Sequence[dict], ranks: int, **kw: Any) -> list[dict]:
    """Run ``jobs`` (scenario or inputs-file jobs) in one mpiexec launch; their results."""
    if kw.get("workdir") is not None:
        return ScenarioMpiRun(jobs, ranks, **kw).start().wait()
    with tempfile.TemporaryDirectory(prefix="partir-emu-mpi-") as tmp:
        kw["workdir"] = tmp
        return ScenarioMpiRun(jobs, ranks, **kw).start().wait()


# -- the CLI ------------------------------------------------------------------------------------
def _layout(exp: Experiment, args: argparse.Namespace) -> tuple[int, int]:
    n = exp.mesh.size
    if args.devices is not None and args.devices != n:
        raise MeshError(f"--devices {args.devices} but the mesh {exp.mesh} has {n} devices; give a --mesh "
                        f"with {args.devices} devices (e.g. batch={args.devices})")
    k = args.devices_per_rank or 1
    if k < 1 or n % k:
        raise MeshError(f"--devices-per-rank {k} does not divide the {n} devices of {exp.mesh}")
    return n, k


def _algorithm(args: argparse.Namespace) -> str:
    if args.algorithm not in MPI_ALGORITHMS:
        raise ArgumentError(f"--algorithm {args.algorithm!r} is not available on the MPI backend; "
                            f"use one of {MPI_ALGORITHMS}")
    return args.algorithm


def _run_stats(st: dict) -> dict:
    return {"step_s": st["step_s"], "gather_s": st["gather_s"], "rss_bytes_total": int(sum(st["rss_bytes"])),
            "rss_bytes_max": int(max(st["rss_bytes"]))}


MPI_TIMEOUT_S = 300.0       # `run --backend mpi` without --timeout


def _timeout(args: argparse.Namespace) -> float:
    return MPI_TIMEOUT_S if args.timeout is None else args.timeout


def run_mpi_cli(exp: Experiment, args: argparse.Namespace) -> dict | None:
    """``partir-emu run --backend mpi``: the report (on rank 0 / the launcher), None on other ranks."""
    if under_mpirun():
        return run_in_ranks(exp, args)
    return run_self_launched(exp, args)


def run_self_launched(exp: Experiment, args: argparse.Namespace) -> dict:
    n, k = _layout(exp, args)
    algorithm = _algorithm(args)
    t0 = time.perf_counter()
    low = exp.lower()                     # (in a helper thread: a stop signal is taken at once)
    print_warnings(low.warnings)
    spmd = low.spmd
    lower_s = time.perf_counter() - t0
    checks.check_run_memory(spmd, n)        # all n devices live on this machine: before any array exists
    inputs = (load_inputs_npz(args.inputs, spmd.input_names) if args.inputs else
              numpy_inputs(exp.scenario_name, exp.preset, exp.overrides, exp.seed))
    trace = str(Path(args.trace_messages).resolve()) if args.trace_messages else None
    hosts = check_cli(args, True, False)
    tmp = None
    try:
        with tempfile.TemporaryDirectory(prefix="partir-emu-mpi-", dir=getattr(args, "workdir", None)) as tmp:
            spmd.save(Path(tmp) / "program.json")
            save_inputs(Path(tmp) / "inputs.npz", spmd.input_names, inputs)
            job = {"program": str(Path(tmp) / "program.json"), "inputs": str(Path(tmp) / "inputs.npz"),
                   "algorithm": algorithm, "kernels": args.kernels, "devices_per_rank": k, "trace": trace}
            run = MpiRun([job], n // k, timeout_s=_timeout(args), workdir=tmp, fault=args.inject_fault, hosts=hosts,
                         shared_workdir=getattr(args, "workdir", None) is not None)
            try:
                announce("launch, step (and the references meanwhile)")
                run.start()
                t_ref = time.perf_counter()
                refs = exp.references(inputs)   # overlaps with the ranks' start-up
                ref_s = time.perf_counter() - t_ref
                res = run.wait()[0]
            except BaseException as exc:        # Ctrl-C/SIGTERM/SIGHUP or an error: stop the ranks
                run.abort(exc)
                raise
    except KeyboardInterrupt as exc:            # TemporaryDirectory removed the work dir on the way out
        note(exc, removed=f"its temp dir {Path(tmp).name}" if tmp and not Path(tmp).exists() else None)
        raise
    st = res["stats"]
    announce("verify")
    ver = exp.check(res["outputs"], inputs, spmd.output_names, refs)
    return report(exp, spmd, "mpi", ver, st["peak_bytes_per_device"], time.perf_counter() - t0, extra={
        "ranks": st["ranks"], "devices_per_rank": k, "algorithm": algorithm, "kernels": st["kernels"], "lower_s": lower_s,
        "launch_s": max(st["ready_wall"]) - run.start_wall, "reference_s": ref_s, **_run_stats(st),
        "launcher_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "trace_messages": trace})


def _lower_and_warn(exp: Experiment) -> SpmdProgram:
    """Rank 0's lowering for the broadcast, its warnings printed once (by rank 0)."""
    low = exp.lower()
    print_warnings(low.warnings)
    return low.spmd


def run_in_ranks(exp: Experiment, args: argparse.Namespace) -> dict | None:
    """One rank of a user's ``mpirun -n R partir-emu run … --backend mpi``."""
    # why here: the worker imports mpi4py, which initializes MPI: only a process mpirun started may
    from partir_emu.mpi.ranks import worker
    comm = worker.world()
    rank, nranks = comm.Get_rank(), comm.Get_size()
    n, k = _layout(exp, args)
    algorithm = _algorithm(args)
    if nranks * k != n:
        raise MeshError(f"{exp.mesh} has {n} devices but mpirun started {nranks} ranks × --devices-per-rank {k}; "
                        f"use -n {n // k}, or --devices-per-rank {n // nranks if n % nranks == 0 else '?'}")
    t0 = time.perf_counter()
    guard = worker.guard_under_mpirun(comm, _timeout(args))
    spmd = worker.broadcast_program(comm, guard, lambda: _lower_and_warn(exp), _timeout(args))
    lower_s = time.perf_counter() - t0
    with guard:
        inputs = (load_inputs_npz(args.inputs, spmd.input_names) if args.inputs else
                  numpy_inputs(exp.scenario_name, exp.preset, exp.overrides, exp.seed))
        job = {"algorithm": algorithm, "kernels": args.kernels, "devices_per_rank": k, "trace": args.trace_messages,
               "fault": args.inject_fault}
        res = worker.run_job(comm, spmd, job, guard, inputs=inputs, timeout_s=_timeout(args))
    guard.close()
    if rank != 0:
        return None
    assert res is not None   # why: run_job returns the result on rank 0, which this is
    st = res["stats"]
    try:
        refs = exp.references(inputs)
    except KeyboardInterrupt as exc:     # the other ranks are done: only this one was left to stop
        note(exc, stopped=f"rank 0 of {nranks} while it computed the reference (the others had finished)")
        raise
    ver = exp.check(res["outputs"], inputs, spmd.output_names, refs)
    return report(exp, spmd, "mpi", ver, st["peak_bytes_per_device"], time.perf_counter() - t0, extra={
        "ranks": nranks, "devices_per_rank": k, "algorithm": algorithm, "kernels": st["kernels"], "lower_s": lower_s,
        "launch_s": max(st["ready_wall"]) - min(st["start_wall"]), **_run_stats(st),
        "jax_imported_by_rank": st["jax_imported"], "trace_messages": args.trace_messages})
