"""Check before work: every path, number and size a command line gives, before anything is lowered.

A bad ``--report`` directory or a ``--timeout nan`` must fail in milliseconds, not after half a
minute of lowering and running, and a run that cannot fit in memory must be refused before it
allocates. Three kinds of check live here:

- **argparse types** (:func:`positive_int`, :func:`seconds`, ...): a value that is not a number
  of the right kind is refused by the parser itself (one line, exit 2);
- **paths** (:func:`check_output_path`, :func:`check_input_file`): an output's directory exists
  and is writable and the output is not a directory; an input is a readable file;
- **sizes**: meshes beyond :data:`MAX_SIMULATE_DEVICES` / :data:`MAX_RUN_DEVICES` are refused at
  once; a ``run`` is refused when a lower bound of its memory (:func:`input_bytes`, from the sizes
  alone) or the estimate from the lowered program (:func:`run_memory_bytes`) exceeds the
  machine's available memory (``MemAvailable`` in ``/proc/meminfo``).

Every refusal is a :class:`~partir_emu.errors.UsageError` naming the flag, the value and what to do.
"""
from __future__ import annotations

import argparse
import errno
import math
import os
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from partir_emu.collectives.algorithms import ALGORITHMS
from partir_emu.core.dtypes import np_dtype
from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import UsageError
from partir_emu.hwmodels.compute.memory import peak_memory
from partir_emu.mpi.environ import mpirun_rank
from partir_emu.mpi.hosts import check_cli
from partir_emu.mpi.jobs import MPI_ALGORITHMS

# The analytical model and the DES are closed-form or symmetry-reduced, but placement and the
# schedules still walk the devices: beyond a million devices nothing answers in useful time.
MAX_SIMULATE_DEVICES = 1 << 20
# Emulated devices hold real arrays and run the program in Python: 4096 is about what a large
# workstation can hold in one run (README: 1024 devices on a 24 GiB laptop, 64 per rank).
MAX_RUN_DEVICES = 1 << 12
# An MPI rank's own memory before it holds any array (measured ~25 MB PSS; MPICH + numpy + us).
RANK_OVERHEAD_BYTES = 32 << 20
LOCAL_ALGORITHMS: tuple[str, ...] = (*ALGORITHMS, "direct")
MAX_SEED = 2**63 - 1


# -- argparse types: a bad number is refused by the parser (one line, exit 2) -----------------------
def _int(text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (``--top``, ``--devices``, ``--chunk-bytes``, ...)."""
    v = _int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be at least 1")
    return v


def nonnegative_int(text: str) -> int:
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} must be 0 or more")
    return v


def seed(text: str) -> int:
    """A random seed numpy accepts: 0 <= seed < 2**63."""
    v = _int(text)
    if not 0 <= v <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{v} must be between 0 and 2**63-1")
    return v


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return v


def seconds(text: str) -> float:
    """A finite duration > 0 (``--timeout``)."""
    v = _float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{v:g} s must be more than 0")
    return v


def nonnegative_seconds(text: str) -> float:
    """A finite duration >= 0 (``--merge-window``, ``--message-overhead``)."""
    v = _float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v:g} s must be 0 or more")
    return v


# -- paths ------------------------------------------------------------------------------------------
def check_output_path(path: str | None, flag: str) -> None:
    """``path`` can be written: not a directory, in an existing, writable directory (None: not given)."""
    if path is None:
        return
    _not_empty(path, flag)
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; give a file name in it, e.g. {p / 'out'}")
    parent = p.parent
    if not parent.exists():
        raise UsageError(f"{flag} {path}: directory {parent} does not exist; create it or choose another path")
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: directory {parent} is not writable; choose another path")


PLOT_FORMATS = ("png", "pdf", "svg", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")
"""Image formats every matplotlib backend writes (the plot's format is its file name's suffix)."""


def only_with(value: object, flag: str, applies: bool, when: str, otherwise: str = "") -> None:
    """Refuse ``flag`` given (``value`` not None) where it does nothing: it ``applies`` only ``when``
    (e.g. "with --backend mpi"). An option silently ignored hides a user's mistake."""
    if value is not None and value is not False and not applies:
        shown = "" if value is True else f" {value:g}" if isinstance(value, float) else f" {value}"
        raise UsageError(f"{flag}{shown} applies only {when}, so here it would be ignored; drop it or change the "
                         f"command" + (f" ({otherwise})" if otherwise else ""))


def check_plot_path(path: str | None, flag: str) -> None:
    """As :func:`check_output_path`, and ``path`` names an image format matplotlib writes: checked
    before any work, so a typo does not cost the run."""
    check_output_path(path, flag)
    if path is None:
        return
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in PLOT_FORMATS:
        raise UsageError(f"{flag} {path}: {'no suffix' if not suffix else f'unknown image format .{suffix}'}; "
                         f"end the file name in .png, .pdf or .svg (or {', '.join('.' + f for f in PLOT_FORMATS[3:])})")


def check_input_file(path: str | None, flag: str) -> None:
    """``path`` is an existing, readable regular file (None: not given)."""
    if path is None:
        return
    _not_empty(path, flag)
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{flag} {path}: no such file")
    if not p.is_file():
        raise UsageError(f"{flag} {path}: is {'a directory' if p.is_dir() else 'not a regular file'}; give a file")
    if not os.access(p, os.R_OK):
        raise UsageError(f"{flag} {path}: not readable (permissions)")


def _not_empty(path: str, flag: str) -> None:
    if not path.strip():
        raise UsageError(f"{flag}: the path is empty; give a file name")
    if "\0" in path:
        raise UsageError(f"{flag} {path!r}: a path cannot contain a NUL character")
    try:
        os.stat(path)
    except FileNotFoundError:
        pass
    except OSError as exc:          # a name too long, a loop of links, a file used as a directory
        if exc.errno != errno.ENOTDIR:
            raise UsageError(f"{flag} {path[:200]}: {exc.strerror}") from None


def check_npz(path: str, flag: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``path`` is an ``.npz`` of ``.npy`` arrays without pickles: ``{key: (shape, dtype)}`` from the
    headers alone (cheap: no array is read)."""
    check_input_file(path, flag)
    out = {}
    try:
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                with z.open(name) as f:
                    version = np.lib.format.read_magic(f)
                    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                        np.lib.format.read_array_header_2_0
                    shape, _, dtype = read(f)
                if dtype.hasobject:
                    raise ValueError(f"member {name!r} holds Python objects (pickles)")
                out[name.removesuffix(".npy")] = (tuple(shape), dtype)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise UsageError(f"{flag} {path}: not an .npz of plain arrays ({exc}); write one with numpy.savez") from None
    return out


def check_inputs_file(path: str | None, exp: Any, flag: str = "--inputs") -> None:
    """``path`` holds the experiment's inputs: keys = its input names (or ``arr_0 …`` in order), with the
    right shapes (dtypes are checked when the arrays are loaded). Reads headers only; needs the input
    names (imports jax, lowers nothing)."""
    if path is None:
        return
    headers = check_npz(path, flag)
    want = exp.scenario.input_shapes(exp.cfg)
    names = list(want)
    keys = names if all(n in headers for n in names) else [f"arr_{i}" for i in range(len(names))]
    if not all(k in headers for k in keys):
        missing = [n for n in names if n not in headers][:3]
        raise UsageError(f"{flag} {path}: keys {sorted(headers)[:3]}{'…' if len(headers) > 3 else ''} are neither "
                         f"the input names (missing e.g. {missing}) nor arr_0..arr_{len(names) - 1}")
    for name, key in zip(names, keys):
        shape, dtype = headers[key]
        if shape != tuple(want[name]):
            raise UsageError(f"{flag} {path}: {key!r} has shape {list(shape)} but input {name!r} of "
                             f"{exp.scenario_name} at these sizes has {list(want[name])}")


def check_cache_dir(path: str | None, flag: str) -> None:
    """``path`` is a writable directory, or can be created as one (None: not given)."""
    if path is None:
        return
    _not_empty(path, flag)
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise UsageError(f"{flag} {path}: exists and is not a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {path}: directory is not writable")
        return
    check_output_path(str(p), flag)


# -- sizes ------------------------------------------------------------------------------------------
def check_mesh_size(mesh: Mesh, limit: int, cmd: str, hint: str = "", what: str = "--mesh") -> None:
    if mesh.size > limit:
        raise UsageError(f"{what} {_mesh_str(mesh)} has {mesh.size:,} devices; `{cmd}` takes at most {limit:,}"
                         + (f"; {hint}" if hint else ""))


def check_fits_hardware(mesh: Mesh, max_chips: int, hardware: str, what: str = "--mesh") -> None:
    """Refuse a mesh larger than the hardware before placement searches its shapes."""
    if mesh.size > max_chips:
        raise UsageError(f"{what} {_mesh_str(mesh)} has {mesh.size:,} devices but {hardware} has at most "
                         f"{max_chips:,} chips; use a smaller mesh or another --hardware")


def _mesh_str(mesh: Mesh) -> str:
    return ",".join(f"{a}={n}" for a, n in mesh.axes)


def check_run_args(args: argparse.Namespace, exp: Any) -> None:
    """Everything about ``partir-emu run`` that can be checked before lowering (cheap)."""
    mesh, n = exp.mesh, exp.mesh.size
    preset = exp.preset or exp.scenario.default_preset
    if preset in exp.scenario.simulation_only:
        raise UsageError(f"--size {preset} of {exp.scenario_name!r} is simulation-only (too big to emulate); "
                         f"use `partir-emu simulate {exp.scenario_name} --size {preset} ...`, or `run` a smaller "
                         f"--size ({', '.join(p for p in exp.scenario.presets if p not in exp.scenario.simulation_only)})")
    check_mesh_size(mesh, MAX_RUN_DEVICES, "run", "use `partir-emu simulate` for larger meshes")
    if args.devices is not None and args.devices != n:
        raise UsageError(f"--devices {args.devices} but the mesh {_mesh_str(mesh)} has {n} devices; give a --mesh "
                         f"with {args.devices} devices (e.g. --mesh batch={args.devices}) or drop --devices")
    mpi = args.backend == "mpi"
    known = MPI_ALGORITHMS if mpi else LOCAL_ALGORITHMS
    if args.algorithm not in known:
        also = " (it is not available on the MPI backend)" if mpi and args.algorithm in LOCAL_ALGORITHMS else ""
        raise UsageError(f"--algorithm {args.algorithm!r} is not a collective algorithm of the {args.backend} "
                         f"backend{also}; use one of {', '.join(known)}")
    only_with(args.devices_per_rank, "--devices-per-rank", mpi, "with --backend mpi",
              "the local backend runs every device in this process")
    only_with(args.timeout, "--timeout", mpi, "with --backend mpi", "the local backend runs in this process: "
              "stop it with Ctrl-C")
    only_with(args.trace_messages, "--trace-messages", mpi, "with --backend mpi", "it records MPI transfers")
    per_rank = args.devices_per_rank or 1
    if mpi and n % per_rank:
        raise UsageError(f"--devices-per-rank {per_rank} does not divide the {n} devices of {_mesh_str(mesh)}")
    check_output_path(args.trace_messages, "--trace-messages")
    check_output_path(args.report, "--report")
    rank = mpirun_rank()
    check_cli(args, mpi, rank is not None)      # --hosts, --hostfile, --launcher, --launcher-exec, --workdir
    if rank in (None, 0):
        check_inputs_file(args.inputs, exp)
    elif args.inputs is not None:
        check_npz(args.inputs, "--inputs")      # the input names need jax, which ranks > 0 never import
    inputs = input_bytes(exp)
    if rank is None:        # this machine holds everything: the inputs, and every device's shards
        ranks = n // per_rank if mpi else 0
        check_memory(2 * inputs + ranks * RANK_OVERHEAD_BYTES, f"its global inputs alone take {fmt_bytes(inputs)}, "
                     f"held once whole and once in the devices' shards"
                     + (f", + {ranks} MPI ranks × {fmt_bytes(RANK_OVERHEAD_BYTES)}" if ranks else ""),
                     "more --devices-per-rank, " if ranks else "")
    else:                   # under the user's mpirun (maybe many hosts): this rank holds the whole inputs
        check_memory(inputs + RANK_OVERHEAD_BYTES, f"each rank makes the global inputs, {fmt_bytes(inputs)}")


# -- memory -----------------------------------------------------------------------------------------
def input_bytes(exp: Any) -> int:
    """Bytes of the experiment's global inputs from its sizes alone (params, the state: Adam's two
    moments or e.g. a KV cache, batch)."""
    sc, cfg = exp.scenario, exp.cfg
    params = 4 * _count(sc.param_shapes(cfg))                 # float32 parameters
    batch = _batch_bytes(sc.batch_shapes(cfg))
    return params + sc.state_bytes(cfg) + batch


def _count(shapes: dict) -> int:
    return sum(_count(v) if isinstance(v, dict) else math.prod(v) for v in shapes.values())


def _batch_bytes(shapes: dict) -> int:
    total = 0
    for v in shapes.values():
        if isinstance(v, dict):
            total += _batch_bytes(v)
        else:
            shape, dtype = v
            total += math.prod(shape) * _itemsize(dtype)
    return total


def _itemsize(dtype: Any) -> int:
    return np_dtype(dtype).itemsize if isinstance(dtype, str) else np.dtype(dtype).itemsize


def run_memory_bytes(spmd: SpmdProgram, devices_here: int) -> tuple[int, dict[str, int]]:
    """Memory a run needs in this process: per-device peak (buffer liveness over the program) × the
    devices it hosts, plus the global inputs and gathered outputs (1×), and the verdict's references
    on the same inputs: the float32 ``jax.jit`` (1×) and the float64 one (2×), so 4× each in all.
    Returns ``(total, parts)``. Measured on ``mlp`` at 180 MiB of inputs: within ~10% of the growth
    of the process's maximum RSS (jax's own compile-time memory is not counted)."""
    per_device = peak_memory(spmd).peak_bytes
    ins = sum(math.prod(s) * _itemsize(v.dtype) for s, v in zip(spmd.global_in_shapes, spmd.program.inputs))
    outs = sum(math.prod(s) * _itemsize(v.dtype) for s, v in zip(spmd.global_out_shapes, spmd.program.outputs))
    parts = {"devices": per_device * devices_here, "inputs": 4 * ins, "outputs": 4 * outs}
    return sum(parts.values()), parts


def check_run_memory(spmd: SpmdProgram, devices_here: int) -> None:
    """Refuse a run whose estimated memory (:func:`run_memory_bytes`) exceeds the available memory."""
    total, parts = run_memory_bytes(spmd, devices_here)
    check_memory(total, f"{fmt_bytes(parts['devices'] // max(devices_here, 1))} peak per device × {devices_here} "
                        f"devices, + {fmt_bytes(parts['inputs'] + parts['outputs'])} of global inputs, outputs and "
                        f"the float32 and float64 references")


def check_memory(need: int, why: str, hint: str = "") -> None:
    avail = available_memory_bytes()
    if avail is not None and need > avail:
        raise UsageError(f"this run needs about {fmt_bytes(need)} of memory ({why}) but the machine has "
                         f"{fmt_bytes(avail)} available; use {hint}a smaller --size or --set, fewer devices, or "
                         f"`partir-emu simulate` (no arrays) for this size")


def available_memory_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` (None where there is none: then nothing is refused)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


__all__ = ["LOCAL_ALGORITHMS", "MAX_RUN_DEVICES", "MAX_SIMULATE_DEVICES", "available_memory_bytes",
           "check_cache_dir", "check_fits_hardware", "check_input_file", "check_inputs_file", "check_npz", "check_memory", "check_mesh_size",
           "check_output_path", "check_run_args", "check_run_memory", "fmt_bytes", "input_bytes",
           "nonnegative_int", "nonnegative_seconds", "only_with", "positive_int", "run_memory_bytes", "seconds", "seed"]
