"""``partir-emu``: run, show, list, simulate, hardware, fidelity, validate, replay, compare-xla.

Every subcommand checks its paths and numbers before it lowers anything
(:mod:`partir_emu.app.checks`). Exit statuses (:mod:`partir_emu.app.cli.exits`, also in
``--help``): 0 success / verified, 1 not verified, 2 bad input (one line naming
what to change), 3 internal error (one line; ``PARTIR_EMU_DEBUG=1`` for the
traceback), 128+N stopped by signal N.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from partir_emu.app import checks
from partir_emu.app.atomic import atomic_path
from partir_emu.app.cli import check as check_cli
from partir_emu.app.cli import des as des_cli
from partir_emu.app.cli import exits
from partir_emu.app.cli import fidelity as fidelity_cli
from partir_emu.app.cli import simulate as simulate_cli
from partir_emu.app.cli.mpi_run import MPI_TIMEOUT_S, run_mpi_cli
from partir_emu.app.cli.phases import Phases
from partir_emu.app.common import add_experiment_args, experiment_from_args, print_warnings, write_report
from partir_emu.app.experiment import run_local
from partir_emu.app.outputs import check_outputs
from partir_emu.app.study import cli as study_cli
from partir_emu.app.xla import compare as compare_xla
from partir_emu.errors import PartirError, UsageError
from partir_emu.mpi.environ import mpirun_rank
from partir_emu.mpi.interrupts import describe, exit_status, leave_now, signals_raise
from partir_emu.runtime.kernels import KERNELS
from scenarios import get_scenario, list_scenarios


def _verdict_line(rep: dict) -> str:
    yes = "YES" if rep["verified"] else "NO"
    if rep["verdict"]["criterion"].startswith("strict"):
        return (f"  verified (strict: loss and gradients elementwise vs jax.jit): {yes} (largest |diff| / tolerance "
                f"{rep['error']:.2f}, at {rep['worst_output']!r})")
    w = rep["verdict"]["worst"] or {}
    return (f"  verified: {yes} (vs float64: error {rep['error']:.2e}, jax.jit's own {rep['baseline_error']:.2e}; "
            f"closest to its bound: {rep['worst_output']!r}, {w.get('excess', 0.0):.1e} beyond the reach of correct "
            f"runs in other summation orders, allowed {w.get('bound', 0.0):.1e})")


def _summary(rep: dict) -> str:
    coll = ", ".join(f"{k}={v}" for k, v in sorted(rep["collectives"].items())) or "none"
    lines = [
        f"{rep['scenario']} / {rep['strategy']} on {rep['devices']} devices {rep['mesh']} [{rep['backend']}]",
        _verdict_line(rep),
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
    exp = experiment_from_args(args)
    checks.check_run_args(args, exp)        # paths, numbers, sizes, a memory lower bound: before lowering
    with Phases("run", quiet=args.quiet) as phases:
        if args.backend == "local":
            phases.phase("lowering")
            t0 = time.perf_counter()
            low = exp.lower()
            lower_s = time.perf_counter() - t0
            print_warnings(low.warnings)
            checks.check_run_memory(low.spmd, exp.mesh.size)      # before any array is allocated
            phases.phase("step and verify")
            rep = run_local(exp, algorithm=args.algorithm, lowered=low, kernels=args.kernels)
            rep["lower_s"], rep["wall_s"] = lower_s, rep["wall_s"] + lower_s
        else:
            phases.phase("MPI run (lowering, launch, step, gather, verify)")
            mpi_rep = run_mpi_cli(exp, args)
            if mpi_rep is None:   # a non-zero rank under an external mpirun
                return 0
            rep = mpi_rep
    write_report(rep, args.report)
    print(_summary(rep))
    return 0 if rep["verified"] else 1


def cmd_show(args) -> int:
    checks.check_output_path(args.output, "--output")
    exp = experiment_from_args(args)
    checks.check_mesh_size(exp.mesh, checks.MAX_SIMULATE_DEVICES, "show")
    with Phases("show", quiet=args.quiet) as phases:
        phases.phase("lowering")
        low = exp.lower()
    print_warnings(low.warnings)
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
    for label, res in low.final_state.auto_results:     # what each AutomaticPartition chose and why
        print("\n" + res.report(label))
    if args.output:
        with atomic_path(args.output) as tmp:
            low.spmd.save(tmp)
        print(f"wrote {args.output}")
    return 0


def cmd_list(args) -> int:
    for name in list_scenarios():
        s = get_scenario(name)
        print(f"{name}: {s.description}")
        print(f"  strategies: {', '.join(sorted(s.strategies))}")
        for names, when in s.strategy_notes.items():
            print(f"  also {names}: {when}")
        presets = ", ".join(f"{k}{' (simulation only)' if k in s.simulation_only else ''}" for k in s.presets)
        print(f"  sizes: {presets}; --set names: {', '.join(s.size_names)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = exits.OneLineParser(prog="partir-emu", description=__doc__.splitlines()[0], epilog=exits.EPILOG,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run one step on an emulated mesh and verify it against jax.jit")
    add_experiment_args(p)
    p.add_argument("--backend", choices=("local", "mpi"), default="local")
    p.add_argument("--strict", action="store_true",
                   help="run the step stopped before the optimizer and check loss and gradients elementwise "
                        "(rtol 1e-5, atol 1e-6) against jax.jit, instead of the float64 normwise verdict")
    p.add_argument("--algorithm", default="ring", help="collective algorithm (ring, bidir_ring, recursive, "
                   "torus, hierarchical, direct; mpi backend also: native)")
    p.add_argument("--kernels", choices=KERNELS, default="blas",
                   help="matmul kernel: blas (OpenBLAS, on one thread), or exact (a fixed-order sum: row-tiled "
                        "results equal the unpartitioned ones bit for bit on any CPU; slower)")
    p.add_argument("--devices", type=checks.positive_int, default=None,
                   help="mpi backend: number of devices (= mesh size)")
    p.add_argument("--devices-per-rank", type=checks.positive_int, default=None,
                   help="mpi backend: emulated devices per MPI rank (default 1)")
    p.add_argument("--timeout", type=checks.seconds, default=None,
                   help=f"--backend mpi: seconds before the MPI job is stopped (default {MPI_TIMEOUT_S:g})")
    p.add_argument("--hosts", default=None, metavar="H1:N,H2:N",
                   help="--backend mpi: run the ranks on these hosts, N ranks each (hydra's -hosts); the program "
                        "and inputs go over MPI, no shared file system is needed")
    p.add_argument("--hostfile", default=None, metavar="FILE", help="--backend mpi: hosts from a file of "
                   "HOST[:N] lines (hydra's -f)")
    p.add_argument("--launcher", default=None, metavar="NAME", help="--backend mpi: how hydra starts the other "
                   "hosts' proxies: ssh (default), rsh, slurm, lsf, sge, ...")
    p.add_argument("--launcher-exec", default=None, metavar="PROGRAM", help="--backend mpi: the program the "
                   "launcher runs instead of ssh (hydra's -launcher-exec)")
    p.add_argument("--workdir", default=None, metavar="DIR", help="--backend mpi with hosts: keep the program, "
                   "inputs and results in DIR, which every host sees at the same path, instead of sending them over MPI")
    p.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)   # tests: partir_emu.mpi.faults
    p.add_argument("--trace-messages", default=None, help="mpi backend: write every transfer to this file")
    p.add_argument("--inputs", default=None, help="load inputs from this .npz instead of generating them")
    p.add_argument("--report", default=None, help="write the JSON report here")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("show", help="print the SPMD program, or the sharding state after a tactic")
    add_experiment_args(p)
    p.add_argument("--after-tactic", type=checks.nonnegative_int, default=None, metavar="K")
    p.add_argument("--all", action="store_true", help="with --after-tactic: list unsharded equations too")
    p.add_argument("--output", default=None, help="also save the SPMD program (JSON, versioned)")
    p.set_defaults(fn=cmd_show)

    p = sub.add_parser("list", help="list scenarios, their strategies and sizes")
    p.set_defaults(fn=cmd_list)

    simulate_cli.add_subcommands(sub)
    fidelity_cli.add_subcommands(sub)
    check_cli.add_subcommands(sub)
    study_cli.add_subcommands(sub)
    des_cli.add_subcommands(sub)
    compare_xla.add_subcommands(sub)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:           # --help (0) or a usage error (2, one line already printed)
        return exc.code if isinstance(exc.code, int) else exits.BAD_INPUT
    t0 = time.perf_counter()
    try:
        with signals_raise():       # SIGTERM/SIGHUP unwind like Ctrl-C: the MPI launcher cleans up
            check_outputs(args)     # before any work: no output may replace an input or a device
            return args.fn(args)
    except PartirError as exc:
        if mpirun_rank() in (None, 0):      # under the user's mpirun every rank has the same error
            print(exits.one_line(f"partir-emu {args.cmd}: error: {exc}"), file=sys.stderr)
        return exits.BAD_INPUT
    except KeyboardInterrupt as exc:    # Ctrl-C, SIGTERM, SIGHUP: one line, exit 128 + signum
        if mpirun_rank() in (None, 0):
            print(f"partir-emu {args.cmd}: {describe(exc)}", file=sys.stderr)
        if "jax" in sys.modules:        # an interrupted jax call can crash the exit (see leave_now)
            leave_now(exit_status(exc))
        return exit_status(exc)
    except Exception as exc:            # a bug, not the user's input: one line, where to report it
        return exits.report_internal_error(args.cmd, exc)
    finally:
        if getattr(args, "verbose", False):
            print(f"({time.perf_counter() - t0:.2f} s)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
