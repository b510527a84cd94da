"""``partir-emu``: run, show, list, simulate, hardware, validate, replay.

Every subcommand that can fail on user input prints the PartirError message
and exits with status 2 (no traceback); an emulation that runs but does not
verify exits with status 1.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from partir_emu.core.mesh import Mesh
from partir_emu.errors import PartirError, UsageError


def _add_common(p: argparse.ArgumentParser, mesh_default: str | None = "batch=2,model=2") -> None:
    p.add_argument("scenario", help="scenario name (see `partir-emu list`)")
    p.add_argument("--strategy", default="bp", help="strategy name, e.g. bp, mp, z3, bp+mp+z3")
    p.add_argument("--mesh", default=mesh_default, help="AXIS=N,... (default %(default)s)")
    p.add_argument("--size", default=None, help="size preset (tiny, small, ...; default: the scenario's)")
    p.add_argument("--set", dest="overrides", default=None, help="size overrides, e.g. batch=16,hidden=64")
    p.add_argument("--seed", type=int, default=0)


def _experiment(args):
    from partir_emu.experiment import Experiment
    return Experiment(args.scenario, args.strategy, Mesh.parse(args.mesh), args.size, args.overrides, args.seed,
                      getattr(args, "inputs", None))


def _write_report(rep: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rep, f, indent=2, sort_keys=True)
            f.write("\n")


def _summary(rep: dict) -> str:
    coll = ", ".join(f"{k}={v}" for k, v in sorted(rep["collectives"].items())) or "none"
    lines = [
        f"{rep['scenario']} / {rep['strategy']} on {rep['devices']} devices {rep['mesh']} [{rep['backend']}]",
        f"  verified against jax.jit: {'YES' if rep['verified'] else 'NO'} "
        f"(max abs err {rep['max_abs_err']:.3g}, max rel err {rep['max_rel_err']:.3g})",
        f"  collectives: {coll}",
        f"  comm bytes/device (ring): {rep['comm_bytes_per_device']:.0f}   "
        f"peak bytes/device: {rep['peak_bytes_per_device']}",
        f"  wall: {rep['wall_s']:.2f} s",
    ]
    for k in ("ranks", "devices_per_rank", "launch_s", "step_s"):
        if k in rep:
            lines[-1] += f"   {k}: {rep[k]:.3g}" if isinstance(rep[k], float) else f"   {k}: {rep[k]}"
    return "\n".join(lines)


def cmd_run(args) -> int:
    exp = _experiment(args)
    if args.backend == "local":
        from partir_emu.experiment import run_local
        rep = run_local(exp, algorithm=args.algorithm)
    else:
        from partir_emu.runtime.mpi_launch import run_mpi_cli
        rep = run_mpi_cli(exp, args)
        if rep is None:   # a non-zero rank under an external mpirun
            return 0
    _write_report(rep, args.report)
    print(_summary(rep))
    return 0 if rep["verified"] else 1


def cmd_show(args) -> int:
    exp = _experiment(args)
    low = exp.lower()
    if args.after_tactic is not None:
        k = args.after_tactic
        if not 0 <= k < len(low.states):
            raise UsageError(f"--after-tactic {k}: the schedule has {len(low.states) - 1} tactic(s); "
                               f"use 0..{len(low.states) - 1} (0 = before any tactic)")
        print(low.states[k].pretty(show_all=args.all))
        return 0
    print(low.spmd)
    print()
    print(low.stats())
    if args.output:
        low.spmd.save(args.output)
        print(f"wrote {args.output}")
    return 0


def cmd_list(args) -> int:
    from scenarios import get_scenario, list_scenarios
    for name in list_scenarios():
        s = get_scenario(name)
        print(f"{name}: {s.description}")
        print(f"  strategies: {', '.join(sorted(s.strategies))}")
        presets = ", ".join(f"{k}{' (simulation only)' if k in s.simulation_only else ''}" for k in s.presets)
        print(f"  sizes: {presets}; --set names: {', '.join(s.size_names)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="partir-emu", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("run", help="run one step on an emulated mesh and verify it against jax.jit")
    _add_common(p)
    p.add_argument("--backend", choices=("local", "mpi"), default="local")
    p.add_argument("--algorithm", default="ring", help="collective algorithm (ring, bidir_ring, recursive, "
                   "torus, hierarchical, direct; mpi backend also: native)")
    p.add_argument("--devices", type=int, default=None, help="mpi backend: number of devices (= mesh size)")
    p.add_argument("--devices-per-rank", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the MPI job is stopped")
    p.add_argument("--trace-messages", default=None, help="mpi backend: write every transfer to this file")
    p.add_argument("--inputs", default=None, help="load inputs from this .npz instead of generating them")
    p.add_argument("--report", default=None, help="write the JSON report here")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("show", help="print the SPMD program, or the sharding state after a tactic")
    _add_common(p)
    p.add_argument("--after-tactic", type=int, default=None, metavar="K")
    p.add_argument("--all", action="store_true", help="with --after-tactic: list unsharded equations too")
    p.add_argument("--output", default=None, help="also save the SPMD program (JSON, versioned)")
    p.set_defaults(fn=cmd_show)

    p = sub.add_parser("list", help="list scenarios, their strategies and sizes")
    p.set_defaults(fn=cmd_list)

    for extra in _EXTRA:
        extra(sub)
    return ap


_EXTRA: list = []   # later subcommands (simulate, hardware, validate, replay) register here


def _register_extras() -> None:
    import importlib
    for mod in ("partir_emu.hwmodels.cli", "partir_emu.hwmodels.des.cli"):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:
                raise
            continue
        if m.add_subcommands not in _EXTRA:   # main() may be called many times in one process
            _EXTRA.append(m.add_subcommands)


def main(argv: Sequence[str] | None = None) -> int:
    _register_extras()
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        return args.fn(args)
    except PartirError as exc:
        print(f"partir-emu {args.cmd}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if getattr(args, "verbose", False):
            print(f"({time.perf_counter() - t0:.2f} s)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
