"""The files between the MPI launcher and its ranks: jobs in, results out (JSON + npz, no pickle).

``JOBS.json`` is ``{"jobs": [JOB, ...], "timeout": seconds, "progress_dir": DIR | null}``;
one launch runs its jobs one after the other (tests batch many programs per ``mpiexec``).
A JOB is::

    {"program": "FILE.json",           # SpmdProgram.save() output; its mesh has R*k devices
     "inputs": "FILE.npz",             # global inputs, keys = the program's input names
     "algorithm": "ring", "devices_per_rank": k, "devices_per_node": null,
     "kernels": "blas" | "exact",      # the matmul kernel (partir_emu.runtime.kernels); default blas
     "out": "DIR",                     # rank 0 writes DIR/outputs.npz and DIR/stats.json
     "trace": "FILE.jsonl" | null,     # message trace (partir_emu.core.msgtrace)
     "fault": "rank:R:op:K:MODE"}      # test hook only (partir_emu.mpi.faults); absent: none

Arrays of ml_dtypes types (bfloat16, ...) are stored as unsigned ints of their width with their
dtype names in a ``__dtypes__`` entry (:func:`partir_emu.core.dtypes.storable`): numpy would save
them as raw void, which reads back without its dtype.

The inputs file is written by whoever prepares the job (the app layer turns a scenario into
one), so a rank reads arrays and never imports a model. Each rank cuts its devices' blocks.

**outputs.npz / stats.json** (rank 0): ``out_<j>`` = global output ``j`` (unsharded); stats:
``peak_bytes_per_device`` (list by device), ``rss_bytes`` (each rank's max RSS),
``ready_wall`` (each rank's ``time.time()`` when its inputs were ready), ``start_wall`` (each
rank's start), ``step_s`` (the step between two barriers, on rank 0), ``setup_s``,
``gather_s``, ``ranks``, ``devices_per_rank``, ``algorithm``, ``kernels``, ``jax_imported`` (per rank: was
``jax`` in ``sys.modules`` at the end — the tests hold it False).
"""
from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from partir_emu.collectives.algorithms import ALGORITHMS
from partir_emu.core.dtypes import array_files, restored, storable
from partir_emu.errors import ArtifactError, EmulationError
from partir_emu.mpi.bundle import pack, unpack

MPI_ALGORITHMS: tuple[str, ...] = ALGORITHMS + ("native",)    # a job's "algorithm"


def write_jobs(path: str | os.PathLike, jobs: Sequence[dict[str, Any]], timeout_s: float | None,
               progress_dir: str | os.PathLike | None) -> None:
    Path(path).write_text(json.dumps({"jobs": list(jobs), "timeout": timeout_s,
                                      "progress_dir": None if progress_dir is None else str(progress_dir)}))


def read_jobs(path: str | os.PathLike) -> dict[str, Any]:
    try:
        spec = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"cannot read the jobs file {path}: {exc}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("jobs"), list):
        raise ArtifactError(f"{path}: not a jobs file ({{\"jobs\": [...], \"timeout\": s, \"progress_dir\": DIR}})")
    return spec


def save_inputs(path: str | os.PathLike, names: Sequence[str], inputs: Sequence[np.ndarray]) -> None:
    """Global inputs for the ranks: one array per program input, keyed by its name."""
    if len(names) != len(inputs):
        raise ArtifactError(f"{len(inputs)} inputs for a program with {len(names)}: {list(names)[:5]}")
    # why Any: numpy's stub types savez's **kwds as the allow_pickle flag; these are all arrays
    arrays: dict[str, Any] = storable({n: np.asarray(x) for n, x in zip(names, inputs)})
    np.savez(path, **arrays)


def load_inputs(path: str | os.PathLike | IO[bytes], names: Sequence[str]) -> list[np.ndarray]:
    """The inputs :func:`save_inputs` wrote, in program order (``allow_pickle=False``)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [n for n in names if n not in z.files]
            if not missing:
                return [restored(z, n) for n in names]
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"cannot read the job's inputs {path} as an .npz without pickles ({exc})") from None
    raise ArtifactError(f"the job's inputs {path} lack the program inputs {missing[:5]}"
                        f"{' …' if len(missing) > 5 else ''}")


def write_job_result(job: dict[str, Any], outputs: Sequence[np.ndarray], stats: dict[str, Any]) -> None:
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    for name, data in job_result_files(0, outputs, stats).items():
        (out / name.split("/", 1)[1]).write_bytes(data)


def job_result_files(j: int, outputs: Sequence[np.ndarray], stats: dict[str, Any]) -> dict[str, bytes]:
    """Job ``j``'s result files by name (``job-J/outputs.npz``, ``job-J/stats.json``), as bytes."""
    arrays: dict[str, Any] = storable({f"out_{i}": x for i, x in enumerate(outputs)})   # why Any: as in save_inputs
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return {f"job-{j}/outputs.npz": buf.getvalue(), f"job-{j}/stats.json": json.dumps(stats).encode()}


def read_job_result(job: dict[str, Any]) -> dict[str, Any]:
    """``{"outputs": [...], "stats": {...}}`` written by rank 0 for ``job``."""
    out = Path(job["out"])
    with np.load(out / "outputs.npz", allow_pickle=False) as z:
        outputs = [restored(z, f"out_{j}") for j in range(len(array_files(z)))]
    return {"outputs": outputs, "stats": json.loads((out / "stats.json").read_text())}


def pack_jobs(jobs: Sequence[dict[str, Any]], timeout_s: float | None) -> bytes:
    """The jobs and every file they name (programs, inputs) as one bundle for rank 0's standard input
    (:mod:`partir_emu.mpi.bundle`): no rank needs to see the launcher's work dir."""
    files: dict[str, bytes] = {}
    names: dict[str, str] = {}
    packed = []
    for job in jobs:
        job = dict(job)
        for key, suffix in (("program", "json"), ("inputs", "npz")):
            path = job.get(key)
            if path:
                if path not in names:
                    names[path] = f"{key}-{len(names)}.{suffix}"
                    try:
                        files[names[path]] = Path(path).read_bytes()
                    except OSError as exc:
                        raise ArtifactError(f"cannot read the job's {key} {path}: {exc}") from None
                job[key] = names[path]
        packed.append(job)
    return pack({"jobs.json": json.dumps({"jobs": packed, "timeout": timeout_s, "progress_dir": None}).encode(),
                 **files})


def unpack_results(data: bytes | None, jobs: Sequence[dict[str, Any]]) -> None:
    """Write the results rank 0 sent back (``data``, a bundle) where each job expects them: ``out``
    (outputs.npz, stats.json) and ``trace``."""
    if data is None:
        raise EmulationError("the MPI run exited 0 but rank 0's results did not come back to the launcher")
    files = unpack(data, "rank 0's results")
    for j, job in enumerate(jobs):
        out = Path(job["out"])
        out.mkdir(parents=True, exist_ok=True)
        for name in ("outputs.npz", "stats.json"):
            (out / name).write_bytes(files[f"job-{j}/{name}"])
        if job.get("trace") and f"job-{j}/trace.jsonl" in files:
            Path(job["trace"]).write_bytes(files[f"job-{j}/trace.jsonl"])
